"""Data path: ddpflow's training samples/s ÷ the compute limit, in one process.

The compute limit is the same model and step fed from batches cut in advance
(a list lookup per step). Every loader is timed over the same number of steps
after the same warm-up, with one torch thread (one rank's share of two
cores), and the loaders take turns within each repeat so that load on the
machine hits them alike. Each repeat gives one ratio per loader.
"""

from __future__ import annotations

from bench import loaders
from bench.harness import Result, Row, Stats, Timer, log
from bench.workload import BATCH, Context, build_model_and_optimizer, cycle, ddpflow_has, prepared_dir, set_threads, timed_steps, train_arrays

TITLE = "Data path"
REFERENCES = {  # label, what it is, earlier measurement
    "per_row": ("per-row Dataset + DataLoader", 0.63),
    "batch_sampler": ("BatchSampler Dataset + DataLoader", 0.86),
}


def run(ctx: Context) -> list[Result]:
    sizes = ctx.sizes
    set_threads(ctx.threads)
    x, y = train_arrays(ctx, sizes.rows)
    epochs = {
        "compute": loaders.presliced(x, y, BATCH, sizes.steps + sizes.warmup),
        "per_row": loaders.per_row(x, y, BATCH),
        "batch_sampler": loaders.batch_sampler(x, y, BATCH),
    }
    notes = [
        f"{len(y):,} train rows x {x.shape[1]} features, batch {BATCH}, {sizes.steps} timed steps after {sizes.warmup} warm-up steps, "
        f"{ctx.threads} torch thread(s); each repeat starts a fresh epoch, so per-epoch work (shuffling) is inside the timing."
    ]
    load_seconds = None
    if ddpflow_has("training.loading"):
        with Timer() as load:
            epochs["ddpflow"] = loaders.ddpflow(prepared_dir(ctx, sizes.rows), BATCH)
        load_seconds = load.seconds
    else:
        notes.append("training/loading.py is not there yet: ddpflow's loader was not measured.")

    rates: dict[str, list[float]] = {name: [] for name in epochs}
    for repeat in range(sizes.repeats):
        for name, epoch in epochs.items():
            model, optimizer = build_model_and_optimizer()
            samples, seconds = timed_steps(model, optimizer, cycle(epoch), sizes.steps, sizes.warmup)
            rates[name].append(samples / seconds)
        log(f"data path repeat {repeat + 1}: " + ", ".join(f"{name} {values[-1]:,.0f}/s" for name, values in rates.items()))

    def ratio_to_compute(name: str) -> Stats:
        return Stats.of(a / b for a, b in zip(rates[name], rates["compute"]))

    rows = [Row("compute limit (pre-sliced tensors)", Stats.of(rates["compute"]), "samples/s", note="same model, same process")]
    headline = None
    if "ddpflow" in rates:
        headline = ratio_to_compute("ddpflow")
        rows.append(Row("ddpflow loader", Stats.of(rates["ddpflow"]), "samples/s", headline, note=f"whole train split loaded in {load_seconds:.2f} s before the first step"))
    for name, (label, before) in REFERENCES.items():
        rows.append(Row(label, Stats.of(rates[name]), "samples/s", ratio_to_compute(name), note=f"measured before: {before}"))
    result = Result(
        name="datapath",
        title=TITLE,
        ratio=headline,
        target=0.95,
        ratio_label="ddpflow samples/s ÷ compute limit",
        rows=rows,
        notes=notes,
    )
    if headline is None:
        result.status, result.reason = "skipped", "ddpflow's loader (training/loading.py) does not exist yet"
    return [result]
