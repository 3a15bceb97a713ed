"""Tables: ddpflow's default model beside scikit-learn's HistGradientBoosting on tables that look like real ones.

For each table (bench/workloads/tables.py: 8 generated with known structure, 4 bundled with scikit-learn):

ddpflow's default model as a user runs it and HistGradientBoosting with its defaults on the same split
(``bench/workloads/beside_boosting.py`` says how each is run and scored, and ``BENCH_TABLES_SET``).

The metric: ROC AUC for two classes, accuracy for several, R² for regression. The gap is boosting minus
ddpflow (positive: ddpflow trails). The targets: mean gap <= 0.01, no table trailing by more than 0.03.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, log
from bench.workloads import beside_boosting
from bench.workloads.tables import TABLES, TableSpec, generate, inputs_of

MEAN_GAP_TARGET, WORST_GAP_TARGET = 0.01, 0.03


def write_table(ctx: Context, spec: TableSpec, rows: int) -> tuple[Path, dict[str, str], int]:
    """The table as a Parquet source; (path, data.inputs, source rows)."""
    frame = generate(spec, rows)
    path = ctx.workdir / "tables" / f"{spec.name}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path, inputs_of(spec, frame), len(frame)


def measure(ctx: Context, spec: TableSpec, rows: int) -> dict:
    source, inputs, source_rows = write_table(ctx, spec, rows)
    figures = beside_boosting.measure(ctx.workdir / "tables" / spec.name, spec, source, inputs)
    figures.pop("dataset")
    figures["source_rows"] = source_rows
    log(f"tables {spec.name}: {json.dumps(figures, default=str)}")
    return figures


def row_for(spec: TableSpec, figures: dict) -> Row:
    seconds = figures["ddpflow_s"]
    dropped = figures["dropped_rows"]
    note = (
        f"{spec.task}; boosting {figures['boosting']:.3f}; "
        f"{figures['train_rows']:,} train / {figures['test_rows']:,} test rows"
        + (f", **{dropped:,} of {figures['source_rows']:,} dropped** (invalid values)" if dropped else "")
        + f"; ddpflow {sum(seconds.values()):.0f} s (prepare {seconds['prepare']:.1f}, train "
        f"{seconds['train']:.1f}, evaluate {seconds['evaluate']:.1f}), boosting fit {figures['boosting_fit_s']:.1f} s"
        f"; load {figures['load_1min']:.1f}"
        + (f"; **{figures['refused']}**" if figures["refused"] else "")
        + (f"; target-encoded for boosting: {', '.join(encoded)}" if (encoded := figures["target_encoded"]) else "")
    )
    return Row(
        f"{spec.name}: {spec.structure}",
        Stats.of([figures["ddpflow"]]),
        f"({figures['metric']})",
        Stats.of([figures["gap"]]),
        note,
    )


def run(ctx: Context) -> list[Result]:
    rows = 3_000 if ctx.quick else 30_000
    measured, failed = [], []
    for spec in TABLES:
        try:
            measured.append((spec, measure(ctx, spec, rows)))
        except Exception as error:  # one table's failure is recorded; the others still run
            log(f"tables {spec.name}: {type(error).__name__}: {error}")
            failed.append(f"{spec.name}: {type(error).__name__}: {str(error)[:300]}")
    gaps = [figures["gap"] for _, figures in measured]
    worst_spec, worst = max(measured, key=lambda item: item[1]["gap"])
    ddpflow_s = sum(sum(figures["ddpflow_s"].values()) for _, figures in measured)
    boosting_s = sum(figures["boosting_fit_s"] for _, figures in measured)
    notes = [
        f"{rows:,} rows per generated table (the bundled ones: all their rows); ddpflow: data.inputs by kind and "
        "2 ranks, nothing else: nulls are values, the task is inferred (the integer counts of store_sales: "
        "regression), the default model and training settings (up to 100 epochs, early stopping after 10 without "
        "a better val_loss, the best epoch's weights, the batch for the table's rows)"
        + (f"; this run's extra settings: {extra}" if (extra := os.environ.get(beside_boosting.EXPERIMENT_ENV)) else "")
        + ". "
        "Boosting: HistGradientBoosting defaults (random_state 0), one thread, on the same train and test rows; ids "
        "with more than 255 values target-encoded (TargetEncoder, cross-fitted on train; its time is in the fit's).",
        f"Times: ddpflow {ddpflow_s:.0f} s in all (prepare + torchrun launch and training + evaluate), boosting "
        f"{boosting_s:.1f} s of fitting in all. Measured on 2 shared cores while other work ran (the load column): "
        "the times are indicative, the quality figures do not depend on the load.",
        f"Mean gap {statistics.mean(gaps):.3f} (target ≤ {MEAN_GAP_TARGET}); worst {worst['gap']:.3f} on "
        f"{worst_spec.name} (target ≤ {WORST_GAP_TARGET}); tables trailing by more than {WORST_GAP_TARGET}: "
        f"{sum(gap > WORST_GAP_TARGET for gap in gaps)} of {len(gaps)}.",
        *[f"Not measured (error): {line}" for line in failed],
        "The bundled tables are small (178 to 1,797 rows: 26 to 180 test rows): their figures move by a few "
        "hundredths from one split to another.",
    ]
    return beside_boosting.gap_results(
        "tables",
        "Tables: gap to boosting",
        (statistics.mean(gaps), worst["gap"]),
        (MEAN_GAP_TARGET, WORST_GAP_TARGET),
        ("", f", on {worst_spec.name}"),
        [row_for(spec, figures) for spec, figures in measured],
        (notes, [f"Every table's gap is in the table above ({len(gaps)} tables)."]),
    )
