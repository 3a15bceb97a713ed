"""Peak memory of one job in a fresh process; run by bench/memory.py.

    python -m bench.memory_probe load --how preallocated|concat|pandas --dataset DIR
    python -m bench.memory_probe prepare --source FILE --root DIR

Imports everything first, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``),
does the job while holding its result, and prints ``BENCH {"peak_above_imports": bytes, ...}``.
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path


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

    from training.data.manifest import read_manifest

    manifest = read_manifest(dataset)
    files = manifest.split_files(dataset, "train")
    columns = [*manifest.features, manifest.label]
    if how == "preallocated":
        from bench.ddpflow_api import load_train_split

        split = load_train_split(dataset)
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
    from training.config import DataConfig
    from training.data.prepare import prepare_dataset

    return prepare_dataset(DataConfig(source=source, label="label", root=root))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="job", required=True)
    load_args = sub.add_parser("load")
    load_args.add_argument("--how", required=True)
    load_args.add_argument("--dataset", required=True)
    prepare_args = sub.add_parser("prepare")
    prepare_args.add_argument("--source", required=True)
    prepare_args.add_argument("--root", required=True)
    args = parser.parse_args()

    # Import everything the job needs before the baseline, so only the job's data counts.
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401

    import training.data.prepare
    import training.loading  # noqa: F401

    baseline = rss_bytes("VmRSS")
    exact = reset_peak()
    result = load(args.how, args.dataset) if args.job == "load" else prepare(args.source, args.root)
    peak = rss_bytes("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del result
    from bench.processes import report

    report(baseline=baseline, peak=peak, peak_above_imports=peak - baseline, exact_peak=exact)


if __name__ == "__main__":
    main()
