"""The worker core rule (docs/training.md, ``training/runtime.py: make_room_for_workers``), measured.

One CPU rank that owns every core of this machine trains the built-in CNN on the images family's PNGs through
``TrainBatches``, in three arrangements of the same cores, taking turns:

- **the rule**: decode workers on the rank's own cores, its intra-op threads shrunk by as many
  (threads + workers = cores; what ``train.num_workers: auto`` and the rule give a pinned rank);
- **no workers**: every core's thread on the step, decoding in the rank between steps;
- **oversubscribed**: the same workers, and a thread for every core as well.

The headline is the rule's images/s ÷ the better of the other two: at 1 it loses nothing to either. On a rank
of few cores the rule has little room (here: 2 cores, 1 worker and 1 thread); the figures say what it costs
there, not what it gives a 32-core rank.
"""

from __future__ import annotations

import math
import os

from bench.harness import Result, Row, Stats, Timer, log, turns

BATCH = 64
STEPS = {"quick": 3, "full": 16}  # the last steps of each epoch (``TrainBatches.epoch(start=...)`` skips the rest)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def arrangements(cores: int) -> dict[str, tuple[int, int]]:
    """name -> (decode workers, intra-op threads) for a rank of ``cores`` cores."""
    from training.runtime import CPU_CORES_PER_WORKER

    workers = max(1, cores // CPU_CORES_PER_WORKER)  # what num_workers: auto gives a CPU rank
    return {
        "the rule": (workers, max(1, cores - workers)),
        "no workers": (0, cores),
        "oversubscribed": (workers, cores),
    }


def run(ctx, dataset) -> list[Result]:
    import torch

    from bench import ddpflow_api
    from training.data.manifest import read_manifest
    from training.loading import TrainBatches
    from training.models import ModelSpec, build_model
    from training.spec.inputs import inputs_from_manifest

    manifest = read_manifest(dataset)
    split = ddpflow_api.load_split(dataset, "train")
    cores = _cores()
    plans = arrangements(cores)
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
        log(f"image workers repeat {repeat + 1}: {figures}")
    torch.set_num_threads(ctx.threads)
    ratio = Stats.of(
        rule / max(bare, over)
        for rule, bare, over in zip(rates["the rule"], rates["no workers"], rates["oversubscribed"])
    )
    rows = [
        Row(f"{name}: {workers} worker(s), {threads} thread(s)", Stats.of(rates[name]), "images/s",
            ratio if name == "the rule" else None)
        for name, (workers, threads) in plans.items()
    ]  # fmt: skip
    return [
        Result(
            name="image_worker_rule",
            title="Images: the worker core rule",
            ratio=ratio,
            target=0.95,
            ratio_label="the rule's images/s ÷ the better of no workers and oversubscribed (one rank, every core)",
            rows=rows,
            notes=[f"{len(split):,} train PNGs, batch {BATCH}, built-in CNN width 16, one rank on {cores} core(s)."],
        )
    ]
