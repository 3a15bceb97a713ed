"""One rank of a DDP throughput measurement; run under torchrun by the ddp and gpu families (bench/families/).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.ranks.ddp \\
        --feed ddpflow --data DATASET_DIR --steps 300 --warmup 30 --out DIR \\
        [--ranks ddpflow [--set train.cpu_poll_allreduce=true ...]] [--affinity] [--bucket-mb 25] [--grad-accum 4]

How the rank is set up (``--ranks``):

- ``ddpflow``: by ddpflow's own code, as every training rank is (``Trainer``'s
  first steps): the process group (``training.distributed.context.distributed``), the
  process configuration (``training.distributed.process.configure_process``: threads,
  pinning, the all-reduce's wait) and the DDP wrapper (``wrap_model``), for
  ddpflow's defaults plus the ``--set`` overrides. What "ddpflow's defaults"
  means in docs/benchmarks.md.
- ``plain`` (the default): plain PyTorch, the reference rows:
  ``init_process_group``, ``DistributedDataParallel`` with ``--bucket-mb``,
  and ``--affinity`` pinning the process to its own cores before it joins.

What a step trains on (``--feed``): ``ddpflow``: ddpflow's node cache mapping,
loader (``TrainBatches``) and step (``training.loop.step.TrainStep``) on a slice of
the train split sized so that one epoch is exactly ``steps`` steps per rank.
``presliced``/``pandas``: the same model and step fed from pre-cut tensors,
or the plain way (per-row Dataset over a pandas DataFrame).

Each rank writes ``DIR/rank-<r>.json`` with its samples and seconds. The timed
part lies between two barriers, so every rank's clock covers the same window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

from bench import ddpflow_api
from bench.workloads import loaders
from bench.workloads.tabular import build_model_and_optimizer, cycle


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--feed", choices=["presliced", "ddpflow", "pandas"], required=True)
    parser.add_argument(
        "--ranks", choices=["plain", "ddpflow"], default="plain", help="plain PyTorch, or ddpflow's rank set-up"
    )
    parser.add_argument("--set", action="append", default=[], help="--ranks ddpflow: a train.* override (repeatable)")
    parser.add_argument(
        "--data", required=True, help="presliced/pandas: a .npz of x, y; ddpflow: a prepared dataset dir"
    )
    parser.add_argument("--steps", type=int, required=True, help="timed micro-batch steps per rank")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--affinity", action="store_true", help="plain: pin each rank to its own core(s)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="plain: DDP bucket_cap_mb; unset: DDP's own")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step, no_sync between")
    parser.add_argument(
        "--independent", action="store_true", help="no DDP: each rank trains alone (the compute-only ceiling)"
    )
    parser.add_argument(
        "--allreduce-probe", type=int, default=0, help="after training, time N all-reduces of the gradients' size"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def pin_to_own_cores(local_rank: int, local_world: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // local_world)
    os.sched_setaffinity(0, cores[local_rank * share : (local_rank + 1) * share] or [cores[local_rank % len(cores)]])


class DdpflowFeed:
    """Warm-up and timed epochs through ddpflow's loader and training loop."""

    def __init__(self, args, rank: int, world: int, device, ddpflow=None):
        self.api, self.args, self.device, self.ddpflow = ddpflow_api, args, device, ddpflow
        split = ddpflow_api.node_splits(args.data, ["train"])["train"].tensors  # as training.train gets it
        per_step = args.batch * world
        self.warm = ddpflow_api.train_batches(
            ddpflow_api.first_rows(split, per_step * args.warmup),
            batch=args.batch,
            rank=rank,
            world_size=world,
            device=device,
        )
        self.timed = ddpflow_api.train_batches(
            ddpflow_api.first_rows(split, per_step * args.steps),
            batch=args.batch,
            rank=rank,
            world_size=world,
            device=device,
        )

    def run(self, ddp, optimizer, timed: bool) -> int:
        batches = self.timed if timed else self.warm
        # ddpflow's ranks read the stop flags as a run does (they ride on the gradient all-reduce)
        stops = None if self.ddpflow is None else self.ddpflow.stop_flags(self.args.grad_accum, len(batches))
        return self.api.train_epoch(
            ddp,
            optimizer,
            batches,
            int(timed),
            device=self.device,
            grad_accum=self.args.grad_accum,
            bf16=self.args.bf16,
            stops=stops,
        )


class PlainFeed:
    """The same step fed from pre-cut tensors or a pandas per-row Dataset."""

    def __init__(self, args, rank: int, world: int, device):
        import numpy as np
        import torch

        self.args, self.device = args, device
        data = np.load(args.data)
        x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
        if args.feed == "presliced":
            epoch = loaders.presliced(x[rank::world], y[rank::world], args.batch, args.steps + args.warmup, seed=rank)
        else:
            import pandas as pd
            from torch.utils.data.distributed import DistributedSampler

            names = [f"f{i}" for i in range(x.shape[1])]
            frame = pd.DataFrame(x.numpy(), columns=names)
            frame["label"] = y.numpy()
            sampler = DistributedSampler(range(len(frame)), num_replicas=world, rank=rank, shuffle=True, drop_last=True)
            epoch = loaders.pandas_rows(frame, names, "label", args.batch, sampler=sampler)
        self.batches = cycle(epoch)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def run(self, ddp, optimizer, timed: bool) -> int:
        args = self.args
        steps = args.steps if timed else args.warmup
        autocast = contextlib.nullcontext
        if args.bf16 and self.device.type == "cuda":
            import torch

            autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
        samples = 0
        for index in range(steps):
            x, y = next(self.batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = (index + 1) % args.grad_accum == 0 or index == steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync(), autocast():
                loss = self.loss_fn(ddp(x), y)
            loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            samples += len(y)
        return samples


def main() -> None:
    args = parse_args()
    if args.ranks == "ddpflow":
        with ddpflow_api.ddpflow_rank(args.set) as rank:
            ctx = rank.ctx
            model, optimizer = build_model_and_optimizer(device=ctx.device)
            measure(args, ctx.rank, ctx.world_size, ctx.device, rank.wrap(model), optimizer, rank)
        return
    plain_rank(args)


def plain_rank(args) -> None:
    """The reference: plain PyTorch's process group, pinning and DDP wrapper."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if args.affinity:
            pin_to_own_cores(local_rank, local_world)
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    model, optimizer = build_model_and_optimizer(device=device)
    ddp_kwargs = {"bucket_cap_mb": args.bucket_mb} if args.bucket_mb else {}
    ddp = (
        model
        if args.independent
        else DistributedDataParallel(model, device_ids=[local_rank] if cuda else None, **ddp_kwargs)
    )
    measure(args, rank, world, device, ddp, optimizer)
    dist.destroy_process_group()


def measure(args, rank: int, world: int, device, ddp, optimizer, ddpflow=None) -> None:
    """Warm up, then time ``args.steps`` steps between two barriers; write this rank's figures (``ddpflow``: the
    rank's ``ddpflow_api.DdpflowRank``, None for plain PyTorch's)."""
    setup = None if ddpflow is None else ddpflow.setup
    import torch
    import torch.distributed as dist

    model = getattr(ddp, "module", ddp)
    feed = (
        DdpflowFeed(args, rank, world, device, ddpflow)
        if args.feed == "ddpflow"
        else PlainFeed(args, rank, world, device)
    )
    cuda = device.type == "cuda"

    feed.run(ddp, optimizer, timed=False)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    samples = feed.run(ddp, optimizer, timed=True)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "rank": rank,
        "world_size": world,
        "samples": samples,
        "seconds": seconds,
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "effective_batch": args.batch * args.grad_accum * (1 if args.independent else world),
        "feed": args.feed,
        "ranks": args.ranks,
        "setup": setup.describe() if setup is not None else "plain PyTorch",
        "polls": bool(setup is not None and setup.poll_allreduce),
        "device": str(device),
        **(allreduce_latency_ms(model, args.allreduce_probe) if args.allreduce_probe else {}),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(figures))


def allreduce_latency_ms(model, times: int) -> dict[str, float]:
    """Median and 90th percentile of one all-reduce of a buffer the size of the model's gradients."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(sum(p.numel() for p in model.parameters()))
    dist.barrier()
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return {
        "allreduce_p50_ms": 1e3 * seconds[len(seconds) // 2],
        "allreduce_p90_ms": 1e3 * seconds[int(len(seconds) * 0.9)],
    }


if __name__ == "__main__":
    main()
