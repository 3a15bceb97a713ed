"""Scale: each stage's time at growing row counts, and how far it is from linear.

Stages, one process, one torch thread: prepare (source file -> shards),
load (train split into memory, as a rank does), one training epoch (one
rank), evaluate (test split). For each stage: seconds at each size, the
least-squares slope in seconds per million rows, and the per-row cost at the
largest size ÷ at the smallest (1.0 = linear; above: superlinear).
"""

from __future__ import annotations

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log
from bench.workloads.tabular import (
    BATCH,
    build_model_and_optimizer,
    data_config,
    set_threads,
    source_file,
    write_model,
)

LINEAR_WITHIN = 1.2  # per-row cost at the largest size at most 20% above the smallest's


def stage_times(ctx: Context, rows: int) -> dict[str, float]:
    source = source_file(ctx, rows)
    times: dict[str, float] = {}
    with Timer() as prepare:
        dataset = ddpflow_api.prepare(data_config(ctx, source, root=ctx.workdir / "scale" / str(rows)))
    times["prepare"] = prepare.seconds
    with Timer() as load:
        split = ddpflow_api.load_train_split(dataset)
    times["load train split"] = load.seconds
    batches = ddpflow_api.train_batches(split, batch=BATCH)
    model, optimizer = build_model_and_optimizer()
    with Timer() as epoch:
        ddpflow_api.train_epoch(model, optimizer, batches, 0)
    times["train one epoch (1 rank)"] = epoch.seconds
    del split, batches
    model_path = write_model(dataset, ctx.workdir / f"scale-model-{rows}.pt")
    with Timer() as evaluation:
        ddpflow_api.evaluate(model_path, dataset, "test")
    times["evaluate test split"] = evaluation.seconds
    return times


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def run(ctx: Context) -> list[Result]:
    set_threads(ctx.threads)
    sizes = sorted(ctx.sizes.scale_rows)
    by_size = {}
    for rows in sizes:
        by_size[rows] = stage_times(ctx, rows)
        log(
            f"scale {rows:,} rows: " + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in by_size[rows].items())
        )
    small, large = sizes[0], sizes[-1]
    rows_out: list[Row] = []
    growth: dict[str, float] = {}
    for stage in by_size[small]:
        seconds = [by_size[rows][stage] for rows in sizes]
        growth[stage] = (seconds[-1] / large) / (seconds[0] / small)
        per_million = slope([rows / 1e6 for rows in sizes], seconds)
        timings = ", ".join(f"{rows / 1e6:g}M: {value:.2f} s" for rows, value in zip(sizes, seconds))
        rows_out.append(Row(stage, Stats.of([per_million]), "s per 1M rows", Stats.of([growth[stage]]), note=timings))
    worst = max(growth, key=growth.get)
    return [
        Result(
            name="scale",
            title="Scale",
            ratio=Stats.of([growth[worst]]),
            target=LINEAR_WITHIN,
            direction="le",
            ratio_label=f"worst stage's per-row cost at {large / 1e6:g}M rows ÷ at {small / 1e6:g}M ({worst})",
            rows=rows_out,
            notes=[
                f"Sizes {', '.join(f'{rows:,}' for rows in sizes)} rows, one run each. Value: least-squares "
                "slope; ratio: per-row cost at the largest size ÷ at the smallest (1.0 = linear).",
                f"The target reads 'linear' as within {LINEAR_WITHIN}x. Small sizes carry fixed costs (imports "
                "warm, file opens), so ratios below 1 are expected.",
            ],
        )
    ]
