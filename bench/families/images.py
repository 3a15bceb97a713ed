"""Images: ddpflow's image loader and step ÷ plain PyTorch over the same encoded bytes.

- **Training images/s**: ``TrainBatches`` (the node-cache bytes, the codec's collate in ``k`` persistent
  workers) feeding the built-in CNN and AdamW, ÷ the reference: a ``Dataset`` over the same PNG bytes,
  decoded with Pillow, the same transforms (the codec's random resized crop and flip, resize, normalise),
  ``DataLoader(num_workers=k, persistent_workers=True, pin_memory=True)``, the same model and optimizer.
- **Decode throughput**: the loader alone (no step) ÷ Pillow decoding the same bytes in ``k`` processes.
- **The worker core rule** (docs/training.md, ``training/distributed/process.py: make_room_for_workers``), measured: see
  ``worker_rule`` below.

The images are drawn with Pillow (bench/workloads/images.py: shapes on noise, PNG); nothing is downloaded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log, turns
from bench.workloads import images
from bench.workloads.tabular import set_threads

BATCH = 64


class ReferenceDataset:
    """The plain way: one row per item, its PNG bytes decoded with Pillow and transformed by the same codec
    functions (per-row generator, as ddpflow's), stacked by the default collate."""

    def __init__(self, values, offsets, labels, codec, epoch: int = 0):
        self.values, self.offsets, self.labels, self.codec, self.epoch = values, offsets, labels, codec, epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, row: int):
        image = ddpflow_api.collate_one(self.codec, self.values, self.offsets, row, self.epoch)
        return image, self.labels[row]


def run(ctx: Context) -> list[Result]:
    import torch
    from torch.utils.data import DataLoader

    set_threads(ctx.threads)
    dataset = images.prepared(ctx)
    split = ddpflow_api.load_split(dataset, "train")
    codec = split.collators["photo"].__self__
    ragged = split.inputs["photo"]
    workers = 1 if ctx.quick else 2

    def model_and_optimizer():
        torch.manual_seed(0)
        model = ddpflow_api.model_for(dataset, "auto", {"width": 16}, images.CLASSES)
        return model, torch.optim.AdamW(model.parameters(), 1e-3)

    ours = ddpflow_api.train_batches(split, batch=BATCH, num_workers=workers)
    reference_set = ReferenceDataset(ragged.values, ragged.offsets, split.labels, codec)
    reference = DataLoader(
        reference_set,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        pin_memory=torch.cuda.is_available(),
    )

    def train_ddpflow(epoch: int, step: bool) -> int:
        seen = 0
        for batch in ours.epoch(epoch):
            if step:
                loss = torch.nn.functional.cross_entropy(model(batch.inputs), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seen += batch.samples
        return seen

    def train_reference(epoch: int, step: bool) -> int:
        seen = 0
        for pictures, labels in reference:
            if step:
                loss = torch.nn.functional.cross_entropy(model({"photo": pictures}), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seen += len(labels)
        return seen

    rates: dict[str, list[float]] = {
        name: [] for name in ("ddpflow", "reference", "ddpflow_decode", "reference_decode")
    }
    model, optimizer = model_and_optimizer()
    train_ddpflow(0, False), train_reference(0, False)  # start the persistent workers
    for repeat in range(ctx.sizes.repeats):
        for name, feed in turns([("ddpflow", train_ddpflow), ("reference", train_reference)], repeat):
            for step in (True, False):
                with Timer() as timer:
                    seen = feed(repeat + 1, step)
                rates[name if step else f"{name}_decode"].append(seen / timer.seconds)
        log(f"images repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} images/s" for k, v in rates.items()))
    train_ratio = Stats.of(a / b for a, b in zip(rates["ddpflow"], rates["reference"]))
    decode_ratio = Stats.of(a / b for a, b in zip(rates["ddpflow_decode"], rates["reference_decode"]))
    note = (
        f"{len(split):,} train PNGs of {images.SIZE}x{images.SIZE}, batch {BATCH}, "
        f"{workers} persistent worker(s) each side, "
        f"built-in CNN width 16, {ctx.threads} torch thread(s)."
    )
    return [
        Result(
            name="images_train", title="Images: training", ratio=train_ratio, target=1.0,
            ratio_label="ddpflow images/s (loader + step) ÷ a plain Dataset + DataLoader over the same bytes",
            rows=[Row("ddpflow: TrainBatches + step", Stats.of(rates["ddpflow"]), "images/s", train_ratio),
                  Row("reference: Dataset + DataLoader + step", Stats.of(rates["reference"]), "images/s")],
            notes=[note],
        ),
        Result(
            name="images_decode", title="Images: decode", ratio=decode_ratio, target=0.9,
            ratio_label="ddpflow's loader alone ÷ the reference DataLoader alone (Pillow, as many processes)",
            rows=[Row("ddpflow: TrainBatches", Stats.of(rates["ddpflow_decode"]), "images/s", decode_ratio),
                  Row("reference: Dataset + DataLoader", Stats.of(rates["reference_decode"]), "images/s")],
            notes=[note],
        ),
        worker_rule(ctx, dataset),  # on the same PNGs
    ]  # fmt: skip


# ----------------------------------------------------------------------------- the worker core rule

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


def _rates(ctx, dataset: Path, plans: dict[str, tuple[int, int]], label: str) -> dict[str, list[float]]:
    """images/s of each arrangement on ``dataset``, ``ctx.sizes.repeats`` turns each."""
    import torch

    split = ddpflow_api.load_split(dataset, "train")
    loaders = {
        name: ddpflow_api.train_batches(split, batch=BATCH, num_workers=workers) for name, (workers, _) in plans.items()
    }
    torch.manual_seed(0)
    model = ddpflow_api.model_for(dataset, "auto", {"width": 16})
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


def worker_rule(ctx: Context, pngs: Path) -> Result:
    """The worker core rule (docs/training.md, ``training/distributed/process.py: make_room_for_workers``), measured.

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
    import torch

    cores = _cores()
    default = ddpflow_api.default_decode_arrangement(cores)
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
    # The most any fixed arrangement can read: each one's worse workload, the best of those, per repeat.
    ceiling = Stats.of(best_worst_case(measured, list(plans)))

    def row_label(label: str, name: str, workers: int, threads: int) -> str:
        default_mark = " (the default)" if name == default_name else ""
        return f"{label}: {name}{default_mark}, {workers} worker(s) + {threads} thread(s)"

    rows = [
        Row(row_label(label, name, *plan), Stats.of(measured[label][name]), "images/s",
            per_workload[label] if name == default_name else None)
        for label in measured
        for name, plan in plans.items()
    ]  # fmt: skip
    rows.append(Row("the best any fixed arrangement does in its worse workload", None, "", ceiling))
    return Result(
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
            "`decode_workers` and `make_room_for_workers` give it.",
            "The ceiling: the best any fixed arrangement reads in its worse workload (each repeat); the restated "
            "target is 0.95 of it.",
        ],
    ).bounded_by(ceiling, share=0.95)


def best_worst_case(measured: dict[str, dict[str, list[float]]], names: list[str]) -> list[float]:
    """Per repeat: each arrangement's images/s ÷ the best in each workload, its worse workload, the best of those."""
    repeats = min(len(rates[name]) for rates in measured.values() for name in names)
    return [
        max(
            min(rates[name][r] / max(rates[other][r] for other in names) for rates in measured.values())
            for name in names
        )
        for r in range(repeats)
    ]
