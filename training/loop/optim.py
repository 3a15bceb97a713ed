"""The optimizer (``train.optimizer``, ``train.optimizer_kwargs``), its parameter groups and its schedule.

Weight decay (``train.weight_decay``) applies to weight matrices only: biases, normalisation
weights and embeddings are not decayed, as in every reference trainer (decaying a LayerNorm
gain or an embedding pulls it towards zero for no regularising gain). A parameter is exempt
when it has fewer than 2 dimensions or belongs to an embedding or a normalisation module
(a torch norm class, or any module whose class name contains "Norm", such as a user's RMSNorm).

The schedule runs per optimizer step: ``train.warmup_steps`` of linear warmup (step s of the
warmup at lr x (s + 1) / warmup_steps, so the last warmup step is at the full lr), then
constant, or cosine over the steps left (``train.lr_schedule``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.core.config import TrainConfig

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
_NO_DECAY_MODULES = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def decays(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether weight decay applies to ``param``, a parameter of ``module`` itself (module docstring)."""
    exempt_module = isinstance(module, _NO_DECAY_MODULES) or "Norm" in type(module).__name__
    return param.ndim >= 2 and not exempt_module


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """[decayed weight matrices, the rest with weight_decay 0], each parameter once (tied ones too), empty
    groups left out."""
    decayed, exempt, seen = [], [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            (decayed if decays(module, param) else exempt).append(param)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``param_groups``; a bad ``train.optimizer_kwargs`` entry is named."""
    optimizer_class = OPTIMIZERS[train.optimizer]
    try:
        return optimizer_class(
            param_groups(model, train.weight_decay), lr=train.learning_rate(), **train.optimizer_kwargs
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"train.optimizer_kwargs {train.optimizer_kwargs} do not suit train.optimizer={train.optimizer!r} "
            f"({optimizer_class.__name__}): {error}"
        ) from error


def build_schedule(
    optimizer: torch.optim.Optimizer, train: TrainConfig, optimizer_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Warmup, then constant or cosine over the run's ``optimizer_steps``; None when the lr never changes."""
    warmup = min(train.warmup_steps, optimizer_steps)
    cosine = train.lr_schedule == "cosine"
    if warmup == 0:
        # Exactly today's schedule without warmup (the same lr values, bit for bit).
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=optimizer_steps) if cosine else None
    ramp = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, total_iters=max(1, warmup - 1))
    if not cosine or warmup == optimizer_steps:
        return ramp
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=optimizer_steps - warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])


def optimizer_states_per_parameter(train: TrainConfig) -> int:
    """Tensors of a parameter's size the optimizer keeps: Adam(W) two moments (three with amsgrad), SGD a
    momentum buffer when momentum is set, else none (placement's memory estimate)."""
    kwargs = train.optimizer_kwargs
    if train.optimizer == "sgd":
        return 1 if kwargs.get("momentum", 0) else 0
    return 3 if kwargs.get("amsgrad") else 2
