"""Deterministic synthetic tables: ``synthetic://classification`` and ``synthetic://regression``.

    synthetic://classification?rows=N&features=F&classes=C&seed=S[&id=1]
    synthetic://regression?rows=N&features=F&seed=S[&id=1]

Columns: ``id`` (int64 row number, only with ``id=1``), ``f0..f{F-1}``
(float32) and ``label`` (int64 class for classification, float32 for
regression). The same spec always yields the same rows, chunk by chunk, so
memory stays bounded however many rows are asked for, and rows ``[0, N)`` of a
bigger spec are exactly the rows of the smaller one (appending rows keeps the
old ones).

Both tasks are learnable: a random linear teacher on standard-normal latents
gives the label (argmax of its noisy logits for classification, its output
plus noise for regression). Each feature is the latent shifted and scaled by
its own constants so that normalising the features matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import pyarrow as pa

SCHEME = "synthetic"
# Bump whenever the same spec would generate different rows: it is part of the fingerprint.
GENERATOR_VERSION = 2
# Rows per generated chunk. Fixed (not the reader's batch size) so the rows
# depend only on the spec.
CHUNK_ROWS = 65_536
_TASKS = ("classification", "regression")
_LIMITS = {"rows": (1, 10**12), "features": (1, 100_000), "classes": (2, 100_000), "seed": (0, 2**63 - 1), "id": (0, 1)}


class SyntheticSpecError(ValueError):
    """The synthetic:// URL is malformed; the message names the parameter."""


@dataclass(frozen=True)
class SyntheticSpec:
    task: str
    rows: int
    features: int
    classes: int = 2
    seed: int = 0
    id: int = 0

    @property
    def url(self) -> str:
        """Canonical URL: the same spec always prints the same way."""
        query = f"rows={self.rows}&features={self.features}"
        if self.task == "classification":
            query += f"&classes={self.classes}"
        query += f"&seed={self.seed}"
        if self.id:
            query += "&id=1"
        return f"{SCHEME}://{self.task}?{query}"

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def schema(self) -> pa.Schema:
        fields = [pa.field("id", pa.int64())] if self.id else []
        fields += [pa.field(f"f{i}", pa.float32()) for i in range(self.features)]
        label_type = pa.int64() if self.task == "classification" else pa.float32()
        return pa.schema(fields + [pa.field("label", label_type)])


def is_synthetic(source: str) -> bool:
    return source.startswith(f"{SCHEME}://")


def parse_spec(url: str) -> SyntheticSpec:
    parts = urlsplit(url)
    task = parts.netloc or parts.path.lstrip("/")
    if parts.scheme != SCHEME or task not in _TASKS:
        raise SyntheticSpecError(f"{url!r}: expected synthetic://classification?... or synthetic://regression?...")
    params: dict[str, int] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _LIMITS or (name == "classes" and task == "regression"):
            raise SyntheticSpecError(f"{url!r}: unknown parameter {name!r} (known: {', '.join(_LIMITS)})")
        try:
            number = int(value)
        except ValueError:
            raise SyntheticSpecError(f"{url!r}: parameter {name}={value!r} is not an integer") from None
        low, high = _LIMITS[name]
        if not low <= number <= high:
            raise SyntheticSpecError(f"{url!r}: parameter {name}={number} must be in [{low}, {high}]")
        params[name] = number
    for required in ("rows", "features"):
        if required not in params:
            raise SyntheticSpecError(f"{url!r}: parameter {required!r} is required")
    return SyntheticSpec(task=task, **params)


def _rng(spec: SyntheticSpec, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(spec.seed, spawn_key=stream))


def _teacher(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, feature offsets, feature scales), fixed by the seed."""
    rng = _rng(spec, 0)
    outputs = spec.classes if spec.task == "classification" else 1
    weights = rng.standard_normal((spec.features, outputs)) * (3.0 / np.sqrt(spec.features))
    offsets = rng.uniform(-5.0, 5.0, spec.features)
    scales = rng.uniform(0.5, 4.0, spec.features)
    return weights, offsets, scales


def iter_batches(spec: SyntheticSpec, batch_rows: int = CHUNK_ROWS) -> Iterator[pa.RecordBatch]:
    """The spec's rows in order, as record batches of at most ``batch_rows`` rows."""
    weights, offsets, scales = _teacher(spec)
    schema = spec.schema()
    for chunk, start in enumerate(range(0, spec.rows, CHUNK_ROWS)):
        batch = _chunk(spec, chunk, start, min(CHUNK_ROWS, spec.rows - start), weights, offsets, scales, schema)
        for offset in range(0, batch.num_rows, batch_rows):
            yield batch.slice(offset, batch_rows)


def _chunk(spec, chunk, start, rows, weights, offsets, scales, schema) -> pa.RecordBatch:
    # Separate streams for latents and noise, each drawn row-major: the first k rows of a
    # chunk do not depend on how many rows the chunk has, so a longer spec extends a shorter one.
    latent = _rng(spec, 1, chunk).standard_normal((rows, spec.features))
    noise = _rng(spec, 2, chunk)
    scores = latent @ weights
    if spec.task == "classification":
        # Gumbel noise on the logits: a softmax teacher, learnable but not trivially separable.
        label = np.argmax(scores + 0.3 * noise.gumbel(size=scores.shape), axis=1).astype(np.int64)
    else:
        label = (scores[:, 0] + 0.1 * noise.standard_normal(rows)).astype(np.float32)
    latent *= scales  # in place: the same float64 arithmetic as latent * scales + offsets, without temporaries
    latent += offsets
    features = latent.astype(np.float32)
    columns = [pa.array(np.arange(start, start + rows, dtype=np.int64))] if spec.id else []
    columns += [pa.array(features[:, i]) for i in range(spec.features)]
    return pa.RecordBatch.from_arrays(columns + [pa.array(label)], schema=schema)


def write_synthetic(url: str, path: str | Path, file_format: str | None = None) -> Path:
    """Write a synthetic spec to a Parquet or CSV file (format from the suffix unless given)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    spec = parse_spec(url)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    file_format = file_format or ("csv" if path.suffix == ".csv" else "parquet")
    schema = spec.schema()
    if file_format == "csv":
        with pacsv.CSVWriter(path, schema) as writer:
            for batch in iter_batches(spec):
                writer.write_batch(batch)
    else:
        with pq.ParquetWriter(path, schema, use_dictionary=False) as writer:
            for batch in iter_batches(spec):
                writer.write_batch(batch)
    return path
