"""Memory: what a node's ranks hold, what loading the train split and preparing a dataset cost.

Node memory: N ranks under torchrun (2 and 4), each getting the train and val
splits the way ``training.train`` does (the node cache: one builds, all map
one file) against each reading its own copy (before the cache). The summed
data PSS of the ranks above their per-rank baseline (interpreter, torch,
process group, model) ÷ raw train bytes. The same launches give the start-up
figures: the builder's time against the old per-rank load, and how long a
rank takes to get its data once the cache exists.

Rank load: peak RSS above the imports ÷ raw train bytes (float32 features +
int64 label), for ddpflow's preallocated load and for the two obvious
alternatives (concatenate pyarrow tables, or a pandas DataFrame).

Prepare: peak RSS above the imports at 1x and 4x rows; prepare streams the
source in record batches, so the peak should barely grow with rows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench import processes
from bench.harness import Result, Row, Stats, log, turns
from bench.workload import Context, prepared_dir, raw_bytes, source_file

NODE_RANKS = (2, 4)
NODE_TARGET = 1.3  # summed data PSS of a node's ranks ÷ raw train bytes
WARM_LOAD_TARGET_S = 0.2  # a rank's data loading once the node cache exists

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
            f"Train split of the {rows:,}-row dataset; each load in a fresh process, peak from the kernel's VmHWM "
            f"after a reset; {ctx.sizes.memory_repeats} run(s) each."
        ],
    )
    from bench import run_memory

    return [*node_memory(ctx, dataset, train_raw), load, prepare_memory(ctx), *run_memory.run(ctx)]


def node_launch(ctx: Context, nproc: int, how: str, dataset, cache_dir) -> list[dict]:
    """One torchrun launch of ``bench.memory_probe node``: every rank's figures, in rank order."""
    out = Path(tempfile.mkdtemp(prefix=f"node-{nproc}-{how}-", dir=ctx.workdir))
    args = ["node", "--how", how, "--dataset", str(dataset), "--cache-dir", str(cache_dir), "--out", str(out)]
    processes.run(processes.torchrun_argv(nproc, "bench.memory_probe", args), timeout=600)
    ranks = sorted(processes.read_rank_files(out), key=lambda figures: figures["rank"])
    if len(ranks) != nproc:
        raise RuntimeError(f"node memory, {nproc} ranks ({how}): {len(ranks)} rank reports")
    return ranks


def node_memory(ctx: Context, dataset, train_raw: int) -> list[Result]:
    """Per repeat and rank count: each rank loads its own copy; then the cache is built; then it is reused."""
    kinds = ("own copies", "cache built", "cache there")
    held = {(n, kind): [] for n in NODE_RANKS for kind in kinds}  # summed data PSS above baselines, bytes
    start = {(n, kind): [] for n in NODE_RANKS for kind in kinds}  # slowest rank's load, seconds
    builds = {n: [] for n in NODE_RANKS}  # the building rank's own seconds
    for repeat in range(ctx.sizes.memory_repeats):
        for n in turns(NODE_RANKS, repeat):
            cache_dir = ctx.workdir / "node-cache" / f"{n}-{repeat}"
            launches = {
                "own copies": node_launch(ctx, n, "load", dataset, cache_dir),
                "cache built": node_launch(ctx, n, "cache", dataset, cache_dir),
                "cache there": node_launch(ctx, n, "cache", dataset, cache_dir),
            }
            for kind, ranks in launches.items():
                held[(n, kind)].append(sum(r["after"] - r["baseline"] for r in ranks))
                start[(n, kind)].append(max(r["load_seconds"] for r in ranks))
            built = [r for r in launches["cache built"] if r["how"].startswith("built")]
            builds[n].append(max((r["load_seconds"] for r in built), default=float("nan")))
            log(
                f"node memory, {n} ranks: "
                + ", ".join(f"{kind} {held[(n, kind)][-1] / train_raw:.2f}x" for kind in kinds)
                + f"; build {builds[n][-1]:.2f} s, load once cached {start[(n, 'cache there')][-1]:.3f} s"
            )
    return [node_memory_result(ctx, held, train_raw), node_start_result(ctx, start, builds)]


def node_memory_result(ctx: Context, held: dict, train_raw: int) -> Result:
    def ratio(n: int, kind: str) -> Stats:
        return Stats.of(value / train_raw for value in held[(n, kind)])

    worst = Stats.of(
        max(values) / train_raw for values in zip(*(held[(n, "cache built")] for n in NODE_RANKS))
    )  # per repeat, the larger of the rank counts: the target holds for both
    labels = {
        "cache built": "node cache, built in this launch",
        "cache there": "node cache, already there",
        "own copies": "each rank reads its own copy (before the cache)",
    }
    rows = [Row("raw train bytes", Stats.of([train_raw / 1e6]), "MB")]
    for n in NODE_RANKS:
        rows += [
            Row(f"{n} ranks: {label}", Stats.of(v / 1e6 for v in held[(n, kind)]), "MB", ratio(n, kind))
            for kind, label in labels.items()
        ]
    return Result(
        name="node_memory",
        title="Node memory",
        ratio=worst,
        target=NODE_TARGET,
        direction="le",
        ratio_label=f"summed data PSS of {' and of '.join(map(str, NODE_RANKS))} local ranks above their baselines "
        "÷ raw train bytes (the larger)",
        rows=rows,
        notes=[
            "Each rank under torchrun: baseline after imports, process group and model; then the train and val splits "
            "the way training.train gets them; then what a rank touches in an epoch (every batch of its train share "
            "gathered, its val slice read); then, with every rank holding its data, the PSS again.",
            "Data PSS: anonymous memory plus the node cache's file mappings (a page mapped by N ranks counts 1/N in "
            "each), summed over the ranks. Shared libraries are left out: their PSS moves with every other Python "
            "process on the machine. The cache holds the val split too (raw: train only), and the sampler's "
            "per-epoch permutation (8 bytes a train row) is per rank.",
            f"{ctx.sizes.memory_repeats} repeat(s); the rank counts take turns.",
        ],
    )


def node_start_result(ctx: Context, start: dict, builds: dict) -> Result:
    warm = Stats.of(max(values) for values in zip(*(start[(n, "cache there")] for n in NODE_RANKS)))
    rows = []
    for n in NODE_RANKS:
        before = Stats.of(start[(n, "own copies")])
        rows += [
            Row(f"{n} ranks, before the cache: the slowest rank's load from the shards", before, "s"),
            Row(
                f"{n} ranks, first run: the building rank (load_split + write + fsync)",
                Stats.of(builds[n]),
                "s",
                Stats.of(b / a for b, a in zip(builds[n], start[(n, "own copies")])),
                note="ratio: ÷ before the cache",
            ),
            Row(
                f"{n} ranks, first run: the slowest rank (the others wait for the build, then map)",
                Stats.of(start[(n, "cache built")]),
                "s",
            ),
            Row(
                f"{n} ranks, cache there: the slowest rank (open, validate, map)",
                Stats.of(start[(n, "cache there")]),
                "s",
            ),
        ]
    return Result(
        name="node_cache_start",
        title="Node cache start-up",
        ratio=warm,
        target=WARM_LOAD_TARGET_S,
        direction="le",
        ratio_label="seconds until every rank holds its train and val splits once the node cache exists (slowest rank)",
        rows=rows,
        notes=[
            "The same launches as the node memory figures; times are a rank's own, from the process group's barrier "
            "to its split tensors (mapping only: pages come in as batches touch them).",
        ],
    )


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
