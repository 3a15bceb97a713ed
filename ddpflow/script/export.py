"""``ddpflow.log_model(model, input_example=None)``: a training script's model, exported for the registry.

    ddpflow.log_model(model, input_example=next(iter(loader))[0])

Safe on every rank: rank 0's model is kept (a DistributedDataParallel or torch.compile wrapper unwrapped), every
other rank returns at once. Rank 0 exports a CPU copy in eval mode with ``torch.export`` (the batch dimension of
every input dynamic) and writes the program to ``RUN_DIR/script/model.pt2``, with the example and the model's
outputs on it (``RUN_DIR/script/example.pt``). After the launch ddpflow evaluates, registers behind the champion
gate and serves that program (``ddpflow/tracking/script_models.py``): the served model needs neither the script nor
its imports, and loading it runs no pickled code. A later call replaces an earlier one's model.

``input_example``: one batch of what ``forward`` takes: a tensor, a tuple of tensors, or a dict of tensors (the
model contract's batch). Unset with a data section: two rows of the prepared train split (``ddpflow.dataset``). A
one-row example is doubled, so the exported batch dimension is not fixed at 1.

A module ``torch.export`` cannot take is refused with its reason (``RUN_DIR/script/model_refused.json`` and one
line on rank 0): the run is tracked, not registered, and the script goes on. Under a bare torchrun nothing is
exported; rank 0 says so once.
"""

from __future__ import annotations

import copy
import io
import traceback
from typing import Any

from ddpflow.script.run import ScriptRun, current_run, rank, say_once
from training.core.fileio import atomic_write, atomic_write_json
from training.core.layout import SCRIPT_EXAMPLE, SCRIPT_PROGRAM, SCRIPT_REFUSED

REASON_LINES = 20  # of torch.export's message, in the refusal


class NoExampleError(ValueError):
    """log_model without an input example, in a run whose script has no data section to take one from."""


def log_model(model: Any, input_example: Any = None) -> None:
    """Export ``model`` for the registry (module doc); never raises for a model torch.export refuses."""
    if rank() != 0:
        return
    run = current_run()
    if run is None:
        say_once("log_model", "not run by ddpflow, so log_model() exports nothing (`ddpflow run` registers it)")
        return
    args = _as_args(input_example if input_example is not None else _example_from_data(run))
    module = _cpu_eval_copy(_unwrapped(model))
    try:
        program, args, outputs = export_module(module, args)
    except Exception as error:  # torch.export's reason, for the user: the run goes on, tracked, not registered
        refuse(run, error)
        return
    run.file(SCRIPT_REFUSED).unlink(missing_ok=True)
    import torch

    atomic_write(run.file(SCRIPT_EXAMPLE), lambda handle: torch.save({"args": args, "outputs": outputs}, handle))
    atomic_write(run.file(SCRIPT_PROGRAM), lambda handle: handle.write(program))
    print(f"ddpflow: log_model exported {type(module).__name__} to {run.file(SCRIPT_PROGRAM)}", flush=True)


def export_module(module: Any, args: tuple) -> tuple[bytes, tuple, Any]:
    """``torch.export`` of ``module`` on ``args`` with a dynamic batch dimension: the program's bytes, the example
    it was exported on (``args``, a one-row batch doubled) and the module's outputs on it."""
    import torch
    from torch.export import Dim, export
    from torch.utils._pytree import tree_map

    args = tree_map(_at_least_two_rows, args)
    dynamic = tree_map(lambda leaf: {0: Dim.AUTO} if _batched(leaf) else None, args)
    exported = export(module, args, dynamic_shapes=dynamic)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    with torch.no_grad():
        outputs = module(*args)
    return buffer.getvalue(), args, outputs


def refuse(run: ScriptRun, error: BaseException) -> None:
    """Record why the model cannot be exported, and say it once on rank 0."""
    lines = traceback.format_exception_only(type(error), error)
    reason = "".join(lines).strip().splitlines()[:REASON_LINES]
    atomic_write_json(run.file(SCRIPT_REFUSED), {"error": type(error).__name__, "reason": "\n".join(reason)})
    run.file(SCRIPT_PROGRAM).unlink(missing_ok=True)
    print(f"ddpflow: log_model could not export the model, so it will not be registered: {reason[0]}", flush=True)


def _unwrapped(model: Any) -> Any:
    """The module inside DistributedDataParallel (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def _cpu_eval_copy(module: Any) -> Any:
    """A copy on the CPU in eval mode: the training module (its device, its mode) is left as it is."""
    return copy.deepcopy(module).cpu().eval()


def _as_args(example: Any) -> tuple:
    """forward's positional arguments: a tuple as given, anything else (a tensor, a dict) as the one argument; on
    the CPU."""
    from torch.utils._pytree import tree_map

    args = example if isinstance(example, tuple) else (example,)
    return tree_map(lambda leaf: leaf.detach().cpu() if hasattr(leaf, "detach") else leaf, args)


def _batched(leaf: Any) -> bool:
    return hasattr(leaf, "dim") and leaf.dim() >= 1


def _at_least_two_rows(leaf: Any) -> Any:
    """A one-row tensor doubled: torch.export would fix a batch dimension of 1."""
    import torch

    if _batched(leaf) and leaf.shape[0] == 1:
        return torch.cat([leaf, leaf])
    return leaf


def _example_from_data(run: ScriptRun) -> Any:
    if run.dataset_dir is None:
        raise NoExampleError(
            "ddpflow.log_model(model) needs input_example=<one batch of what forward takes>: this run has no "
            "data section to take an example from"
        )
    from ddpflow.script.data import example_batch

    return example_batch(run.dataset_dir)
