"""Fixtures for evaluation, registry and task tests (tests/conftest.py imports them for every folder): tiny
prepared datasets and model.pt files.

The datasets are written straight from the manifest contract
(training/core/manifest.py) and the models straight from the model.pt
contract (docs/architecture.md), so these tests do not depend on the prepare
or training stages. Raw features have a large offset and scale, so a model
that skipped normalisation would score near chance. ``target_stats=True``
writes a regression target's train statistics into the manifest (as prepare
does), so models train on the standardised target; without it the manifest
looks like one before PREPARE_VERSION 2, without target statistics (raw scale).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.manifest import Manifest, ShardInfo, SplitInfo, read_manifest, write_manifest
from training.inference.model_file import inference_checkpoint
from training.kinds.normalisation import Normaliser
from training.models.registry import ModelSpec, build_model

CLASS_NAMES = ["cat", "dog", "eel", "fox", "gnu"]


def _write_split(
    dataset_dir: Path, split: str, x: np.ndarray, y: np.ndarray, features: list[str], label: str, shard_rows: int
) -> SplitInfo:
    (dataset_dir / split).mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, len(x), shard_rows)):
        columns = {name: pa.array(x[start : start + shard_rows, i], pa.float32()) for i, name in enumerate(features)}
        columns[label] = pa.array(y[start : start + shard_rows])
        relative = f"{split}/part-{number:05d}.parquet"
        pq.write_table(pa.table(columns), dataset_dir / relative, row_group_size=max(1, shard_rows // 3))
        rows = len(x[start : start + shard_rows])
        shards.append(ShardInfo(file=relative, rows=rows, bytes=(dataset_dir / relative).stat().st_size))
    return SplitInfo(rows=len(x), shards=shards)


def make_dataset(
    root: Path,
    task: str = "classification",
    rows: dict[str, int] | None = None,
    n_features: int = 6,
    n_classes: int = 4,
    seed: int = 0,
    shard_rows: int = 400,
    features: list[str] | None = None,
    fingerprint: str | None = None,
    label_offset: float = 10.0,
    target_stats: bool = False,
) -> Path:
    rows = rows or {"train": 1500, "val": 200, "test": 997}
    features = features or [f"f{i}" for i in range(n_features)]
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(1234).normal(size=(len(features), n_classes if task == "classification" else 1))
    fingerprint = fingerprint or f"{task[:3]}{seed}{len(features)}{n_classes}"
    dataset_dir = root / fingerprint
    splits, train_x, train_y = {}, None, None
    for split, count in rows.items():
        z = rng.normal(size=(count, len(features)))
        x = (z * 7.0 + 40.0).astype(np.float32)  # raw scale: far from the normalised one
        if task == "classification":
            y = (z @ teacher).argmax(axis=1).astype(np.int64)
        else:
            y = ((z @ teacher)[:, 0] * 3.0 + label_offset + rng.normal(scale=0.1, size=count)).astype(np.float32)
        splits[split] = _write_split(dataset_dir, split, x, y, features, "label", shard_rows)
        if split == "train":
            train_x, train_y = x, y.astype(np.float64)
    with_stats = target_stats and task == "regression"
    manifest = Manifest(
        fingerprint=fingerprint,
        source=f"synthetic://{task}?seed={seed}",
        task=task,
        label="label",
        key=None,
        features=features,
        label_mapping=CLASS_NAMES[:n_classes] if task == "classification" else None,
        feature_mean=[float(v) for v in train_x.mean(axis=0)],
        feature_std=[float(v) or 1.0 for v in train_x.std(axis=0)],
        splits=splits,
        schema=[{"name": name, "type": "float"} for name in features]
        + [{"name": "label", "type": "int64" if task == "classification" else "float"}],
        config={},
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
        versions={},
        label_mean=float(train_y.mean()) if with_stats else None,
        label_std=float(train_y.std()) if with_stats else None,
    )
    write_manifest(dataset_dir, manifest)
    return dataset_dir


def train_model_file(dataset_dir: Path, path: Path, steps: int = 60, seed: int = 0, lr: float = 0.05) -> Path:
    """A model.pt per the contract, after ``steps`` full-batch Adam steps on the train split (normalised
    features; a regression target standardised when the manifest has its statistics)."""
    manifest = read_manifest(dataset_dir)
    table = pa.concat_tables([pq.read_table(f) for f in manifest.split_files(dataset_dir, "train")])
    x = torch.from_numpy(np.column_stack([table[name].to_numpy() for name in manifest.features]).astype(np.float32))
    y = torch.from_numpy(table[manifest.label].to_numpy())
    normaliser = Normaliser.from_manifest(manifest)
    torch.manual_seed(seed)
    spec = ModelSpec(
        model="mlp", n_features=manifest.n_features, n_outputs=manifest.n_outputs, model_kwargs={"hidden": [32]}
    )
    model = build_model(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss() if manifest.task == "classification" else torch.nn.MSELoss()
    target = y.long() if manifest.task == "classification" else normaliser.target_(y.float()).unsqueeze(1)
    inputs = normaliser.features(x)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = inference_checkpoint(
        model.state_dict(), spec, manifest, epochs=1, metrics={"train_loss": float(loss.detach())}
    )
    torch.save(checkpoint, path)
    return path


def train_typed_model(dataset: Path, path: Path, steps: int = 150, lr: float = 0.05, hidden: int = 16) -> Path:
    """A model.pt as the trainer writes it (the built-in model on every input, through the loader's encoding
    and with the dataset's encoders), after full-batch Adam steps on the train split."""
    import torch

    from training.inference.model_file import inference_checkpoint
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.loading.batches import load_split
    from training.models.registry import ModelSpec, build_model

    manifest = read_manifest(dataset)
    split = load_split(dataset, manifest, "train")
    spec = ModelSpec.for_inputs("mlp", inputs_from_manifest(manifest), manifest.n_outputs, {"hidden": [hidden]})
    torch.manual_seed(0)
    model = build_model(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batch = split.rows(0, len(split))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch), split.labels)
        loss.backward()
        optimizer.step()
    encoders = read_encoders(dataset, manifest)
    metrics = {"train_loss": float(loss.detach())}
    checkpoint = inference_checkpoint(model.state_dict(), spec, manifest, 1, metrics, encoders)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def dataset_factory(tmp_path):
    def factory(**kwargs) -> Path:
        return make_dataset(tmp_path / "shards", **kwargs)

    return factory


@pytest.fixture
def model_factory(tmp_path):
    def factory(dataset_dir: Path, name: str = "model", **kwargs) -> Path:
        return train_model_file(dataset_dir, tmp_path / "runs" / name / "model.pt", **kwargs)

    return factory
