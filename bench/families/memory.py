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

Node-cache build: the builder's peak memory above its imports ÷ one record batch
of the source shards, on the numeric split and on the mixed one (numeric + 4
categoricals). Reported, no target.

Prepare: peak RSS above the imports at 1x and 4x rows; prepare streams the
source in record batches, so the peak should barely grow with rows.

Real-run memory: a real 2-rank train stage on the 1x and 4x datasets, its ranks
sampled from /proc (``real_run_memory``).

The probes run in fresh processes (bench/ranks/memory_probe.py), under torchrun
for the node figures.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.processes import rank_memory, rank_pids
from bench.harness.results import Result, Row, Stats, log, turns
from bench.workloads import images
from bench.workloads.pipeline import small_config
from bench.workloads.tabular import mixed_prepared_dir, prepared_dir, raw_bytes, source_file

NODE_RANKS = (2, 4)
NODE_TARGET = 1.3  # summed data PSS of a node's ranks ÷ raw train bytes
WARM_LOAD_TARGET_S = 0.2  # a rank's data loading once the node cache exists

PROBE = "bench.ranks.memory_probe"

LOADS = {
    "preallocated": "ddpflow: tensors allocated from the manifest, filled batch by batch",
    "concat": "pyarrow: read shards, concat_tables, column_stack",
    "pandas": "pandas: read_parquet per shard, concat, to_numpy",
}


def probe(args: list[str]) -> dict:
    output, _ = processes.run(processes.python_argv(PROBE, args), timeout=600)
    return processes.read_json_lines(output)[-1]


def run(ctx: Context) -> list[Result]:
    rows = ctx.sizes.rows
    dataset = prepared_dir(ctx, rows)
    train_raw = raw_bytes(ddpflow_api.manifest(dataset).rows("train"))
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
    return [
        *node_memory(ctx, dataset, train_raw),
        load,
        prepare_memory(ctx),
        build_memory(ctx),
        rank_anon_memory(ctx),
        image_anon_memory(ctx),
        real_run_memory(ctx),
    ]


def node_launch(ctx: Context, nproc: int, how: str, dataset, cache_dir) -> list[dict]:
    """One torchrun launch of ``bench.ranks.memory_probe node``: every rank's figures, in rank order."""
    out = Path(tempfile.mkdtemp(prefix=f"node-{nproc}-{how}-", dir=ctx.workdir))
    args = ["node", "--how", how, "--dataset", str(dataset), "--cache-dir", str(cache_dir), "--out", str(out)]
    processes.run(processes.torchrun_argv(nproc, PROBE, args), timeout=600)
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


def build_memory(ctx: Context) -> Result:
    """The node cache's builder, on the workload's numeric train split and on the mixed one: its largest
    anonymous memory above its imports ÷ one record batch's bytes (it streams: that is what it should hold),
    and its peak RSS with the mapped file's pages ÷ the file (those are page cache, written back)."""
    tables = {"numeric": prepared_dir(ctx, ctx.sizes.rows), "mixed (numeric + 4 categoricals)": None}
    tables["mixed (numeric + 4 categoricals)"] = mixed_prepared_dir(ctx, ctx.sizes.rows)
    figures: dict[str, list[dict]] = {name: [] for name in tables}
    batch_bytes = {name: ddpflow_api.record_batch_bytes(dataset, "train") for name, dataset in tables.items()}
    for repeat in range(ctx.sizes.memory_repeats):
        for name in turns(list(tables), repeat):
            cache_dir = ctx.workdir / "build-memory" / f"{repeat}-{len(figures[name])}-{name.split()[0]}"
            figures[name].append(probe(["build", "--dataset", str(tables[name]), "--cache-dir", str(cache_dir)]))
    log(
        "node-cache build peak anon MB: "
        + ", ".join(f"{name} {got[-1]['peak_anon_above_imports'] / 1e6:.1f}" for name, got in figures.items())
    )

    def of(name: str, key: str, per: float = 1e6) -> Stats:
        return Stats.of(got[key] / per for got in figures[name])

    rows = []
    for name in tables:
        per_batch = of(name, "peak_anon_above_imports", batch_bytes[name])
        rows += [
            Row(f"{name}: one record batch of the shards", Stats.of([batch_bytes[name] / 1e6]), "MB"),
            Row(f"{name}: the builder's peak anon above imports", of(name, "peak_anon_above_imports"), "MB", per_batch,
                note="ratio: ÷ one record batch"),
            Row(f"{name}: its peak RSS above imports, the mapped file's pages included",
                of(name, "peak_rss_above_imports"), "MB",
                Stats.of(got["peak_rss_above_imports"] / got["file_bytes"] for got in figures[name]),
                note=f"ratio: ÷ the cache file ({figures[name][-1]['file_bytes'] / 1e6:.0f} MB)"),
        ]  # fmt: skip
    headline = next(iter(tables))
    return Result(
        name="build_memory",
        title="Node-cache build memory",
        ratio=of(headline, "peak_anon_above_imports", batch_bytes[headline]),
        ratio_label="the node-cache builder's peak anonymous memory above its imports ÷ one record batch's bytes "
        "(numeric train split; the mixed one in the table)",
        rows=rows,
        notes=[
            f"The train split of the {ctx.sizes.rows:,}-row datasets; each build in a fresh process that imports what "
            "the builder process imports, then builds as it does (training.loading.node_cache._build: the file "
            "sized up front, mapped, filled by fill_split record batch by record batch). Anon: RssAnon sampled every "
            "millisecond; RSS: the kernel's VmHWM after a reset. One record batch: fill_split's read_rows rows of "
            f"the columns it reads, as Arrow holds them. {ctx.sizes.memory_repeats} run(s) each, taking turns.",
        ],
    )


def rank_anon_memory(ctx: Context) -> Result:
    """A rank's anonymous memory as the train split grows 4x: the node cache is file-backed, so it may grow by
    the sampler's permutation only (8 bytes a row: ``torch.randperm``'s int64)."""
    small, large = ctx.sizes.prepare_memory_rows
    return anon_growth(
        ctx,
        {rows: prepared_dir(ctx, rows) for rows in (small, large)},
        name="rank_anon_memory",
        title="Rank anonymous memory as data grows",
        what="Numeric data",
    )


def image_anon_memory(ctx: Context) -> Result:
    """The same with an encoded-image byte column (the node cache's ragged section: the PNG bytes and their
    offsets, file-backed too): the epoch's decoded batches come and go, so again only the permutation grows."""
    small, large = ctx.sizes.image_anon_rows
    return anon_growth(
        ctx,
        {rows: images.prepared(ctx, rows, ANON_IMAGE_SIZE, ANON_IMAGE_DISTINCT) for rows in (small, large)},
        name="rank_anon_memory_images",
        title="Rank anonymous memory as data grows, with images",
        trim=True,
        what=f"An image input: {ANON_IMAGE_SIZE}x{ANON_IMAGE_SIZE} PNGs drawn with Pillow ({ANON_IMAGE_DISTINCT} "
        "distinct, repeated; each row's bytes in the cache's ragged section), decoded and collated by the codec in "
        "the process (num_workers 0). RssAnon is read after malloc_trim: decoding makes many small allocations, "
        "and the free heap glibc keeps of them moved by 5-10 MB between runs, hiding the permutation",
    )


ANON_IMAGE_SIZE, ANON_IMAGE_DISTINCT = 16, 256


def anon_growth(
    ctx: Context, datasets: dict[int, Path], *, name: str, title: str, what: str, trim: bool = False
) -> Result:
    """RssAnon of a process holding the mapped train split over an epoch, at 1x and 4x rows: its growth ÷ the
    sampler permutation's (8 bytes a train row)."""
    small, large = sorted(datasets)
    anon: dict[int, list[float]] = {small: [], large: []}
    train_rows = {}
    for rows, dataset in datasets.items():
        cache_dir = ctx.workdir / "anon-cache" / f"{name}-{rows}"
        ddpflow_api.node_splits(dataset, ("train",), cache_dir)  # built here: the probe maps it, as ranks do
        for _ in range(ctx.sizes.memory_repeats):
            figures = probe(["anon", "--dataset", str(dataset), "--cache-dir", str(cache_dir), *(["--trim"] * trim)])
            anon[rows].append(figures["anon_above_imports"])
            train_rows[rows] = figures["rows"]
    permutation_growth = 8 * (train_rows[large] - train_rows[small])
    growth = Stats.of((b - a) / permutation_growth for a, b in zip(anon[small], anon[large]))
    log(f"{title}: RssAnon MB {small:,} rows {anon[small][-1] / 1e6:.2f}, {large:,} rows {anon[large][-1] / 1e6:.2f}")
    return Result(
        name=name,
        title=title,
        ratio=growth,
        target=1.5,
        direction="le",
        ratio_label=f"RssAnon growth from 1x to {large // small}x train rows ÷ the permutation's growth (8 B/row)",
        rows=[
            Row(f"{train_rows[small]:,} train rows", Stats.of(v / 1e6 for v in anon[small]), "MB"),
            Row(f"{train_rows[large]:,} train rows", Stats.of(v / 1e6 for v in anon[large]), "MB", growth),
            Row("the permutation's growth", Stats.of([permutation_growth / 1e6]), "MB"),
        ],
        notes=[
            "One process: imports, then the train split mapped from the node cache (built before), then an epoch of "
            "batches; RssAnon (anonymous pages only: the cache's file pages are not in it) above the imports, its "
            f"largest over the epoch. {what}. {ctx.sizes.memory_repeats} run(s) each."
        ],
    )


# ----------------------------------------------------------------------------- a real run's memory

RUN_RANKS = 2
RUN_TARGET = 1.3  # peak summed data PSS growth ÷ raw train growth
SAMPLE_S = 0.05


def sampled_run(ctx: Context, rows: int, root: Path) -> dict[str, float]:
    """One real 2-rank, 1-epoch train stage on the ``rows``-row dataset: the peak summed anon + cache PSS of the
    ranks, and the largest single rank's anon."""
    dataset = prepared_dir(ctx, rows)
    config = small_config(ctx, root, nproc_per_node=RUN_RANKS, progress_interval_s=60)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            ddpflow_api.launch_training(config, dataset, root / "run", lambda line: None, timeout_s=900)
        except BaseException as error:  # re-raised in the sampling thread
            failure.append(error)

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    peak_sum = peak_anon = 0
    while worker.is_alive():
        figures = [got for got in map(rank_memory, rank_pids()) if got]
        if len(figures) == RUN_RANKS:
            peak_sum = max(peak_sum, sum(anon + cache for anon, cache in figures))
            peak_anon = max(peak_anon, *(anon for anon, _ in figures))
        time.sleep(SAMPLE_S)
    if failure:
        raise failure[0]
    return {"peak_sum": peak_sum, "peak_anon": peak_anon}


def real_run_memory(ctx: Context) -> Result:
    """Memory of a real training run: the node's data memory at its peak, and how a rank's memory grows with data.

    The node memory figures (``node_memory`` above) come from a probe that loads the splits the way ranks do and
    walks an epoch's batches. This one runs the real thing: the train stage as the Prefect task runs it
    (``launch_training``: preflight, job file, torchrun, ``training.train``), 2 ranks, 1 epoch, on the 1x and the 4x
    dataset, while this process samples every rank every 50 ms:

    - Pss_Anon (``/proc/PID/smaps_rollup``): the rank's private memory, every copy it makes;
    - the PSS of its node-cache mappings (``/proc/PID/smaps``, the ``*.bin`` files): a page mapped by both ranks
      counts half in each, so the sum over the ranks is the page cache's one copy.

    The interpreter, torch, the process group and the model cost the same at 1x and 4x, so differences between the
    two runs are the data's: the peak summed (anon + cache) PSS grows by ``ratio`` x the raw train bytes it added
    (target 1.3; the cache holds the val split too, which is 1/8 of the train rows), and a rank's own anon memory by
    what its sampler's permutation takes (``RankSampler.rank_indices``: the epoch's n-row permutation, 8 bytes a row,
    while this rank's n/W rows are taken from it).
    """
    small, large = ctx.sizes.prepare_memory_rows
    train_rows = {rows: ddpflow_api.manifest(prepared_dir(ctx, rows)).rows("train") for rows in (small, large)}
    runs = {small: [], large: []}
    for repeat in range(ctx.sizes.memory_repeats):
        for rows in (small, large):
            runs[rows].append(sampled_run(ctx, rows, ctx.workdir / "run-memory" / f"{rows}-{repeat}"))
        log(
            "real-run memory: peak summed PSS "
            + ", ".join(f"{rows:,} rows {runs[rows][-1]['peak_sum'] / 1e6:.0f} MB" for rows in (small, large))
        )
    added_raw = raw_bytes(train_rows[large]) - raw_bytes(train_rows[small])
    added_rows = train_rows[large] - train_rows[small]

    def growth(key: str, per: int) -> Stats:
        return Stats.of((b[key] - a[key]) / per for a, b in zip(runs[small], runs[large]))

    node, rank = growth("peak_sum", added_raw), growth("peak_anon", added_rows)
    return Result(
        name="run_memory",
        title="Real-run memory",
        ratio=node,
        target=RUN_TARGET,
        direction="le",
        ratio_label="growth of the peak summed (anon + node-cache) PSS of the ranks ÷ raw train bytes added, "
        f"{small:,} to {large:,} rows, a real 2-rank train stage",
        rows=[
            *(
                Row(
                    f"{rows:,} rows: peak summed PSS of the 2 ranks",
                    Stats.of(r["peak_sum"] / 1e6 for r in runs[rows]),
                    "MB",
                )
                for rows in (small, large)
            ),
            Row(
                "a rank's anon memory at its peak, per train row added",
                rank,
                "bytes",
                note="the sampler's epoch permutation: 8 bytes a row, plus 8/W for this rank's share",
            ),
        ],
        notes=[
            "The train stage as the Prefect task runs it (preflight, torchrun, training.train), 2 CPU ranks, "
            "1 epoch, the node cache built in the run; every rank sampled every 50 ms from /proc. Fixed costs "
            "(interpreter, torch, process group, model) cancel in the difference of the two runs.",
            f"{ctx.sizes.memory_repeats} repeat(s).",
        ],
    )
