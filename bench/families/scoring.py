"""Batch scoring: `ddpflow score` on 2 CPU ranks against the served pyfunc in one process, on the same rows.

The source is the workload's mixed table (32 numeric columns and 4 string categoricals, one Parquet file); the
model is the built-in mlp for those inputs, with the encoders of a prepared slice of the same table (untrained
weights: they do not change the speed). Three figures per repeat:
- end to end: ``ddpflow score`` as a user runs it (start-up, plan, ranks, coverage check, manifest, the MLflow run
  and the drift read-back) against the pyfunc's ``predict(chunk, params={"output": "probabilities"})`` over the
  same rows in 100k-row chunks read with pyarrow (loading the model included), timed with torch on every core and
  on one thread: the faster is the reference (on a loaded machine, torch's threads wait for each other at every
  call and one thread wins; taking the faster only makes the reference harder);
- steady: the ranks' rows/s (the manifest's ``seconds``: from the plan to the coverage check) against twice the
  model's own forward rate, in the same repeat, on a pre-encoded 65,536-row batch with one torch thread (what each
  rank has): the faster of one call on the whole batch and calls of ``CPU_FORWARD_ROWS`` rows (what ``Predictor``
  makes on a CPU; about 3x faster here, so the reference is the harder one); beside it, the forward timed in 2
  processes at once against one alone (each in its own process, as a rank is): what the machine gives two ranks'
  forwards;
- scaling: the 2 ranks' steady rows/s against one rank's, ``ddpflow score`` with ``score.nproc_per_node=1`` on the
  same rows in the same repeat.

Where the ranks' CPU goes: the manifest's ``cpu_seconds`` is the CPU time the ranks spent (every thread, summed
over ranks), so with C cores the 2 ranks cannot score faster than C x rows / cpu_seconds, whatever else runs. For
the scaling ratio that bound is the machine's ceiling (both sides do the same work per row; one rank alone already
keeps more than one core busy): where it is below 1.6, the target is restated as the target's share of the ideal
(1.6 of 2 ranks: 0.8) of the ceiling, and never below 1. For the end-to-end ratio the floor is a bare torchrun's
ranks joining their group (``ddpflow score`` starts torchrun before its own work, which overlaps the ranks' start),
then every row at that bound: where it is below 1, the target is restated as 0.8 of it. For the steady ratio the
bound is set by the ranks' own work beyond the forward, so
it is shown, and the target stands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log
from bench.workloads.pipeline import NOOP_RANK
from bench.workloads.tabular import HIDDEN, mixed_prepared_dir, mixed_source_file, set_threads

RANKS = 2
CORES = len(os.sched_getaffinity(0))  # the cores this process (and the ranks it starts) may run on
CHUNK = 100_000
FORWARD_BATCH = 65_536


def run(ctx: Context) -> list[Result]:

    rows = ctx.sizes.rows
    source = mixed_source_file(ctx, rows)
    dataset = mixed_prepared_dir(ctx, min(rows, 100_000))  # the encoders' fit; the categories are the same
    model = ddpflow_api.write_input_model_file(dataset, ctx.workdir / "score-model.pt", HIDDEN)
    tracking = f"sqlite:///{ctx.workdir / 'score-mlflow.db'}"
    ours, pyfunc, steady, one_rank = [], [], [], []
    every_core, one_thread = [], []  # the pyfunc's rows/s with torch on every core, on one thread
    busy, one_busy, bound = [], [], []  # cores the ranks kept busy (2 ranks, 1 rank); C x rows / cpu_seconds
    ranks_ready = []  # a bare torchrun's no-op ranks ready
    whole, chunked, forward = [], [], []  # the model's forward rates (one call, CPU_FORWARD_ROWS calls; the faster)
    alone, together = [], []  # the forward in one process alone; in RANKS processes at once (their summed rows/s)
    noop = ctx.workdir / "noop_rank.py"
    noop.write_text(NOOP_RANK)
    for repeat in range(ctx.sizes.repeats):
        ranks_ready.append(bare_ranks_ready(noop))
        wall_s, steady_s, cpu_s = score(model, source, ctx.workdir / f"scores-{repeat}", tracking, RANKS)
        ours.append(rows / wall_s)
        steady.append(rows / steady_s)
        busy.append(cpu_s / steady_s)
        bound.append(CORES * rows / cpu_s)
        _, one_s, one_cpu_s = score(model, source, ctx.workdir / f"scores-1-{repeat}", tracking, 1)
        one_rank.append(rows / one_s)
        one_busy.append(one_cpu_s / one_s)
        every_core.append(pyfunc_rate(model, source, os.cpu_count() or 1))
        one_thread.append(pyfunc_rate(model, source, 1))
        pyfunc.append(max(every_core[-1], one_thread[-1]))
        rates = forward_rate(model, source)
        whole.append(rates[0])
        chunked.append(rates[1])
        forward.append(max(rates))
        alone.append(forwards_at_once(model, source, 1))
        together.append(forwards_at_once(model, source, RANKS))
        log(f"scoring repeat {repeat + 1}: ddpflow score {ours[-1]:,.0f} rows/s end to end ({steady[-1]:,.0f} "
            f"steady; one rank {one_rank[-1]:,.0f} steady), pyfunc {every_core[-1]:,.0f} rows/s on every core, "
            f"{one_thread[-1]:,.0f} on one thread, the forward {forward[-1]:,.0f}")  # fmt: skip
    cpu_rows = ddpflow_api.cpu_forward_rows()
    end_to_end = Stats.of(a / b for a, b in zip(ours, pyfunc, strict=True))
    steady_ratio = Stats.of(rate / (RANKS * best) for rate, best in zip(steady, forward, strict=True))
    scaling = Stats.of(a / b for a, b in zip(steady, one_rank, strict=True))
    steady_ceiling = Stats.of(rate / (RANKS * best) for rate, best in zip(bound, forward, strict=True))
    shared = Stats.of(two / (RANKS * one) for two, one in zip(together, alone, strict=True))
    # End to end at best: a bare torchrun's ranks ready, then every row at the ceiling.
    best_s = [ready + rows / ceiling for ready, ceiling in zip(ranks_ready, bound, strict=True)]
    end_to_end_ceiling = Stats.of(rows / s / ref for s, ref in zip(best_s, pyfunc, strict=True))
    scaling_ceiling = Stats.of(a / b for a, b in zip(bound, one_rank, strict=True))
    busy_row = Row(f"the 2 ranks' CPU: cores kept busy (cpu_seconds ÷ seconds) of {CORES}", Stats.of(busy), "cores")
    one_busy_row = Row("1 rank's, the same", Stats.of(one_busy), "cores")
    bound_row = Row(f"the 2 ranks' ceiling: {CORES} cores ÷ their CPU seconds per row", Stats.of(bound), "rows/s")
    return [
        Result(
            name="scoring",
            title="Batch scoring",
            ratio=end_to_end,
            target=1.0,
            ratio_label=f"ddpflow score (2 CPU ranks, end to end) rows/s ÷ pyfunc.predict in {CHUNK:,}-row chunks",
            rows=[
                Row(
                    "ddpflow score, end to end (start-up, MLflow run and drift included)",
                    Stats.of(ours),
                    "rows/s",
                    end_to_end,
                ),
                Row(
                    "pyfunc predict, one process, 100k-row chunks (model load included): the faster of the two below",
                    Stats.of(pyfunc),
                    "rows/s",
                ),
                Row("... torch on every core", Stats.of(every_core), "rows/s"),
                Row("... torch on one thread", Stats.of(one_thread), "rows/s"),
                Row("the floor before a row: a bare torchrun's 2 no-op ranks ready", Stats.of(ranks_ready), "s"),
                Row(
                    "the floor in all: that, then every row at the 2 ranks' ceiling (Batch scoring, steady)",
                    Stats.of(best_s),
                    "s",
                ),
                Row("this machine's ceiling for the ratio", None, "", end_to_end_ceiling),
            ],  # fmt: skip
            notes=[
                f"{rows:,} rows of the mixed table (32 numeric, 4 categorical string columns), one Parquet file",
                "the reference is the pyfunc's faster thread setting in each repeat: on a loaded machine torch's "
                "threads wait for each other in every call, and one thread is faster",
                "the ceiling: the rows over the floor's seconds (a bare torchrun's ranks ready, every row at the "
                "ranks' ceiling; the command's own work overlaps torchrun's start) ÷ the pyfunc's rows/s; the "
                "restated target is 0.8 of it",
            ],
        ).bounded_by(end_to_end_ceiling, share=0.8),
        Result(
            name="scoring_steady",
            title="Batch scoring, steady",
            ratio=steady_ratio,
            target=0.8,
            ratio_label="the ranks' rows/s ÷ 2 x the model's best forward rate on pre-encoded batches (1 thread)",
            rows=[
                Row("2 ranks, from the plan to the coverage check", Stats.of(steady), "rows/s", steady_ratio),
                Row(
                    f"the model's forward on a pre-encoded {FORWARD_BATCH:,}-row batch in {cpu_rows:,}-row "
                    "calls, 1 thread",
                    Stats.of(chunked),
                    "rows/s",
                ),
                Row("the same batch in one call, 1 thread", Stats.of(whole), "rows/s"),
                busy_row,
                bound_row,
                Row(
                    "the ratio with every core on the ranks' work, at their CPU seconds per row",
                    None,
                    "",
                    steady_ceiling,
                ),
                Row("the forward in one process alone (the faster way), 1 thread", Stats.of(alone), "rows/s"),
                Row(
                    f"{RANKS} such processes at once: their summed rows/s, ÷ {RANKS} x one alone",
                    Stats.of(together),
                    "rows/s",
                    shared,
                ),
            ],
            notes=[
                "the reference is the faster of the two forward rates, measured in each repeat after its scorings",
                "the ratio with every core on the ranks' work bounds it by the ranks' own CPU per row (what they do "
                "beyond the forward), not by the machine: the target stands",
                f"the last row is what the machine gives {RANKS} forwards at once (shared caches and memory "
                f"bandwidth), each in its own process as a rank is: a ceiling for any {RANKS} processes' work; the "
                "target stands while it reads above 0.8",
            ],
        ),
        Result(
            name="scoring_scaling",
            title="Batch scoring, 2 ranks against 1",
            ratio=scaling,
            target=1.6,
            ratio_label="the 2 ranks' steady rows/s ÷ one rank's (`score.nproc_per_node=1`), the same rows",
            rows=[
                Row("2 ranks, from the plan to the coverage check", Stats.of(steady), "rows/s", scaling),
                Row("1 rank, the same", Stats.of(one_rank), "rows/s"),
                busy_row,
                one_busy_row,
                bound_row,
                Row("this machine's ceiling for the ratio", None, "", scaling_ceiling),
            ],
            notes=[
                f"each repeat scores the same {rows:,} rows with 2 ranks, then with 1; both end to end runs",
                "the ceiling: the rows/s the 2 ranks would reach with every core on their work ÷ one rank's (one "
                "rank alone already keeps more than one core busy); the restated target is the target's share of "
                f"{RANKS} ranks (0.8) of the ceiling, and never below 1 (2 ranks at least one rank's rate)",
            ],
        ).bounded_by(scaling_ceiling, share=1.6 / RANKS, at_least=1.0),
    ]


def bare_ranks_ready(noop: Path) -> float:
    """Seconds until a bare torchrun's 2 no-op ranks have joined their group (the Launch latency family's reference)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", str(noop)]
    return processes.run_timed_lines(argv, "ranks ready", timeout=300)[0]


def score(model_path, source, output, tracking: str, ranks: int) -> tuple[float, float, float]:
    """``ddpflow score`` on ``ranks`` ranks as a user runs it: (the command's wall seconds, the ranks' seconds from
    the plan to the coverage check, the manifest's ``seconds``, and their CPU seconds in it, ``cpu_seconds``)."""
    argv = ddpflow_api.score_command(model_path, source, output, ranks, tracking)
    with Timer() as command:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=output.parent, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"ddpflow score on {ranks} rank(s) failed: {done.stderr[-2000:]}")
    manifest = json.loads((output / "manifest.json").read_text())
    return command.seconds, manifest["seconds"], manifest["cpu_seconds"]


def pyfunc_rate(model_path, source, threads: int) -> float:
    """Rows/s of the served pyfunc's predict over the source in CHUNK-row chunks read with pyarrow, model load
    included, torch on ``threads`` threads."""
    import pyarrow.parquet as pq

    set_threads(threads)
    rows = 0
    with Timer() as served:
        score = ddpflow_api.pyfunc_scorer(model_path)
        for batch in pq.ParquetFile(source).iter_batches(batch_size=CHUNK):
            score(batch.to_pandas())
            rows += batch.num_rows
    return rows / served.seconds


def forward_rate(model_path, source, repeats: int = 5) -> tuple[float, float]:
    """(rows/s of one forward call on a pre-encoded FORWARD_BATCH-row batch, rows/s of the same batch in
    CPU_FORWARD_ROWS-row calls), one torch thread, no encoding."""
    model, calls = forward_calls(model_path, source)
    return timed_forward(model, calls, repeats)


def forward_calls(model_path, source) -> tuple[object, list[list[dict]]]:
    """(the model, [the batch in one call, the batch in CPU_FORWARD_ROWS-row calls]), one torch thread: a
    pre-encoded FORWARD_BATCH-row batch of the source's first rows."""
    import pyarrow.parquet as pq

    set_threads(1)
    frame = next(pq.ParquetFile(source).iter_batches(batch_size=FORWARD_BATCH)).to_pandas()
    model, batch = ddpflow_api.encoded_forward(model_path, frame)
    step = ddpflow_api.cpu_forward_rows()
    starts = range(0, len(frame), step)
    chunks = [{name: tensor[start : start + step] for name, tensor in batch.items()} for start in starts]
    return model, [[batch], chunks]  # the chunks are views of the batch: the same rows, only the calls differ


def timed_forward(model, calls: list[list[dict]], repeats: int = 5) -> tuple[float, float]:
    """The rows/s of each way of calling (``forward_calls``), after one warm-up pass of it."""
    import torch

    rates = []
    with torch.inference_mode():
        for way in calls:
            rows = sum(len(next(iter(call.values()))) for call in way)
            for call in way:  # warm-up
                model(call)
            with Timer() as timed:
                for _ in range(repeats):
                    for call in way:
                        model(call)
            rates.append(repeats * rows / timed.seconds)
    return rates[0], rates[1]


def forward_child(model_path: str, source: str) -> None:
    """A process of ``forwards_at_once``: the model and batch loaded, "ready", then on a line from stdin the
    forward timed; its faster rate printed as the last line."""
    model, calls = forward_calls(model_path, source)
    print("ready", flush=True)
    sys.stdin.readline()
    print(max(timed_forward(model, calls)), flush=True)


def forwards_at_once(model_path, source, count: int) -> float:
    """The summed rows/s of ``count`` processes timing the model's forward (``forward_rate``, the faster way) at
    the same moment, each with one torch thread: started, loaded, then released together."""
    script = f"from bench.families.scoring import forward_child; forward_child({str(model_path)!r}, {str(source)!r})"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=processes.child_env(threads=1),
        )
        for _ in range(count)
    ]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a forward process ended before it was ready")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        return sum(float(child.communicate(timeout=300)[0].split()[-1]) for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
