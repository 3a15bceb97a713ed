"""A training script's exported model, logged as an MLflow pyfunc model (a script without a data section).

    info = log_program_model(run_dir / "script/model.pt2", run_dir / "script/example.pt", run_id=run_id)
    mlflow.pyfunc.load_model(info.model_uri).predict(batch)        # what the script's model answers

The program is the one ``ddpflow.log_model`` exported (ddpflow/script/export.py), logged with "models from code"
(``program_serving_model.py``, executed on load, with the ``training`` package shipped beside it): the served model
needs neither the script nor its imports, and loading it runs no pickled code. The input is what the script's
example was, by the signature logged with it: one tensor (an array, or a DataFrame of its columns), or named tensors
(a dict of arrays: a tuple's positions as ``input_0``, ``input_1``...; a dict's keys as they are); the output is the
forward's, as arrays (a tuple's or dict's parts as ``output_0``... or by their keys). The layout (which arrays make
forward's arguments) is an artifact beside the program.
A model with a data section is not served this way: it takes the model contract's batch, so it is served on the
source's raw rows like ddpflow's own (``serving.py``, through ``model_file.exported_checkpoint``).

This module imports mlflow at the top (it exists only to be logged and loaded), as ``serving.py`` does.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import torch

from training.inference.model_file import exported_module
from training.inference.serving import TRAINING_PACKAGE, log_code_model

PROGRAM_CODE = Path(__file__).resolve().with_name("program_serving_model.py")
PROGRAM_ARTIFACT, LAYOUT_ARTIFACT = "program", "layout"  # context.artifacts keys


class ExportedProgramModel(mlflow.pyfunc.PythonModel):
    """The program's module, fed the input's arrays as its layout says (module doc)."""

    def load_context(self, context) -> None:
        self._module = exported_module(Path(context.artifacts[PROGRAM_ARTIFACT]).read_bytes())
        self._layout = json.loads(Path(context.artifacts[LAYOUT_ARTIFACT]).read_text())

    def predict(self, context, model_input, params: dict[str, Any] | None = None):
        with torch.no_grad():
            return outputs_as_arrays(self._module(*forward_arguments(self._layout, model_input)))


def forward_arguments(layout: dict[str, Any], model_input: Any) -> tuple:
    """forward's arguments from the served input (an array, a DataFrame, or a dict of arrays by name)."""
    kind, names, dtypes = layout["kind"], layout["names"], layout["dtypes"]
    tensors = {name: _tensor(_array(model_input, name, kind), dtypes[name]) for name in names}
    if kind == "tensor":
        return tuple(tensors.values())
    return tuple(tensors.values()) if kind == "tuple" else (tensors,)


def _array(model_input: Any, name: str, kind: str) -> np.ndarray:
    if isinstance(model_input, dict):
        return np.asarray(model_input[name])
    if kind != "tensor":
        raise ValueError(f"the model takes named inputs {name!r}...: send a dict of arrays (MLflow 'inputs')")
    return model_input.to_numpy() if hasattr(model_input, "to_numpy") else np.asarray(model_input)


def _tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(getattr(torch, dtype))


def program_layout(args: tuple) -> tuple[dict[str, Any], Any]:
    """How forward's arguments are made from the served input, and that input for ``args``: one tensor (an array),
    a tuple of tensors (arrays named ``input_0``...) or a dict of tensors (arrays by its keys)."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        tensors, kind = {"input": args[0]}, "tensor"
    elif len(args) == 1 and isinstance(args[0], dict):
        tensors, kind = dict(args[0]), "dict"
    else:
        tensors, kind = {f"input_{i}": tensor for i, tensor in enumerate(args)}, "tuple"
    not_tensors = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"the model's example holds {not_tensors}, which are not tensors: serve tensors in")
    layout = {
        "kind": kind,
        "names": list(tensors),
        "dtypes": {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in tensors.items()},
    }
    arrays = {name: tensor.numpy() for name, tensor in tensors.items()}
    return layout, (arrays["input"] if kind == "tensor" else arrays)


def outputs_as_arrays(outputs: Any) -> Any:
    """The forward's outputs as the served model returns them (program_serving_model.py: ``_as_numpy``)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach().cpu().numpy()
    if isinstance(outputs, dict):
        return {name: outputs_as_arrays(value) for name, value in outputs.items()}
    if isinstance(outputs, (tuple, list)):
        return {f"output_{i}": outputs_as_arrays(value) for i, value in enumerate(outputs)}
    return outputs


def log_program_model(
    program_path: str | Path, example_path: str | Path, run_id: str, tags: dict[str, str] | None = None
):
    """Log the program as a pyfunc model, an output of MLflow run ``run_id``; returns ``ModelInfo``. Uses the
    process-wide tracking URI (``ddpflow/tracking/runs.py: use_tracking_uri``), as ``serving.log_pyfunc_model``."""
    from mlflow.models import infer_signature

    example = torch.load(example_path, weights_only=True)
    layout, served_input = program_layout(tuple(example["args"]))
    module = exported_module(Path(program_path).read_bytes())
    with torch.no_grad():
        served_output = outputs_as_arrays(module(*example["args"]))
    with tempfile.TemporaryDirectory(prefix="ddpflow-program-") as scratch:
        layout_path = Path(scratch) / "layout.json"
        layout_path.write_text(json.dumps(layout))
        return log_code_model(
            run_id,
            PROGRAM_CODE,
            artifacts={PROGRAM_ARTIFACT: str(program_path), LAYOUT_ARTIFACT: str(layout_path)},
            code_paths=[str(TRAINING_PACKAGE)],
            signature=infer_signature(served_input, served_output),
            input_example=served_input,
            pip_requirements=_requirements(),
            metadata={"exported_by": "ddpflow.log_model"},
            tags=tags,
        )


def _requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{package}=={version(package)}" for package in ("torch", "mlflow", "numpy")]
