"""Memory: what loading the train split and preparing a dataset cost, each in a fresh process.

Rank load: peak RSS above the imports ÷ raw train bytes (float32 features +
int64 label), for ddpflow's preallocated load and for the two obvious
alternatives (concatenate pyarrow tables, or a pandas DataFrame).

Prepare: peak RSS above the imports at 1x and 4x rows; prepare streams the
source in record batches, so the peak should barely grow with rows.
"""

from __future__ import annotations

from bench import processes
from bench.harness import Result, Row, Stats, log
from bench.workload import Context, prepared_dir, raw_bytes, source_file

LOADS = {
    "preallocated": "ddpflow: tensors allocated from the manifest, filled batch by batch",
    "concat": "pyarrow: read shards, concat_tables, column_stack",
    "pandas": "pandas: read_parquet per shard, concat, to_numpy",
}


def probe(args: list[str]) -> dict:
    output, _ = processes.run(processes.python_argv("bench.memory_probe", args), timeout=600)
    return processes.read_json_lines(output)[-1]


def run(ctx: Context) -> list[Result]:
    from training.data.manifest import read_manifest

    rows = ctx.sizes.rows
    dataset = prepared_dir(ctx, rows)
    train_raw = raw_bytes(read_manifest(dataset).rows("train"))
    peaks: dict[str, list[float]] = {how: [] for how in LOADS}
    for _ in range(ctx.sizes.memory_repeats):
        for how in LOADS:
            peaks[how].append(probe(["load", "--how", how, "--dataset", str(dataset)])["peak_above_imports"])
    log("rank load peak MB: " + ", ".join(f"{how} {values[-1] / 1e6:.0f}" for how, values in peaks.items()))
    ratio = {how: Stats.of(value / train_raw for value in values) for how, values in peaks.items()}
    load = Result(
        name="memory",
        title="Rank memory",
        ratio=ratio["preallocated"],
        target=2.0,
        direction="le",
        ratio_label="peak RSS of one rank's load above imports ÷ raw train bytes",
        rows=[Row("raw train bytes", Stats.of([train_raw / 1e6]), "MB")]
        + [Row(label, Stats.of(v / 1e6 for v in peaks[how]), "MB", ratio[how]) for how, label in LOADS.items()],
        notes=[
            f"Train split of the {rows:,}-row dataset; each load in a fresh process, peak from the kernel's VmHWM after a reset; {ctx.sizes.memory_repeats} run(s) each."
        ],
    )
    return [load, prepare_memory(ctx)]


def prepare_memory(ctx: Context) -> Result:
    small, large = ctx.sizes.prepare_memory_rows
    peaks: dict[int, list[float]] = {small: [], large: []}
    for repeat in range(ctx.sizes.memory_repeats):
        for rows in (small, large):
            root = ctx.workdir / "prepare-memory" / f"{rows}-{repeat}"
            peaks[rows].append(
                probe(["prepare", "--source", str(source_file(ctx, rows)), "--root", str(root)])["peak_above_imports"]
            )
    log(f"prepare peak MB: {small:,} rows {peaks[small][-1] / 1e6:.0f}, {large:,} rows {peaks[large][-1] / 1e6:.0f}")
    growth = Stats.of(b / a for a, b in zip(peaks[small], peaks[large]))
    return Result(
        name="prepare_memory",
        title="Prepare memory",
        ratio=growth,
        target=1.5,
        direction="le",
        ratio_label=f"prepare peak RSS at {large // small}x rows ÷ at 1x",
        rows=[
            Row(f"{small:,} rows ({raw_bytes(small) / 1e6:.0f} MB raw)", Stats.of(v / 1e6 for v in peaks[small]), "MB"),
            Row(
                f"{large:,} rows ({raw_bytes(large) / 1e6:.0f} MB raw)",
                Stats.of(v / 1e6 for v in peaks[large]),
                "MB",
                growth,
            ),
        ],
        notes=["Peak RSS above imports of prepare_dataset in a fresh process; the source is one Parquet file."],
    )
