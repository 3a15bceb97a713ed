"""The logged MLflow model: a pyfunc that wraps ``Predictor``.

    model = mlflow.pyfunc.load_model("models:/ddpflow-model@champion")
    model.predict(frame_of_raw_feature_columns)   # original labels / floats
    language_model.predict(frame_with_the_text)   # next_token: tokens, loss, perplexity per row

A next_token model is served by ``training/inference/token_scoring.py: TokenScorer``: the text column in (raw strings,
tokenized with the shipped tokenizer, cut to max_len as in training), per row ``tokens`` (targets scored),
``loss`` (mean cross entropy per target token) and ``perplexity`` out; NaN loss for a row without targets.

How it is logged, and why ("models from code" + ``artifacts`` + ``code_paths``):
- the weights are ``model.pt``, logged as the artifact ``model_pt`` and read
  with ``torch.load(weights_only=True)``: loading runs no pickled code, and a
  later run can download them to warm-start (``train.init_from: champion``);
- the model object is defined by the file ``training/inference/serving_model.py``
  (logged as-is, executed on load) instead of a cloudpickled
  ``PythonModel`` instance, which MLflow 3 warns about (pickles execute
  arbitrary code on load, and break when the class moves);
- ``code_paths`` ships the ``training`` package with the model, so it loads
  in any environment with the pinned requirements, without this repository;
- not ``mlflow.pytorch``: that serves the bare network (normalised tensors
  in, class indices out), not raw columns in, original labels out.

This module imports mlflow at the top (it exists only to be logged and
loaded); the rest of ``training/`` imports it lazily or not at all.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

from training.inference.model_file import load_model_checkpoint
from training.inference.predict import OUTPUTS, Predictor  # noqa: F401  (OUTPUTS: the served outputs, here too)
from training.inference.token_scoring import TokenScorer
from training.kinds.registry import CODECS, kind_record
from training.objectives.base import ROW_SCORER, TOKEN_SCORER
from training.objectives.registry import objective_from_checkpoint

MODEL_ARTIFACT = "model_pt"  # key in context.artifacts; stored as artifacts/model.pt in the model
MODEL_NAME = "model"  # the logged model's name
MODEL_CODE = Path(__file__).resolve().with_name("serving_model.py")
TRAINING_PACKAGE = Path(__file__).resolve().parents[1]  # the whole `training` package ships with the model


class TabularTorchModel(mlflow.pyfunc.PythonModel):
    """Raw input columns in (numbers, strings for categoricals and ids, lists for vectors), original labels
    (or regression values) out; with ``params={"output": "probabilities"}`` a classifier returns a frame of
    the label (multilabel: the row's list of labels) and one ``probability_<class>`` column per class.
    An unseen category is scored as unknown."""

    def load_context(self, context) -> None:
        self._predictor = load_predictor(context.artifacts[MODEL_ARTIFACT])

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None):
        return predictions(self._predictor, model_input, (params or {}).get("output", "label"))


SERVED_BY = {ROW_SCORER: Predictor, TOKEN_SCORER: TokenScorer}  # what serves a model, by its objective's scorer


def load_predictor(model_path: str | Path) -> Predictor | TokenScorer:
    """What serves ``model.pt``: its objective's scorer (``Evaluation.scorer``): a ``TokenScorer`` for a language
    model, else a ``Predictor``."""
    model, meta = load_model_checkpoint(model_path)
    scorer = objective_from_checkpoint(meta).evaluation(meta["task"]).scorer
    return SERVED_BY[scorer](model, meta)


def predictions(predictor: Predictor | TokenScorer, frame: pd.DataFrame, output: str = "label"):
    """What the served model returns for ``output`` (``OUTPUTS``); a next_token model: its scores."""
    if isinstance(predictor, TokenScorer):
        if output != "label":
            raise ValueError(
                f"params.output {output!r}: a next_token model returns tokens, loss and perplexity per row"
            )
        return predictor.score(frame)
    return predictor.scores(frame, output)


def raw_example(predictor: Predictor | TokenScorer, frame: pd.DataFrame) -> pd.DataFrame:
    """The input columns as a user sends them, as each kind's record writes them (``Codec.serving_example``:
    numbers of the source's own type, ``training/kinds/tabular.py: source_dtype``; lists of floats; strings and
    bytes as they are). The example makes the signature, so an integer column of the source is declared
    ``long``, a bool one ``boolean``, a float one ``double``: the source's own frame and a hand-built one
    pass MLflow's checks, and the model casts inside (``NumericCodec.encode``)."""
    example = frame[predictor.features].copy()
    source_types = predictor.meta.get("source_types") or {}  # absent from a model.pt: float64
    for name, info in predictor.inputs.items():
        example[name] = kind_record(info.kind).serving_example(example[name], source_types.get(name))
    return example


def accepting_nulls(signature, predictor: Predictor | TokenScorer):
    """The signature with every input column required (MLflow marks a column whose example holds a null
    optional, i.e. one that may be left out) and each input whose kind's record says so declared ``any``
    (``Codec.declared_any``: an integer input that imputes nulls, whose nulls MLflow's ``long`` refuses; a zoned
    or string time, which MLflow's ``datetime`` refuses), so MLflow lets through what the model's own encoding
    reads; a float column stays ``double`` (NaN, None and pandas' Float64 pass)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, Schema

    if not signature.inputs.has_input_names():
        return signature
    inputs = getattr(predictor, "inputs", {})
    source_types = predictor.meta.get("source_types") or {}
    columns = []
    for spec in signature.inputs.inputs:
        info = inputs.get(spec.name)
        loose = info is not None and kind_record(info.kind).declared_any(source_types.get(spec.name), info)
        columns.append(ColSpec(AnyType() if loose else spec.type, spec.name, required=True))
    return ModelSignature(Schema(columns), signature.outputs, signature.params)


def user_code_paths(model: str) -> list[str]:
    """A user factory's code to ship with the model (``train.model: package.module:factory``): its top-level
    package directory (or the module's file when it has none), so the model loads outside this repository."""
    if ":" not in model:
        return []
    import importlib

    module_name = model.partition(":")[0]
    top = importlib.import_module(module_name.split(".")[0])
    if top.__file__ is None:  # a namespace package (no __init__.py): the directory that holds the module
        module_file = Path(importlib.import_module(module_name).__file__).resolve()
        return [next(str(Path(p).resolve()) for p in top.__path__ if Path(p).resolve() in module_file.parents)]
    path = Path(top.__file__)
    return [str(path.parent if path.name == "__init__.py" else path)]


def pip_requirements(kinds: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Pinned to what is installed: skips MLflow's slow requirement inference. ``kinds``: the model's input
    kinds, each adding what it needs (``Codec.serving_packages``: text needs ``tokenizers``)."""
    from importlib.metadata import version

    extra = dict.fromkeys(package for kind in sorted(kinds) for package in CODECS[kind].serving_packages)
    packages = ("torch", "mlflow", "pandas", "numpy", "pyarrow", *extra)
    return [f"{package}=={version(package)}" for package in packages]


def log_pyfunc_model(
    model_path: str | Path, input_example: pd.DataFrame, run_id: str, tags: dict[str, str] | None = None
):
    """Log the pyfunc model as an output of MLflow run ``run_id``; returns ``ModelInfo``.

    ``Model.log`` with an explicit ``run_id`` (what ``mlflow.pyfunc.log_model``
    calls, minus the fluent "active run"): no run is started or ended here,
    so the pipeline's run stays RUNNING until the flow ends it. Uses the
    process-wide tracking URI (``ddpflow/tracking/runs.py: use_tracking_uri``).

    The input example is raw input columns (numbers of the source's kind,
    ``raw_example``: the signature declares integers as ``long``, bools as
    ``boolean``, floats as ``double``, so the rows a user trained on pass
    MLflow's checks unchanged; strings for categoricals and ids; lists for
    vectors); the signature has the ``output`` param (``OUTPUTS``).
    """
    from mlflow.models import infer_signature

    model_path = Path(model_path)
    predictor = load_predictor(model_path)
    example = raw_example(predictor, input_example)  # a next_token model: its text column alone
    return log_code_model(
        run_id,
        MODEL_CODE,
        artifacts={MODEL_ARTIFACT: str(model_path)},
        code_paths=[str(TRAINING_PACKAGE), *user_code_paths(predictor.meta["model_spec"]["model"])],
        signature=accepting_nulls(
            infer_signature(example, predictor.predict(example), params={"output": "label"}), predictor
        ),
        input_example=example,
        pip_requirements=pip_requirements({info.kind for info in predictor.inputs.values()}),
        metadata={"task": predictor.task, "features": predictor.features},
        tags=tags,
    )


def log_code_model(
    run_id: str, code: Path, *, metadata: dict[str, Any], tags: dict[str, str] | None = None, **logged: Any
):
    """A pyfunc model defined by the file ``code`` ("models from code"), logged as an output of MLflow run
    ``run_id`` in the run's own experiment: given only run_id, ``Model.log`` would put the model in the fluent
    "current" experiment (the Default one). ``logged``: ``Model.log``'s artifacts, code_paths, signature,
    input_example and pip_requirements."""
    from mlflow.models import Model

    client = mlflow.MlflowClient()
    experiment_id = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id, tags=tags)
    return Model.log(
        artifact_path=None,
        name=MODEL_NAME,
        flavor=mlflow.pyfunc,
        run_id=run_id,
        model_id=model.model_id,
        python_model=str(code),
        metadata={"python_version": platform.python_version(), **metadata},
        **logged,
    )
