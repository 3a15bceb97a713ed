"""Memory of a real training run: the node's data memory at its peak, and how a rank's memory grows with data.

The node memory figures (bench/memory.py) come from a probe that loads the splits the way ranks do and walks an
epoch's batches. This one runs the real thing: the train stage as the Prefect task runs it
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

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil

from bench.harness import Result, Row, Stats, log
from bench.workload import Context, prepared_dir, raw_bytes

RANKS = 2
TARGET = 1.3  # peak summed data PSS growth ÷ raw train growth
SAMPLE_S = 0.05
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def rank_memory(pid: int) -> tuple[int, int] | None:
    """(Pss_Anon, PSS of the node-cache files it maps) in bytes; None once the process is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    anon = next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss_Anon:")), 0)
    cache, in_cache_file = 0, False
    for line in smaps.splitlines():
        if _MAPPING.match(line):
            in_cache_file = line.rstrip().endswith(".bin")
        elif in_cache_file and line.startswith("Pss:"):
            cache += int(line.split()[1]) * 1024
    return anon, cache


def rank_pids() -> list[int]:
    """This process's descendants that run the rank program (not torchrun's agent)."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            argv = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "training.train" in argv and "torch.distributed.run" not in argv:
            pids.append(child.pid)
    return pids


def sampled_run(ctx: Context, rows: int, root: Path) -> dict[str, float]:
    """One real 2-rank, 1-epoch train stage on the ``rows``-row dataset: the peak summed anon + cache PSS of the
    ranks, and the largest single rank's anon."""
    from bench.ddpflow_api import launch_training
    from bench.orchestration import small_config
    from ddpflow.launch.stage import TrainRequest

    dataset = prepared_dir(ctx, rows)
    config = small_config(ctx, root, nproc_per_node=RANKS, progress_interval_s=60)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            launch_training(TrainRequest(config, dataset, root / "run", on_line=lambda line: None), timeout_s=900)
        except BaseException as error:  # re-raised in the sampling thread
            failure.append(error)

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    peak_sum = peak_anon = 0
    while worker.is_alive():
        figures = [got for got in map(rank_memory, rank_pids()) if got]
        if len(figures) == RANKS:
            peak_sum = max(peak_sum, sum(anon + cache for anon, cache in figures))
            peak_anon = max(peak_anon, *(anon for anon, _ in figures))
        time.sleep(SAMPLE_S)
    if failure:
        raise failure[0]
    return {"peak_sum": peak_sum, "peak_anon": peak_anon}


def run(ctx: Context) -> list[Result]:
    from training.data.manifest import read_manifest

    small, large = ctx.sizes.prepare_memory_rows
    train_rows = {rows: read_manifest(prepared_dir(ctx, rows)).rows("train") for rows in (small, large)}
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
    return [
        Result(
            name="run_memory",
            title="Real-run memory",
            ratio=node,
            target=TARGET,
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
    ]
