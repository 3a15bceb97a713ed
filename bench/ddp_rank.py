"""One rank of a DDP throughput measurement; run under torchrun by bench/scaling.py.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.ddp_rank \
        --feed presliced --data X.npz --steps 300 --warmup 30 --out DIR [--affinity] [--bucket-mb 64] [--grad-accum 4]

Each rank trains ``warmup`` then ``steps`` micro-batches of ``batch`` rows and
writes ``DIR/rank-<r>.json`` with its samples and seconds. The timed part lies
between two barriers, so every rank's clock covers the same window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--feed", choices=["presliced", "ddpflow", "pandas"], required=True)
    parser.add_argument("--data", required=True, help="presliced/pandas: a .npz of x, y; ddpflow: a prepared dataset dir")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--affinity", action="store_true", help="pin each rank to its own core(s)")
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (large: one bucket)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step, no_sync between")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def pin_to_own_cores(local_rank: int, local_world: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // local_world)
    mine = cores[local_rank * share : (local_rank + 1) * share] or [cores[local_rank % len(cores)]]
    os.sched_setaffinity(0, mine)
    return mine


def batches(args: argparse.Namespace, rank: int, world: int, device):
    """Endless (x, y) batches for this rank."""
    import numpy as np
    import torch

    from bench import loaders
    from bench.workload import cycle

    if args.feed == "ddpflow":
        epoch = loaders.ddpflow(args.data, args.batch, rank=rank, world_size=world)
    else:
        data = np.load(args.data)
        x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
        if args.feed == "presliced":
            epoch = loaders.presliced(x[rank::world], y[rank::world], args.batch, args.steps + args.warmup, seed=rank)
        else:
            import pandas as pd
            from torch.utils.data.distributed import DistributedSampler

            frame = pd.DataFrame(x.numpy(), columns=[f"f{i}" for i in range(x.shape[1])])
            frame["label"] = y.numpy()
            dataset_len = len(frame)
            sampler = DistributedSampler(range(dataset_len), num_replicas=world, rank=rank, shuffle=True, drop_last=True)
            epoch = loaders.pandas_rows(frame, [f"f{i}" for i in range(x.shape[1])], "label", args.batch, sampler=sampler)
    for x, y in cycle(epoch):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main() -> None:
    args = parse_args()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.workload import build_model_and_optimizer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = args.device == "cuda"
    cores = pin_to_own_cores(local_rank, local_world) if args.affinity else sorted(os.sched_getaffinity(0))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    model, optimizer = build_model_and_optimizer(device=device)
    ddp_kwargs = {"bucket_cap_mb": args.bucket_mb} if args.bucket_mb else {}
    ddp = DDP(model, device_ids=[local_rank] if cuda else None, **ddp_kwargs)
    loss_fn = nn.CrossEntropyLoss()
    feed = batches(args, rank, world, device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if args.bf16 and cuda else contextlib.nullcontext

    def micro_step(index: int) -> int:
        x, y = next(feed)
        last = (index + 1) % args.grad_accum == 0
        with (contextlib.nullcontext() if last else ddp.no_sync()), autocast():
            loss = loss_fn(ddp(x), y)
        loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return len(y)

    # Whole optimizer steps in the warm-up, so the timed part starts with clean gradients.
    warmup = -(-args.warmup // args.grad_accum) * args.grad_accum
    for index in range(warmup):
        micro_step(index)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    samples = sum(micro_step(index) for index in range(args.steps))
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
        "cores": cores,
        "effective_batch": args.batch * args.grad_accum * world,
        "feed": args.feed,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
