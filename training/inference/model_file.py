"""model.pt, written and read in this one module: what the Trainer saves at the end of a run
(``inference_checkpoint``), what a final model file must hold (``REQUIRED_CHECKPOINT_KEYS``), the model rebuilt
from it with its weights, inputs and encoders, and what an evaluation of it returns (``EvalResult``). Both
evaluators (``evaluate.py`` for rows, ``token_scoring.py`` for a language model's tokens) and serving read a
model.pt through this module only; the Checkpointer (``training/checkpoint/files.py``) writes it atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.core.manifest import Manifest
from training.kinds.base import Codec
from training.kinds.inputs import InputInfo, block_names, inputs_from_manifest
from training.kinds.registry import codecs_for
from training.models.registry import ModelSpec, build_model

# What a model.pt must hold (docs/architecture.md) to be evaluated or served.
REQUIRED_CHECKPOINT_KEYS = (
    "model",
    "model_spec",
    "features",
    "feature_mean",
    "feature_std",
    "task",
    "label",
    "label_mapping",
)


# A training script's model (ddpflow.log_model): its torch.export program's bytes stand for the architecture and the
# weights, and ``model_spec`` names it EXPORTED (its inputs are the dataset's, its weights not in "model").
PROGRAM = "program"
EXPORTED = "exported"


class IncompatibleModelError(ValueError):
    """A checkpoint cannot score a dataset: other features, task or classes."""


@dataclass
class EvalResult:
    task: str  # what the evaluation scored: the objective's ``Evaluation.scored_as`` (the dataset's task, or its own)
    split: str
    samples: int
    metrics: dict[str, float]  # flat, MLflow-ready: "<split>_accuracy", "<split>_rmse", ...
    seconds: float
    class_labels: list[str] | None = None  # the dataset's classes, in index order
    # Rows: true class, columns: predicted; None above CONFUSION_MAX_CLASSES classes (per_class has them all).
    confusion_matrix: list[list[int]] | None = None
    per_class: dict[str, dict[str, float]] | None = None  # label -> precision, recall, support
    # Only with return_predictions: class indices (dataset's index space), multi-hot rows [N, C] (multilabel)
    # or regression values.
    predictions: np.ndarray | None = field(default=None, repr=False)
    targets: np.ndarray | None = field(default=None, repr=False)
    # Classification with an input shown as pictures (an image input: Codec.shown_as): the first
    # MISCLASSIFIED_SHOWN wrong rows, {"bytes" (its encoded bytes), "true", "predicted" (labels), "input"}, for
    # the grid of misclassified images (ddpflow/tracking/plots.py).
    misclassified: list[dict[str, Any]] | None = field(default=None, repr=False)
    # A classifier with text inputs: its most confidently wrong rows (inference/wrong_rows.py), a table artifact.
    confidently_wrong: dict[str, list] | None = field(default=None, repr=False)  # {"columns", "data"}
    # The objective's figure (training/objectives/base.py: Evaluation.figure), None for the task's own.
    figure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """What ``eval/metrics.json`` holds (no per-row arrays)."""
        return {
            "task": self.task,
            "split": self.split,
            "samples": self.samples,
            "seconds": self.seconds,
            "metrics": self.metrics,
            "class_labels": self.class_labels,
            "confusion_matrix": self.confusion_matrix,
            "per_class": self.per_class,
        }


def load_model_checkpoint(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model from ``model_spec`` and load its weights, in eval mode (a training script's model: its
    exported program, loaded).

    Returns the model and the checkpoint's other entries (everything except the
    state dict). ``weights_only=True``: a checkpoint cannot run code on load (nor does a torch.export program).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model checkpoint {path} does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    meta = checkpoint_meta(checkpoint, path)
    if PROGRAM in checkpoint:
        return exported_module(checkpoint[PROGRAM]), meta
    model = build_model(ModelSpec.from_dict(checkpoint["model_spec"], checkpoint["features"]), checkpoint["features"])
    model.load_state_dict(checkpoint["model"])
    return model.eval(), meta


@dataclass(frozen=True)
class ModelFile:
    """A model.pt read once, for a process that only describes the model (batch scoring's command: it hashes,
    checks and copies the same bytes): its bytes, and ``load_model_checkpoint``'s entries (``meta``: task,
    inputs, key, labels); no model is built."""

    path: str
    data: bytes = field(repr=False)
    meta: dict[str, Any] = field(repr=False)

    @classmethod
    def read(cls, path: str | Path) -> ModelFile:
        import io

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model checkpoint {path} does not exist")
        data = path.read_bytes()
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return cls(str(path), data, checkpoint_meta(checkpoint, path))


def checkpoint_meta(checkpoint: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A loaded model.pt's entries but its weights (a ValueError naming what a final model file lacks), with its
    ``model_spec`` complete (its inputs also for a model.pt whose spec has none: its features, numeric)."""
    missing = [key for key in REQUIRED_CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"model checkpoint {path} lacks keys {missing}; is it a final model.pt (not checkpoints/last.pt)?"
        )
    spec = ModelSpec.from_dict(checkpoint["model_spec"], checkpoint["features"])
    meta = {key: value for key, value in checkpoint.items() if key not in ("model", PROGRAM)}
    meta["model_spec"] = spec.to_dict()
    return meta


def checkpoint_inputs(meta: dict[str, Any]) -> dict[str, InputInfo]:
    """The model's inputs, in order (a model.pt whose spec has no ``inputs``: its features, numeric)."""
    return ModelSpec.from_dict(meta["model_spec"], meta["features"]).input_infos(meta["features"])


def checkpoint_codecs(meta: dict[str, Any]) -> dict[str, Codec]:
    """The model's own encoders (fitted on ITS train split): they encode any dataset's raw shards alike."""
    return codecs_for(checkpoint_inputs(meta), meta.get("encoders") or {})


EVAL_BATCH_BYTES = 256 << 20  # an evaluation batch's decoded inputs stay within about this much memory


def inference_checkpoint(
    state_dict: dict[str, Any],
    spec: ModelSpec,
    manifest: Manifest,
    epochs: int,
    metrics: dict[str, Any],
    encoders: dict[str, Any] | None = None,
    selection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``model.pt``: the weights plus everything evaluation and serving need to rebuild
    the model and feed it raw columns (architecture, feature order, normalisation, labels).

    ``epochs``: the epochs trained; ``metrics``: the selected epoch's; ``selection``: which epoch the
    weights are from and why (``training/loop/selection.py: Selection.describe``; None: the last one)."""
    return {
        "model": state_dict,
        "model_spec": spec.to_dict(),
        "features": list(manifest.features),
        "feature_mean": list(manifest.feature_mean),
        "feature_std": list(manifest.feature_std),
        # The scaling the model was trained with (robust by default); None before PREPARE_VERSION 6: mean/std.
        "feature_center": manifest.feature_center,
        "feature_scale": manifest.feature_scale,
        "feature_clip": manifest.feature_clip,
        # Regression: the model predicts the standardised target; None (old files too) = raw scale.
        "label_mean": manifest.label_mean,
        "label_std": manifest.label_std,
        "task": manifest.task,
        "label": manifest.label,
        "label_mapping": manifest.label_mapping,
        # data.key, the rows' stable id: what batch scoring keeps beside the scores by default (score.keep).
        "key": manifest.key,
        "fingerprint": manifest.fingerprint,
        "epochs": epochs,
        "metrics": metrics,
        # The fitted encoders (encoders.json, by training/kinds/registry.py) and the weight column: raw rows in.
        "encoders": encoders or {},
        "weight": manifest.weight,
        # Each input's type in the source, as prepare read it ("int64", "bool", "float"...): what the served
        # model's signature declares (training/inference/serving.py: raw_example). Absent: float64.
        "source_types": source_types(manifest),
        "selected_epoch": selection["selected_epoch"] if selection else metrics.get("epoch", epochs - 1),
        "selection": selection,
    }


class ExportedModel(nn.Module):
    """A torch.export program's module, for the callers of any model: it was exported in eval mode, and
    ``train()``/``eval()`` (which an exported module refuses) change nothing in it."""

    def __init__(self, program: nn.Module):
        super().__init__()
        self.program = program

    def forward(self, *args: Any) -> Any:
        return self.program(*args)

    def train(self, mode: bool = True) -> ExportedModel:
        self.training = mode  # this wrapper's flag only: the program runs as it was exported
        return self


def exported_module(program: bytes) -> ExportedModel:
    """The module of a torch.export program's bytes (``torch.export.save``): no pickled code runs."""
    import io

    return ExportedModel(torch.export.load(io.BytesIO(program)).module())


def exported_checkpoint(program: bytes, manifest: Manifest, encoders: dict[str, Any] | None) -> dict[str, Any]:
    """model.pt of a training script's model trained on a prepared dataset (``ddpflow.dataset``, the model
    contract's batch in, ``[B, n_outputs]`` out): its program, and what evaluation and serving need of the dataset,
    as ``inference_checkpoint`` records it for ddpflow's own models (the objective ``auto`` picks for the task)."""
    inputs = inputs_from_manifest(manifest)
    spec = ModelSpec(EXPORTED, len(block_names(inputs)), manifest.n_outputs, {}, [i.to_dict() for i in inputs.values()])
    checkpoint = inference_checkpoint({}, spec, manifest, 0, {}, encoders)
    return {**checkpoint, PROGRAM: program, "objective": {"name": "auto", "kwargs": {}}, "selected_epoch": None}


def source_types(manifest: Manifest) -> dict[str, str]:
    """The inputs' Arrow types in the source (the manifest's ``schema``), by name."""
    inputs = set(manifest.input_names())
    return {column["name"]: column["type"] for column in manifest.schema if column["name"] in inputs}
