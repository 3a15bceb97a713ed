"""The shared tabular workload: data on disk, the model, and a training loop.

Default workload: synthetic classification, 1M rows x 32 float32 features,
10 classes, MLP 32-256-256-10, AdamW, batch 512 per rank, one torch thread per
rank (two ranks on two cores). Its sizes are the run's (bench/harness/context.py);
what it writes is built at most once per run (``Context.cached``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import ddpflow_api
from bench.harness.context import Context

FEATURES = 32
CLASSES = 10
HIDDEN = (256, 256)
BATCH = 512
LR = 1e-3
WEIGHT_DECAY = 0.01


# --------------------------------------------------------------------------- data


def synthetic_url(rows: int, seed: int = 0) -> str:
    return f"synthetic://classification?rows={rows}&features={FEATURES}&classes={CLASSES}&seed={seed}"


def raw_bytes(rows: int) -> int:
    """The data as plain arrays: float32 features + int64 label."""
    return rows * (FEATURES * 4 + 8)


def source_file(ctx: Context, rows: int) -> Path:
    """A Parquet source (plain encoding, the synthetic generator's), written once per run."""

    def build() -> Path:
        return ddpflow_api.write_synthetic(synthetic_url(rows), ctx.workdir / "source" / f"rows-{rows}.parquet")

    return ctx.cached(f"source:{rows}", build)


def data_config(ctx: Context, source: str | Path, root: str | Path | None = None, **overrides: Any):
    root = str(root or ctx.workdir / "shards")
    return ddpflow_api.data_config(source=str(source), label="label", root=root, **overrides)


def prepared_dir(ctx: Context, rows: int) -> Path:
    """ddpflow's prepared dataset (manifest + shards) for ``rows`` rows, prepared once per run."""
    return ctx.cached(f"prepared:{rows}", lambda: ddpflow_api.prepare(data_config(ctx, source_file(ctx, rows))))


# The mixed table (the data path with typed inputs): the workload's numeric columns plus these categoricals, each drawn
# uniformly from this many string values, embedded by the built-in mlp (``embedding_dim(cardinality)`` wide).
CATEGORICALS = {"country": 50, "plan": 4, "device": 8, "merchant": 5000}


def mixed_source_file(ctx: Context, rows: int) -> Path:
    """The workload's source with ``CATEGORICALS`` appended as string columns, written once per run."""

    def build() -> Path:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(source_file(ctx, rows))
        rng = np.random.default_rng(0)
        for name, cardinality in CATEGORICALS.items():
            values = pa.array([f"{name}-{i}" for i in range(cardinality)])
            table = table.append_column(name, values.take(rng.integers(0, cardinality, size=rows)))
        path = ctx.workdir / "source" / f"mixed-{rows}.parquet"
        pq.write_table(table, path, use_dictionary=False)
        return path

    return ctx.cached(f"mixed-source:{rows}", build)


def mixed_prepared_dir(ctx: Context, rows: int) -> Path:
    """The mixed table prepared with ``data.inputs``: FEATURES numeric columns and ``CATEGORICALS``."""
    inputs = {**{f"f{i}": "numeric" for i in range(FEATURES)}, **dict.fromkeys(CATEGORICALS, "categorical")}

    def build() -> Path:
        config = data_config(ctx, mixed_source_file(ctx, rows), ctx.workdir / "mixed-shards", inputs=inputs)
        return ddpflow_api.prepare(config)

    return ctx.cached(f"mixed-prepared:{rows}", build)


def train_arrays(ctx: Context, rows: int):
    """The train split's rows as (float32 features, int64 labels) tensors."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    def build():
        dataset = prepared_dir(ctx, rows)
        manifest = ddpflow_api.manifest(dataset)
        files, features, label = manifest.split_files(dataset, "train"), manifest.features, manifest.label
        table = pq.read_table(files, columns=[*features, label])
        x = np.empty((table.num_rows, len(features)), dtype=np.float32)
        for i, name in enumerate(features):
            x[:, i] = table.column(name).to_numpy()
        y = table.column(label).to_numpy().astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)

    return ctx.cached(f"train-arrays:{rows}", build)


# --------------------------------------------------------------------------- model and loop


def build_model_and_optimizer(
    n_features: int = FEATURES, n_outputs: int = CLASSES, seed: int = 0, device: str | None = None
):
    import torch

    torch.manual_seed(seed)
    model = ddpflow_api.mlp(n_features, n_outputs, HIDDEN).to(device or "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, optimizer


def build_input_model_and_optimizer(dataset: Path, seed: int = 0):
    """The built-in mlp for the dataset's inputs (embeddings for its categoricals), HIDDEN wide, and AdamW."""
    import torch

    torch.manual_seed(seed)
    model = ddpflow_api.model_for(dataset, "mlp", {"hidden": list(HIDDEN)})
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def write_model(dataset: Path, path: Path) -> Path:
    """A model.pt of the workload's MLP for ``dataset``, as training writes it, with untrained weights (they do
    not change how fast it evaluates)."""
    manifest = ddpflow_api.manifest(dataset)
    model, _ = build_model_and_optimizer(manifest.n_features, manifest.n_outputs)
    return ddpflow_api.write_model_file(dataset, path, model, HIDDEN)


def train_step(model, optimizer, loss_fn, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    optimizer.step()


def timed_steps(model, optimizer, batches: Iterator, steps: int, warmup: int) -> tuple[int, float]:
    """Run ``warmup`` then ``steps`` steps from ``batches``; (samples, seconds) of the timed part.

    The loader's own work (fetching, collating) is inside the timed part: that is
    the cost being compared.
    """
    import time

    from torch import nn

    loss_fn = nn.CrossEntropyLoss()
    for _ in range(warmup):
        x, y = next(batches)
        train_step(model, optimizer, loss_fn, x, y)
    samples = 0
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        train_step(model, optimizer, loss_fn, x, y)
        samples += len(y)
    return samples, time.perf_counter() - start


def set_threads(threads: int) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def cycle(make: Callable[[], Iterator]) -> Iterator:
    """Endless batches: a fresh epoch each time one runs out."""
    while True:
        yield from make()
