"""The stall of a step checkpoint (``train.checkpoint_every_steps`` / ``checkpoint_every_s``).

A window of training steps with one step checkpoint at its start (ddpflow's: the state copied off the
model, then written by a background thread: ``Checkpointer.save_step``) ÷ the same window without one; the
extra time is the stall one checkpoint costs. The headline: the step time at a one-minute checkpoint
interval ÷ without checkpoints, (60 s + stall) / 60 s; the issue's target is at most 1.05. The write itself
must be done before the window ends (it is waited for, untimed, and its time reported).
"""

from __future__ import annotations

import time

import torch

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log

INTERVAL_S = 60.0


def run(ctx: Context) -> list[Result]:
    torch.set_num_threads(ctx.threads)
    hidden, steps = (256, 20) if ctx.quick else (1024, 60)  # full: a 13 MB state, about a minute in all
    model = torch.nn.Sequential(
        torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 4),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    checkpointer = ddpflow_api.step_checkpointer(ctx.workdir / "checkpoint-bench")
    plain, with_checkpoint, snapshots, writes = [], [], [], []
    for repeat in range(ctx.sizes.repeats * 2):
        with Timer() as window:
            for _ in range(steps):
                step()
        plain.append(window.seconds)
        with Timer() as window:
            with Timer() as snapshot:
                state = ddpflow_api.training_snapshot(model, optimizer)
            written_from = time.perf_counter()
            checkpointer.save_step(state, 0, repeat + 1)
            for _ in range(steps):
                step()
        with_checkpoint.append(window.seconds)
        checkpointer.wait_for_writes()
        writes.append(time.perf_counter() - written_from)
        snapshots.append(snapshot.seconds)
    stalls = [max(0.0, a - b) for a, b in zip(with_checkpoint, plain)]
    step_s = Stats.of(seconds / steps for seconds in plain)
    size_mb = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6  # weights + Adam's two moments
    log(f"checkpoint stall: median {Stats.of(stalls).median * 1e3:.1f} ms, step {step_s.median * 1e3:.1f} ms")
    return [
        Result(
            name="checkpoint",
            title="Step checkpoint stall",
            ratio=Stats.of((INTERVAL_S + stall) / INTERVAL_S for stall in stalls),
            target=1.05,
            direction="le",
            ratio_label="step time with a step checkpoint every 60 s ÷ without",
            rows=[
                Row("training step (no checkpoint)", Stats.of(s * 1e3 / steps for s in plain), "ms"),
                Row("stall per checkpoint (window with one − without)", Stats.of(s * 1e3 for s in stalls), "ms"),
                Row("  of which: the copy off the model (training waits)", Stats.of(s * 1e3 for s in snapshots), "ms"),
                Row("background write (training goes on)", Stats.of(s * 1e3 for s in writes), "ms"),
                Row("stall ÷ step time", Stats.of(s / step_s.median for s in stalls), "steps"),
            ],
            notes=[
                f"MLP 32-{hidden}-{hidden}-4 with AdamW: a {size_mb:.0f} MB state; batch 512; windows of {steps} "
                f"steps, {ctx.threads} thread(s); the write is atomic (temp file, fsync, rename) to local disk.",
                "The stall is the copy off the model plus what the writing thread takes from training (the GIL "
                "while it pickles, memory bandwidth); on a GPU the copy is a device-to-host transfer.",
            ],
        )
    ]
