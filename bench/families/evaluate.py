"""Evaluate: ``evaluate_split`` rows/s ÷ training rows/s on the same rows (the test split).

Evaluation streams the shards from disk and runs the forward pass only;
training runs forward + backward + AdamW on rows already in memory. Both in
this process with one torch thread; the model is the workload's MLP (its
weights do not change the speed), saved as a ddpflow ``model.pt``.
"""

from __future__ import annotations

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, Timer, log
from bench.workloads.tabular import BATCH, build_model_and_optimizer, prepared_dir, set_threads, write_model


def run(ctx: Context) -> list[Result]:
    set_threads(ctx.threads)
    dataset = prepared_dir(ctx, ctx.sizes.rows)
    model_path = write_model(dataset, ctx.workdir / "eval-model.pt")
    test = ddpflow_api.load_split(dataset, "test")
    batches = ddpflow_api.train_batches(test, batch=BATCH)
    eval_rates, train_rates = [], []
    for repeat in range(ctx.sizes.repeats):
        with Timer() as evaluation:
            rows = ddpflow_api.evaluate(model_path, dataset, "test")
        eval_rates.append(rows / evaluation.seconds)
        model, optimizer = build_model_and_optimizer()
        with Timer() as training:
            samples = ddpflow_api.train_epoch(model, optimizer, batches, repeat)
        train_rates.append(samples / training.seconds)
        log(
            f"evaluate repeat {repeat + 1}: evaluate {eval_rates[-1]:,.0f} rows/s, training "
            f"{train_rates[-1]:,.0f} rows/s"
        )
    ratio = Stats.of(a / b for a, b in zip(eval_rates, train_rates))
    return [
        Result(
            name="evaluate",
            title="Evaluate",
            ratio=ratio,
            target=1.0,
            ratio_label="evaluate_split rows/s ÷ training rows/s on the same rows",
            rows=[
                Row(
                    "evaluate_split (test split, from the shards, eval batch 65,536)",
                    Stats.of(eval_rates),
                    "rows/s",
                    ratio,
                ),
                Row("training epoch on the test split's rows (in memory, batch 512)", Stats.of(train_rates), "rows/s"),
            ],
            notes=[
                f"{len(test):,} test rows; evaluation time includes loading model.pt, reading the shards and "
                "the metrics (confusion matrix, per class)."
            ],
        )
    ]
