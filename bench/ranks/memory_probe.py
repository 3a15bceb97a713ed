"""Memory of one job in fresh processes; run by the memory family (bench/families/memory.py).

    python -m bench.ranks.memory_probe load --how preallocated|concat|pandas --dataset DIR
    python -m bench.ranks.memory_probe prepare --source FILE --root DIR
    python -m bench.ranks.memory_probe anon --dataset DIR --cache-dir DIR
    python -m bench.ranks.memory_probe build --dataset DIR --cache-dir DIR
    python -m torch.distributed.run --standalone --nproc_per_node N -m bench.ranks.memory_probe \
        node --how cache|load --dataset DIR --cache-dir DIR --out DIR

``load``/``prepare``: imports everything first, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), does the job while holding its result, and prints
``BENCH {"peak_above_imports": bytes, ...}``.

``anon``: a rank's anonymous memory (RssAnon) above its imports over an epoch of
batches from the node cache: ``BENCH {"anon_above_imports": bytes, "rows": n}``.

``build``: what the node cache's builder process does for the train split, in this
process: its peak RSS (VmHWM, the mapped file's pages included) and its largest
RssAnon (sampled every millisecond on a thread: the builder's own memory, not the
file's pages) above the imports: ``BENCH {"peak_rss_above_imports", "peak_anon_above_imports",
"file_bytes"}``.

``node`` (one rank of N under torchrun): the rank's data PSS (``data_pss``) after
imports, the process group and the model (its baseline), then the train and val
splits got the way ranks get them (``cache``: the node cache, as ``training.train``
does; ``load``: each rank reads the shards itself, without a node cache), then an
epoch's worth of what a rank touches (every batch of its train share gathered, its
val slice read), then the data PSS again. Writes ``OUT/rank-<r>.json``: ``{"rank",
"baseline", "after", "load_seconds", "how"}`` (a file each: ranks' lines would interleave).
"""

from __future__ import annotations

import argparse
import os
import resource
from pathlib import Path

from bench import ddpflow_api
from bench.harness.processes import report
from bench.workloads.tabular import BATCH, build_model_and_optimizer


def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def load(how: str, dataset: str):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    manifest = ddpflow_api.manifest(dataset)
    files = manifest.split_files(dataset, "train")
    columns = [*manifest.features, manifest.label]
    if how == "preallocated":
        split = ddpflow_api.load_train_split(dataset)
        return split.features, split.labels
    if how == "concat":  # read every shard, concatenate, then convert: the obvious pyarrow way
        table = pa.concat_tables([pq.read_table(path, columns=columns) for path in files])
        x = torch.from_numpy(np.column_stack([table.column(name).to_numpy() for name in manifest.features]))
        return x, torch.from_numpy(table.column(manifest.label).to_numpy())
    if how == "pandas":  # the obvious pandas way
        import pandas as pd

        frame = pd.concat([pd.read_parquet(path, columns=columns) for path in files], ignore_index=True)
        return torch.tensor(frame[manifest.features].to_numpy(dtype="float32")), torch.tensor(
            frame[manifest.label].to_numpy()
        )
    raise ValueError(f"unknown --how {how!r}")


def prepare(source: str, root: str):

    return ddpflow_api.prepare(ddpflow_api.data_config(source=source, label="label", root=root))


def data_pss(cache_dir: str) -> int:
    """Proportional set size of what data can occupy: anonymous memory, plus the node cache's file mappings
    (each page counted 1/N in each of the N processes that map it; the sum over processes is the node's use).
    Shared libraries are left out: their PSS moves with every other Python process on the machine."""
    total, counted, cache_dir = 0, False, os.path.realpath(cache_dir)
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split(None, 5)
            if not fields[0].endswith(":"):  # a mapping's first line: address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) > 5 else ""
                counted = path in ("", "[heap]") or path.startswith("[anon") or path.startswith(cache_dir)
            elif fields[0] == "Pss:" and counted:
                total += int(fields[1]) * 1024
    return total


def node(how: str, dataset: str, cache_dir: str, out: str) -> None:
    import json
    import time

    import torch
    import torch.distributed as dist

    ddpflow_api.import_node_cache()  # before the baseline, as training.train does
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_and_optimizer = build_model_and_optimizer()
    ddpflow_api.manifest(dataset)  # warm the JSON and dataclass machinery before the baseline
    baseline = data_pss(cache_dir)
    dist.barrier()
    started = time.perf_counter()
    if how == "cache":
        cached = ddpflow_api.node_splits(dataset, ("train", "val"), cache_dir)
        train, val = cached["train"].tensors, cached["val"].tensors
        hows = ",".join(c.how for c in cached.values())
    else:
        train, val = (ddpflow_api.load_split(dataset, split) for split in ("train", "val"))
        hows = "load"
    load_seconds = time.perf_counter() - started
    for _ in ddpflow_api.train_batches(train, batch=BATCH, rank=rank, world_size=world).epoch(0):
        pass
    start, stop = ddpflow_api.shard_range(len(val), rank, world)
    float(val.features[start:stop].sum())
    dist.barrier()  # every rank holds its data: the node's sum is now complete
    after = data_pss(cache_dir)
    figures = {"rank": rank, "baseline": baseline, "after": after, "load_seconds": load_seconds, "how": hows}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(figures))
    dist.barrier()
    del model_and_optimizer, train, val
    dist.destroy_process_group()


def anon(dataset: str, cache_dir: str, trim: bool = False) -> None:
    """A rank's anonymous memory (RssAnon: not the node cache's file pages) above its imports, at its largest
    over an epoch of batches from the mapped train split (the cache built before, by the caller)."""
    import torch

    ddpflow_api.import_node_cache()  # before the baseline, as training.train does

    torch.set_num_threads(1)
    held = held_anon if trim else (lambda: rss_bytes("RssAnon"))
    baseline = held()
    train = ddpflow_api.node_splits(dataset, ("train",), cache_dir)["train"].tensors
    largest = held()
    for step, _ in enumerate(ddpflow_api.train_batches(train, batch=BATCH).epoch(0)):
        if step % 16 == 0:  # the permutation lives through the epoch; the batches come and go
            largest = max(largest, held())
    report(baseline=baseline, anon_above_imports=largest - baseline, rows=len(train))


def held_anon() -> int:
    """RssAnon once glibc has handed back the free memory it keeps (``malloc_trim``): what is still allocated.
    Decoding an image makes many small allocations; the free heap they leave is a few MB that moves from run
    to run (4.8-14 MB over 1,000-4,000 rows of PNGs), far more than a small split's permutation."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes("RssAnon")


def build(dataset: str, cache_dir: str) -> None:
    import threading

    ddpflow_api.import_node_cache()  # what the builder process imports before it builds
    ddpflow_api.manifest(dataset)  # warm the JSON and dataclass machinery before the baseline
    baseline_rss, baseline_anon = rss_bytes("VmRSS"), rss_bytes("RssAnon")
    exact = reset_peak()
    largest_anon, done = baseline_anon, threading.Event()

    def sample() -> None:
        nonlocal largest_anon
        while not done.wait(0.001):
            largest_anon = max(largest_anon, rss_bytes("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    path = ddpflow_api.build_node_cache_file(dataset, "train", cache_dir)
    done.set()
    sampler.join()
    peak = rss_bytes("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report(
        peak_rss_above_imports=peak - baseline_rss,
        peak_anon_above_imports=max(largest_anon, rss_bytes("RssAnon")) - baseline_anon,
        file_bytes=path.stat().st_size,
        exact_peak=exact,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="job", required=True)
    anon_args = sub.add_parser("anon")
    anon_args.add_argument("--dataset", required=True)
    anon_args.add_argument("--cache-dir", required=True)
    anon_args.add_argument("--trim", action="store_true", help="count what is allocated (held_anon)")
    build_args = sub.add_parser("build")
    build_args.add_argument("--dataset", required=True)
    build_args.add_argument("--cache-dir", required=True)
    node_args = sub.add_parser("node")
    node_args.add_argument("--how", choices=["cache", "load"], required=True)
    node_args.add_argument("--dataset", required=True)
    node_args.add_argument("--cache-dir", required=True)
    node_args.add_argument("--out", required=True)
    load_args = sub.add_parser("load")
    load_args.add_argument("--how", required=True)
    load_args.add_argument("--dataset", required=True)
    prepare_args = sub.add_parser("prepare")
    prepare_args.add_argument("--source", required=True)
    prepare_args.add_argument("--root", required=True)
    args = parser.parse_args()
    if args.job == "node":
        node(args.how, args.dataset, args.cache_dir, args.out)
        return
    if args.job == "anon":
        anon(args.dataset, args.cache_dir, args.trim)
        return
    if args.job == "build":
        build(args.dataset, args.cache_dir)
        return

    # Import everything the job needs before the baseline, so only the job's data counts.
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401

    ddpflow_api.import_prepare_and_load()

    baseline = rss_bytes("VmRSS")
    exact = reset_peak()
    result = load(args.how, args.dataset) if args.job == "load" else prepare(args.source, args.root)
    peak = rss_bytes("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del result
    report(baseline=baseline, peak=peak, peak_above_imports=peak - baseline, exact_peak=exact)


if __name__ == "__main__":
    main()
