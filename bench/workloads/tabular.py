"""The shared workload: sizes, data on disk, the model, and a training loop.

Default workload: synthetic classification, 1M rows x 32 float32 features,
10 classes, MLP 32-256-256-10, AdamW, batch 512 per rank, one torch thread per
rank (two ranks on two cores). Everything a benchmark writes lives under the
run's temporary directory and is built at most once per run (``Context.cache``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

FEATURES = 32
CLASSES = 10
HIDDEN = (256, 256)
BATCH = 512
LR = 1e-3
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Sizes:
    rows: int = 1_000_000
    repeats: int = 3
    # in-process training measurements: timed steps after warm-up steps
    steps: int = 400
    warmup: int = 20
    # torchrun measurements (per launch)
    ddp_steps: int = 800  # ~6 s per launch: short windows let one burst of host noise decide a repeat
    ddp_warmup: int = 30
    naive_steps: int = 15
    grad_accum: int = 4
    grad_accum_more: int = (
        8  # the headline: the accumulation this machine needs to hide its all-reduce (docs/benchmarks.md)
    )
    ddp_configs: tuple[str, ...] = (
        "one",
        "plain",
        "affinity",
        "bucket",
        "defaults",
        "poll",
        "alone",
        "accum",
        "accum_more",
        "naive",
    )
    ddp_repeats: int = 3
    memory_repeats: int = 2
    # rows for the memory and scale families
    prepare_memory_rows: tuple[int, int] = (1_000_000, 4_000_000)  # 1x and 4x the workload
    # 1x and 4x for a rank's anon memory with an image column: prepare checks and profiles every image
    # (about 1-2 ms each on 2 cores), so far fewer rows than the numeric 1x/4x
    image_anon_rows: tuple[int, int] = (25_000, 100_000)
    scale_rows: tuple[int, ...] = (250_000, 1_000_000, 4_000_000)
    orchestration_rows: int = 20_000
    orchestration_repeats: int = 2

    def with_rows(self, rows: int) -> Sizes:
        """The same run on another dataset size; the 1x/4x and scale sizes follow."""
        return replace(self, rows=rows, prepare_memory_rows=(rows, rows * 4), scale_rows=(rows // 4, rows, rows * 4))


FULL = Sizes()
QUICK = Sizes(
    rows=20_000,
    repeats=2,
    steps=20,
    warmup=3,
    ddp_steps=20,
    ddp_warmup=3,
    naive_steps=5,
    grad_accum=2,
    ddp_configs=("one", "plain", "defaults"),  # proves both rank set-ups and the headline, measures nothing
    ddp_repeats=1,
    memory_repeats=1,
    prepare_memory_rows=(5_000, 20_000),
    image_anon_rows=(200, 800),
    scale_rows=(5_000, 20_000),
    orchestration_rows=2_000,
    orchestration_repeats=1,
)


@dataclass
class Context:
    sizes: Sizes
    quick: bool
    gpu: bool
    workdir: Path
    threads: int = 1
    cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, *, quick: bool, gpu: bool, workdir: str | None = None) -> Context:
        root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ddpflow-bench-"))
        root.mkdir(parents=True, exist_ok=True)
        return cls(sizes=QUICK if quick else FULL, quick=quick, gpu=gpu, workdir=root)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


# --------------------------------------------------------------------------- data


def synthetic_url(rows: int, seed: int = 0) -> str:
    return f"synthetic://classification?rows={rows}&features={FEATURES}&classes={CLASSES}&seed={seed}"


def raw_bytes(rows: int) -> int:
    """The data as plain arrays: float32 features + int64 label."""
    return rows * (FEATURES * 4 + 8)


def source_file(ctx: Context, rows: int) -> Path:
    """A Parquet source (plain encoding, the synthetic generator's), written once per run."""
    from training.data.synthetic import write_synthetic

    def build() -> Path:
        return write_synthetic(synthetic_url(rows), ctx.workdir / "source" / f"rows-{rows}.parquet")

    return ctx.cached(f"source:{rows}", build)


def data_config(ctx: Context, source: str | Path, root: str | Path | None = None, **overrides: Any):
    from training.config import DataConfig

    return DataConfig(source=str(source), label="label", root=str(root or ctx.workdir / "shards"), **overrides)


def prepared_dir(ctx: Context, rows: int) -> Path:
    """ddpflow's prepared dataset (manifest + shards) for ``rows`` rows, prepared once per run."""
    from bench.ddpflow_api import prepare

    return ctx.cached(f"prepared:{rows}", lambda: prepare(data_config(ctx, source_file(ctx, rows))))


# The mixed table (issue 21's data path): the workload's numeric columns plus these categoricals, each drawn
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
    from bench.ddpflow_api import prepare

    inputs = {**{f"f{i}": "numeric" for i in range(FEATURES)}, **dict.fromkeys(CATEGORICALS, "categorical")}

    def build() -> Path:
        config = data_config(ctx, mixed_source_file(ctx, rows), ctx.workdir / "mixed-shards", inputs=inputs)
        return prepare(config)

    return ctx.cached(f"mixed-prepared:{rows}", build)


def train_arrays(ctx: Context, rows: int):
    """The train split's rows as (float32 features, int64 labels) tensors."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from training.data.manifest import read_manifest

    def build():
        dataset = prepared_dir(ctx, rows)
        manifest = read_manifest(dataset)
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

    from training.models import ModelSpec, build_model

    torch.manual_seed(seed)
    model = build_model(ModelSpec("mlp", n_features, n_outputs, {"hidden": list(HIDDEN)})).to(device or "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, optimizer


def build_input_model_and_optimizer(dataset: Path, seed: int = 0):
    """The built-in mlp for the dataset's inputs (embeddings for its categoricals), HIDDEN wide, and AdamW."""
    import torch

    from training.data.manifest import read_manifest
    from training.models import ModelSpec, build_model
    from training.spec.inputs import inputs_from_manifest

    manifest = read_manifest(dataset)
    torch.manual_seed(seed)
    spec = ModelSpec.for_inputs("mlp", inputs_from_manifest(manifest), manifest.n_outputs, {"hidden": list(HIDDEN)})
    model = build_model(spec)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


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
