"""The manifest: the prepared dataset's table of contents, written last.

``manifest.json`` sits at ``<data.root>/<fingerprint>/manifest.json``. Its
presence is what marks a prepared dataset complete: prepare writes it last and
atomically, so a crash mid-way never leaves a directory that looks done.

Shard files hold the validated raw inputs: numeric ones as float32 (``features``
are the numeric inputs, in input order), categorical and hashed ones as their
plain values (strings stay strings), vectors as list<float32>; the label column
under its own name (int64 class index for classification, float32 for
regression), the key column when ``data.key`` is set and the weight column
(float32) when ``data.weight`` is. ``inputs`` lists every input's kind, dtype,
shape and cardinality (training/kinds/inputs.py); the encoders fitted on the
train split are in ``encoders.json`` beside the manifest, its sha256 in
``encoders`` (so whatever hashes the manifest covers them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.core.fileio import atomic_write_json
from training.core.layout import MANIFEST, SPLITS
from training.core.location import is_url, join, read_text

FORMAT_VERSION = 1
CLASS_TASKS = ("classification", "multilabel")  # tasks whose label_mapping lists the classes


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the dataset directory, e.g. "train/part-00000.parquet"
    rows: int
    bytes: int


@dataclass(frozen=True)
class SplitInfo:
    rows: int
    shards: list[ShardInfo]


@dataclass(frozen=True)
class Manifest:
    fingerprint: str
    source: str
    task: str  # "classification" | "regression" | "multilabel" (label: list<int64> class indices in the shards)
    label: str
    key: str | None
    features: list[str]
    # Class index -> original label value (as it appeared in the source); None for regression.
    label_mapping: list[Any] | None
    # The train split's non-null values, per feature, then 0 (mean) and 1 (std) per missing indicator (n_features).
    feature_mean: list[float]
    feature_std: list[float]  # 0 replaced by 1
    splits: dict[str, SplitInfo]
    schema: list[dict[str, str]]  # the source columns used: [{"name": ..., "type": ...}]
    config: dict[str, Any]  # the data config that produced it
    created_at: str
    versions: dict[str, str]
    dropped_rows: int = 0
    # Regression: the train split's target mean and population std (0 -> 1); training standardises the
    # target with them (training/kinds/normalisation.py). None for classification and before PREPARE_VERSION 2.
    label_mean: float | None = None
    label_std: float | None = None
    # The train split's counts per feature on a dyadic grid (training/kinds/stats.py: RunningHistogram), in
    # ``features`` order: what data drift is measured with (ddpflow/drift/report.py). None before PREPARE_VERSION 3.
    feature_histograms: list[dict[str, Any]] | None = None
    # Classification: the train split's rows per class, in ``label_mapping`` order (prepare's
    # training/kinds/stats.py: ClassCounts); what train.class_weights: balanced divides by. None: not counted.
    train_class_counts: list[int] | None = None
    # Every input, in order: InputInfo.to_dict() (training/kinds/inputs.py). None before PREPARE_VERSION 4:
    # the features, all numeric.
    inputs: list[dict[str, Any]] | None = None
    encoders: dict[str, str] | None = None  # {"file": "encoders.json", "sha256": ...}; None: no encoders
    weight: str | None = None  # the row-weight column (data.weight), float32 in the shards
    # How the numeric block is scaled (training/kinds/normalisation.py), per column of ``n_features``: center,
    # scale (robust: median and interquartile range; standard: mean and std) and whether it is smoothly clipped;
    # 0, 1, false per missing indicator. None before PREPARE_VERSION 6: feature_mean/feature_std, unclipped.
    feature_center: list[float] | None = None
    feature_scale: list[float] | None = None
    feature_clip: list[bool] | None = None
    format_version: int = FORMAT_VERSION
    # Also: "left_out" (columns the default inputs left out, with the entry that would include each),
    # "warnings" (what prepare warns about, e.g. integers beyond float32's exact range).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        """The numeric block's width: the numeric inputs, then a missing indicator per numeric input whose train
        split held nulls (training/kinds/inputs.py: ``block_names``); ``feature_mean`` is as long."""
        return len(self.features) + sum(bool(entry.get("missing_indicator")) for entry in self.inputs or [])

    @property
    def n_classes(self) -> int | None:
        """How many classes the label has (classification, multilabel); None for a value (regression)."""
        return len(self.label_mapping) if self.task in CLASS_TASKS else None

    @property
    def n_outputs(self) -> int:
        return len(self.label_mapping) if self.task in CLASS_TASKS else 1

    def input_names(self) -> list[str]:
        return [entry["name"] for entry in self.inputs] if self.inputs else list(self.features)

    def split_files(self, dataset_dir: str | Path, split: str) -> list[Path]:
        return [Path(dataset_dir) / shard.file for shard in self.splits[split].shards]

    def shard_locations(self, dataset_dir: str | Path, split: str) -> list[str]:
        """The split's shards where the dataset lives: local paths, or URLs (training/core/location.py)."""
        return [join(dataset_dir, shard.file) for shard in self.splits[split].shards]

    def rows(self, split: str) -> int:
        return self.splits[split].rows

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        raw = dict(raw)
        raw["splits"] = {
            name: SplitInfo(rows=split["rows"], shards=[ShardInfo(**shard) for shard in split["shards"]])
            for name, split in raw["splits"].items()
        }
        return cls(**raw)


def write_manifest(dataset_dir: str | Path, manifest: Manifest) -> Path:
    """Atomic (training/core/fileio.py): its presence means the dataset is complete."""
    return atomic_write_json(Path(dataset_dir) / MANIFEST, manifest.to_dict())


def read_manifest(path: str | Path) -> Manifest:
    """Accepts the manifest file or its dataset directory, local or a URL (``s3://bucket/shards/<fingerprint>``)."""
    if is_url(path):
        path = path if str(path).endswith(MANIFEST) else join(path, MANIFEST)
    else:
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST
    try:
        raw = json.loads(read_text(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no manifest at {path}: the dataset was never prepared, or preparing it did not finish"
        ) from None
    manifest = Manifest.from_dict(raw)
    missing = [split for split in SPLITS if split not in manifest.splits]
    if missing:
        raise ValueError(f"{path}: manifest lacks splits {missing}")
    return manifest
