"""A torchrun rank for tests/training/distributed/test_gradient_allreduce.py: the same model trained twice side by
side, once under plain DDP (no hook) and once under ddpflow's ``wrap_model`` with its ``GradientAllReduce``, on the
same rows; rank 1 raises its stop flag from optimizer step ``STOP_AT`` on. Writes OUT/rank-R.json: per optimizer step,
whether the two models' gradients are bit-identical, the flags ``take_flags`` returned, and the collectives the
backend ran during ddpflow's step (torch.profiler's ``gloo:all_reduce`` events; plain DDP's are counted alike).

    torchrun --nproc_per_node W gradient_allreduce_rank.py OUT
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from training.core.config import TrainConfig
from training.distributed.context import GradientAllReduce, distributed, wrap_model

STEPS, STOP_AT, ACCUM = 6, 3, 2  # optimizer steps; the first step rank 1's flag is up; micro-batches a step


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 3))


def collectives(prof) -> int:
    return sum(1 for event in prof.events() if "all_reduce" in event.name and event.name.startswith("gloo"))


def main() -> None:
    out = Path(sys.argv[1])
    with distributed(TrainConfig(backend="gloo")) as ctx:
        watch = SimpleNamespace(signum=None)  # a PreemptionWatch's flag: rank 1's is set from step STOP_AT on
        gradients = GradientAllReduce(watch=watch)
        ours, plain = wrap_model(model(), ctx, gradients), DistributedDataParallel(model())
        generator = torch.Generator().manual_seed(100 + ctx.rank)
        record = []
        for step in range(STEPS):
            if ctx.rank == 1 and step == STOP_AT:
                watch.signum = signal.SIGUSR1
            batches = [(torch.randn(5, 7, generator=generator) * 1e3, torch.randn(5, 3, generator=generator))]
            batches += [(torch.randn(4, 7, generator=generator), torch.randn(4, 3, generator=generator))]
            flags_between, counts = [], {}
            for name, ddp in (("ours", ours), ("plain", plain)):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for index, (x, y) in enumerate(batches):
                        last = index == ACCUM - 1
                        with ddp.no_sync() if not last else torch.enable_grad():
                            nn.functional.mse_loss(ddp(x), y).backward()
                        if name == "ours" and not last:
                            flags_between.append(gradients.take_flags())  # no all-reduce ran: None
                counts[name] = collectives(prof)
            flags = gradients.take_flags()
            identical = all(
                torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), plain.parameters(), strict=True)
            )
            record.append(
                {"step": step, "identical": identical, "flags": flags, "flags_between": flags_between, **counts}
            )
            for ddp in (ours, plain):
                ddp.zero_grad(set_to_none=True)
        (out / f"rank-{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
