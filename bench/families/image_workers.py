"""The worker core rule (docs/training.md, ``training/runtime.py: make_room_for_workers``), measured.

One CPU rank that owns every core of this machine trains the built-in CNN through ``TrainBatches``, in three
arrangements of the same cores, taking turns:

- **dedicated cores**: the decode workers on cores of their own, the rank's intra-op threads shrunk by as many
  (threads + workers = cores);
- **no workers**: every core's thread on the step, decoding in the rank between steps;
- **shared cores**: the same workers, and a thread for every core as well (the OS time-shares the cores).

on two workloads at the two ends of what decoding costs next to the step: the images family's 64x64 PNGs
(decoding is cheap) and 512x512 JPEGs resized to 64 (decoding one costs about as much as training on it).

ddpflow's default is the arrangement ``decode_workers("auto")`` and ``make_room_for_workers`` give this rank,
taken from that code, not restated here. The headline is the default's images/s ÷ the best of the three, the
worse of the two workloads: at 1 it loses nothing to either alternative on either. On a rank of few cores the
arrangements differ most (here: 2 cores, 1 worker); the figures say what the rule does there, not what it
gives a 32-core rank.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from bench.harness import Result, Row, Stats, Timer, log, turns

BATCH = 64
STEPS = {"quick": 3, "full": 16}  # the last steps of each epoch (``TrainBatches.epoch(start=...)`` skips the rest)
LARGE_PX, LARGE_ROWS, LARGE_DISTINCT = 512, {"quick": 512, "full": 2048}, 64


def _cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def arrangements(cores: int, workers: int) -> dict[str, tuple[int, int]]:
    """name -> (decode workers, intra-op threads) for a rank of ``cores`` cores and ``workers`` decode workers."""
    return {
        "dedicated cores": (workers, max(1, cores - workers)),
        "no workers": (0, cores),
        "shared cores": (workers, cores),
    }


def default_arrangement(cores: tuple[int, ...]) -> tuple[int, int]:
    """(workers, threads) that ddpflow gives a pinned CPU rank owning ``cores`` with an image input."""
    from training.config import TrainConfig
    from training.runtime import CpuSetup, decode_workers, make_room_for_workers

    train = TrainConfig()
    pinned = CpuSetup(len(cores), cores)
    workers = decode_workers(train.num_workers, pinned, on_gpu=False, decodes=True)
    return workers, make_room_for_workers(pinned, workers, train).threads


def _rates(ctx, dataset: Path, plans: dict[str, tuple[int, int]], label: str) -> dict[str, list[float]]:
    """images/s of each arrangement on ``dataset``, ``ctx.sizes.repeats`` turns each."""
    import torch

    from bench import ddpflow_api
    from training.data.manifest import read_manifest
    from training.loading import TrainBatches
    from training.models import ModelSpec, build_model
    from training.spec.inputs import inputs_from_manifest

    manifest = read_manifest(dataset)
    split = ddpflow_api.load_split(dataset, "train")
    loaders = {
        name: TrainBatches(split, 0, 1, BATCH, 0, torch.device("cpu"), False, num_workers=workers)
        for name, (workers, _) in plans.items()
    }
    torch.manual_seed(0)
    model = build_model(ModelSpec.for_inputs("auto", inputs_from_manifest(manifest), manifest.n_outputs, {"width": 16}))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    steps = math.ceil(len(split) / BATCH)
    start = max(0, steps - STEPS["quick" if ctx.quick else "full"])

    def train(name: str, epoch: int, first: int = start) -> float:
        torch.set_num_threads(plans[name][1])
        seen = 0
        with Timer() as timer:
            for batch in loaders[name].epoch(epoch, first):
                loss = torch.nn.functional.cross_entropy(model(batch.inputs), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += batch.samples
        return seen / timer.seconds

    for name in plans:  # start each loader's persistent workers, outside the timing: one step of epoch 0
        train(name, 0, steps - 1)
    rates: dict[str, list[float]] = {name: [] for name in plans}
    for repeat in range(ctx.sizes.repeats):
        for name in turns(list(plans), repeat):
            rates[name].append(train(name, repeat + 1))
        figures = ", ".join(f"{name} {values[-1]:,.0f} images/s" for name, values in rates.items())
        log(f"image workers, {label}, repeat {repeat + 1}: {figures}")
    return rates


def run(ctx, pngs: Path) -> list[Result]:
    import torch

    from bench import images

    cores = _cores()
    default = default_arrangement(cores)
    plans = arrangements(len(cores), max(1, default[0]))  # a rank of under 4 cores gets none by default
    default_name = next(name for name, plan in plans.items() if plan == default)
    mode = "quick" if ctx.quick else "full"
    jpegs = images.prepared(ctx, LARGE_ROWS[mode], images.SIZE, LARGE_DISTINCT, LARGE_PX, "JPEG")
    workloads = {
        f"{images.SIZE}x{images.SIZE} PNGs": pngs,
        f"{LARGE_PX}x{LARGE_PX} JPEGs resized to {images.SIZE}": jpegs,
    }
    measured = {label: _rates(ctx, dataset, plans, label) for label, dataset in workloads.items()}
    torch.set_num_threads(ctx.threads)

    def default_over_best(rates: dict[str, list[float]]) -> list[float]:
        return [values[0] / max(values) for values in zip(*(rates[name] for name in [default_name, *plans]))]

    per_workload = {label: Stats.of(default_over_best(rates)) for label, rates in measured.items()}
    ratio = min(per_workload.values(), key=lambda stats: stats.median)

    def row_label(label: str, name: str, workers: int, threads: int) -> str:
        default_mark = " (the default)" if name == default_name else ""
        return f"{label}: {name}{default_mark}, {workers} worker(s) + {threads} thread(s)"

    rows = [
        Row(row_label(label, name, *plan), Stats.of(measured[label][name]), "images/s",
            per_workload[label] if name == default_name else None)
        for label in measured
        for name, plan in plans.items()
    ]  # fmt: skip
    return [
        Result(
            name="image_worker_rule",
            title="Images: the worker core rule",
            ratio=ratio,
            target=0.95,
            ratio_label=(
                "ddpflow's default arrangement's images/s ÷ the best of dedicated cores, no workers and shared "
                "cores (one rank, every core; the worse workload)"
            ),
            rows=rows,
            notes=[
                f"Batch {BATCH}, built-in CNN width 16, one rank on {len(cores)} core(s), the last "
                f"{STEPS[mode]} steps of an epoch per turn; the default ({default_name}) is what "
                "`decode_workers` and `make_room_for_workers` give it."
            ],
        )
    ]
