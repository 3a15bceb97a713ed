"""The one rule for how many ranks a node runs and which backend they use: ``resolve_ranks``.

    layout = resolve_ranks(config.train, gpus=visible_gpus())
    layout.nproc_per_node, layout.world_size, layout.backend

Every caller uses it: the preflight (training/preflight.py), the torchrun argv and
environment (ddpflow/launch/command.py), the MLflow run's ``ddp.*`` tags and the
rank itself when it joins the process group (training/distributed/context.py).

The rule, in one sentence: a machine with GPUs runs one rank per GPU whatever the
backend (each rank takes GPU ``LOCAL_RANK``), a machine without GPUs runs one rank
unless ``train.nproc_per_node`` says more, and ``backend: auto`` is NCCL with GPUs
and gloo without. So ``backend: gloo`` with ``nproc_per_node: auto`` on a 4-GPU
machine is 4 ranks, each on its own GPU, talking gloo.

Why one rank on CPU: a single rank already uses every core through torch's
intra-op threads; N CPU ranks on one machine split those cores N ways and add a
gloo all-reduce of every gradient per step, so for the MLP-sized models this
project trains they are not faster (docs/benchmarks.md, DDP scaling). Several
CPU ranks remain available by setting an int.

No torch import at module level: the CLI and the launcher use this without paying for torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from training.core.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class RankLayout:
    """What a launch of ``train`` on this machine runs."""

    nproc_per_node: int
    nnodes: int
    backend: str  # "nccl" or "gloo", never "auto"
    gpus: int  # GPUs this node has (0: the ranks run on CPU)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def slots(self) -> int:
        """How many ranks this node can run: its GPUs, or its CPU cores when it has none."""
        return self.gpus if self.gpus > 0 else available_cores()

    @property
    def slot_kind(self) -> str:
        return "GPUs" if self.gpus > 0 else "CPU cores"


def resolve_ranks(train: TrainConfig, gpus: int | None = None) -> RankLayout:
    """``train.nproc_per_node`` and ``train.backend`` resolved for a node with ``gpus`` GPUs.

    ``gpus=None`` asks torch (``visible_gpus()``). Raises ConfigError for NCCL on a machine without GPUs.
    """
    gpus = visible_gpus() if gpus is None else gpus
    backend = resolve_backend(train.backend, gpus)
    nproc = int(train.nproc_per_node) if train.nproc_per_node != "auto" else max(1, gpus)
    return RankLayout(nproc_per_node=nproc, nnodes=train.nnodes, backend=backend, gpus=gpus)


def resolve_backend(requested: str, gpus: int) -> str:
    """``train.backend`` on a node with ``gpus`` GPUs: auto is NCCL with GPUs, gloo without."""
    if requested == "auto":
        return "nccl" if gpus > 0 else "gloo"
    if requested == "nccl" and gpus == 0:
        raise ConfigError("train.backend: 'nccl' needs CUDA GPUs, and this machine has none (use 'gloo' or 'auto')")
    return requested


# A GPU torch could use needs one of these: the NVIDIA driver's control node (or its /proc entry, in containers),
# ROCm's kernel driver, or WSL's GPU paravirtualisation. Without any of them torch.cuda sees no device.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> int:
    """GPUs torch can see (0 without CUDA). A Linux machine without a GPU driver's node has none: 0 without
    importing torch (a command that starts torchrun need not pay for it first). Elsewhere torch is asked (imported),
    so call it when needed, not at import."""
    if sys.platform == "linux" and not any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or Slurm's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
