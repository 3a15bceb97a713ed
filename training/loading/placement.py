"""Where a rank's split tensors live: ``train.data_on_device`` (auto | true | false).

On the device, a split is copied there ONCE and ``training/loading/batches.py`` gathers
each batch where the split lives: per step only the batch's row numbers
(8 bytes a row) cross to the device, not its sections (features, inputs, labels, weights).

- ``false``: the split stays on the host (the node cache's shared mapping);
  each batch is gathered there and copied over (pinned, non-blocking on CUDA).
- ``true``: always on the device; a split that does not fit stops the run with
  an error naming the setting.
- ``auto``: on a GPU when the split fits comfortably: at most a quarter of the
  device memory still free after the model, counting the gradients and the
  optimizer state it has yet to allocate (``training/loop/optim.py:
  optimizer_states_per_parameter``: Adam(W) two moments, SGD with momentum one). On the CPU the device IS the
  host, so the split stays in the shared mapping (a per-rank copy would undo
  the node cache); ``true`` on the CPU keeps it there too (``.to`` is a no-op),
  which is why the CPU runs the same gather path as a GPU.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from training.core.fileio import byte_size
from training.loading.batches import SplitArrays

DataOnDevice = bool | Literal["auto"]
AUTO_SHARE = 4  # auto: a split may take at most 1/AUTO_SHARE of the free device memory
ADAMW_STATES = 2  # AdamW's two moments per parameter: the default optimizer


def split_bytes(split: SplitArrays) -> int:
    """The bytes a device would hold: the numeric block, the other inputs, labels and weights. Ragged inputs
    (text, images) stay on the host, where their codec collates them per batch."""
    return sum(tensor.numel() * tensor.element_size() for tensor in split.row_sections().values())


def training_state_to_come(model: nn.Module, optimizer_states: int = ADAMW_STATES) -> int:
    """Bytes the optimizer step will still allocate on the device (the weights themselves are there already):
    each parameter's gradient and ``optimizer_states`` tensors of its size."""
    return (1 + optimizer_states) * sum(p.numel() * p.element_size() for p in model.parameters())


def decide(mode: DataOnDevice, device: torch.device, needed: int, free: int) -> tuple[bool, str]:
    """(place on the device?, why). ``needed``: the split's bytes; ``free``: device bytes free for data."""
    if mode is False:
        return False, "train.data_on_device=false"
    if mode is True:
        return True, "train.data_on_device=true"
    if device.type != "cuda":
        return False, "auto: the device is the host, the split stays in the node's shared copy"
    budget = max(0, free) // AUTO_SHARE
    verdict = "at most" if needed <= budget else "more than"
    free_text = byte_size(free)
    return needed <= budget, f"auto: {byte_size(needed)} is {verdict} a quarter of the {free_text} free after the model"


def place_splits(
    splits: dict[str, SplitArrays],
    mode: DataOnDevice,
    device: torch.device,
    model: nn.Module,
    optimizer_states: int = ADAMW_STATES,
) -> tuple[dict[str, SplitArrays], list[str]]:
    """The splits, each moved to ``device`` or left where it is, in order; and one reason per split."""
    free = _free_device_bytes(device) - training_state_to_come(model, optimizer_states)
    placed, reasons = {}, []
    for name, split in splits.items():
        on_device, why = decide(mode, device, split_bytes(split), free)
        placed[name] = _to_device(name, split, device) if on_device else split
        if on_device and device.type == "cuda":
            free -= split_bytes(split)
        reasons.append(f"{name} {'on ' + str(device) if on_device else 'on the host'} ({why})")
    return placed, reasons


def _to_device(name: str, split: SplitArrays, device: torch.device) -> SplitArrays:
    try:
        return split.with_sections({section: tensor.to(device) for section, tensor in split.row_sections().items()})
    except torch.OutOfMemoryError as error:
        raise RuntimeError(
            f"train.data_on_device=true: the {name} split ({byte_size(split_bytes(split))}) does not fit on {device}; "
            "use auto (places it only where it fits) or false"
        ) from error


def _free_device_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # unused: auto keeps host data on the host
    free, _total = torch.cuda.mem_get_info(device)
    return free
