"""GPU figures (``python -m bench --gpu``, needs CUDA): bf16 samples/s and the ratio to the compute limit,
and nccl scaling over the machine's GPUs.

In one process on GPU 0: the compute limit is the same model and step (bf16
autocast, TF32) on batches already on the GPU; ddpflow is its loader and
training loop with ``bf16=True``, twice: the split on the host (the node
cache's mapping, pinned batches, non-blocking copies: ``train.data_on_device=false``)
and the split copied to the GPU once, batches gathered there
(``train.data_on_device=true``). The headline is the lower of the two. With
more than one GPU: torchrun with nccl, one rank per GPU, against one rank, like
the CPU scaling benchmark.
"""

from __future__ import annotations

import time

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, log
from bench.workloads import loaders
from bench.workloads.tabular import BATCH, build_model_and_optimizer, cycle, prepared_dir

TITLE = "GPU"


def run(ctx: Context) -> list[Result]:
    import torch

    if not torch.cuda.is_available():
        return [Result(name="gpu", title=TITLE, target=0.95, status="skipped", reason="no CUDA device on this machine")]
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    dataset = prepared_dir(ctx, ctx.sizes.rows)
    split = ddpflow_api.node_splits(dataset, ["train"])["train"].tensors
    batches = ddpflow_api.train_batches(split, batch=BATCH, device=device)
    batches_on_device = ddpflow_api.train_batches(ddpflow_api.on_device(split, device), batch=BATCH, device=device)
    steps = len(batches)
    presliced = loaders.presliced(split.features, split.labels, BATCH, steps + ctx.sizes.warmup)
    on_device = [(x.to(device), y.to(device)) for x, y in presliced()]
    compute, ours, ours_on_device = [], [], []

    def ddpflow_epoch(feed, repeat: int) -> float:
        model, optimizer = build_model_and_optimizer(device=device)
        bf16_steps(model, optimizer, cycle(lambda: iter(on_device)), 0, ctx.sizes.warmup)
        torch.cuda.synchronize()
        start = time.perf_counter()
        samples = ddpflow_api.train_epoch(model, optimizer, feed, repeat, device=device, bf16=True)
        torch.cuda.synchronize()
        return samples / (time.perf_counter() - start)

    for repeat in range(ctx.sizes.repeats):
        model, optimizer = build_model_and_optimizer(device=device)
        compute.append(bf16_steps(model, optimizer, cycle(lambda: iter(on_device)), steps, ctx.sizes.warmup))
        ours.append(ddpflow_epoch(batches, repeat))
        ours_on_device.append(ddpflow_epoch(batches_on_device, repeat))
        log(
            f"gpu repeat {repeat + 1}: compute limit {compute[-1]:,.0f}/s, ddpflow {ours[-1]:,.0f}/s, "
            f"with the data on the GPU {ours_on_device[-1]:,.0f}/s"
        )
    ratio = Stats.of(a / b for a, b in zip(ours, compute))
    ratio_on_device = Stats.of(a / b for a, b in zip(ours_on_device, compute))
    worse = Stats.of(min(a, b) / c for a, b, c in zip(ours, ours_on_device, compute))
    rows = [
        Row(
            f"compute limit on {torch.cuda.get_device_name(0)} (bf16, batches on the GPU)",
            Stats.of(compute),
            "samples/s",
        ),
        Row(
            "ddpflow loader + training loop (bf16, data_on_device=false: pinned batches)",
            Stats.of(ours),
            "samples/s",
            ratio,
        ),
        Row(
            "the same, data_on_device=true: the split on the GPU, batches gathered there",
            Stats.of(ours_on_device),
            "samples/s",
            ratio_on_device,
        ),
    ]
    notes = [
        f"{len(split):,} train rows, batch {BATCH}, {steps} steps per epoch. A 76k-parameter MLP at batch 512 "
        "keeps a big GPU mostly idle: these figures are bound by kernel launches."
    ]
    gpus = torch.cuda.device_count()
    if gpus > 1:
        rows += nccl_scaling(ctx, dataset, gpus)
    return [
        Result(
            name="gpu",
            title=TITLE,
            ratio=worse,
            target=0.9,
            ratio_label="ddpflow samples/s ÷ compute limit, bf16 on one GPU (the lower of data_on_device on and off)",
            rows=rows,
            notes=notes,
        )
    ]


def bf16_steps(model, optimizer, batches, steps: int, warmup: int) -> float:
    import torch
    from torch import nn

    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = model(x)
        loss_fn(output.float(), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return steps * BATCH / max(time.perf_counter() - start, 1e-9)


def nccl_scaling(ctx: Context, dataset, gpus: int) -> list[Row]:
    rates: dict[int, list[float]] = {1: [], gpus: []}
    for repeat in range(ctx.sizes.repeats):
        for nproc in rates:
            out = ctx.workdir / "gpu-ddp" / f"{nproc}-{repeat}"
            args = ["--feed", "ddpflow", "--data", str(dataset), "--device", "cuda", "--bf16", "--batch", str(BATCH)]
            args += [
                "--steps",
                str(ctx.sizes.ddp_steps),
                "--warmup",
                str(ctx.sizes.ddp_warmup),
                "--out",
                str(out),
                "--bucket-mb",
                "25",
            ]
            processes.run(processes.torchrun_argv(nproc, "bench.ranks.ddp", args), timeout=600)
            ranks = processes.read_rank_files(out)
            rates[nproc].append(sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks))
    efficiency = Stats.of(many / (gpus * one) for many, one in zip(rates[gpus], rates[1]))
    return [
        Row("nccl, 1 GPU", Stats.of(rates[1]), "samples/s"),
        Row(f"nccl, {gpus} GPUs (ratio: ÷ {gpus} × one GPU)", Stats.of(rates[gpus]), "samples/s", efficiency),
    ]
