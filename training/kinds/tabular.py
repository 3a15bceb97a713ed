"""The tabular kinds: numeric, categorical, hashed and vector columns (one ``Codec`` each; what each kind
guarantees: ``registry.py``'s docstring and docs/data.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.core.errors import DataError
from training.kinds.arrow_types import is_category, is_hashable, is_number, is_vector
from training.kinds.base import CATEGORY, DENSE, EMBEDDING, NUMBER, SCALAR, Codec, plain
from training.kinds.hashing import hash_values
from training.kinds.inputs import InputInfo
from training.kinds.stats import RunningHistogram, RunningMoments, merge_frequencies, merge_histograms, top_counts

NULL_INDEX, UNKNOWN_INDEX = 0, 1  # categorical; hashed uses 0 for null only


# A categorical column with more distinct train values than this share of its rows looks like an id.
ID_LIKE_SHARE = 0.9


ID_LIKE_MIN_ROWS = 50  # below this many rows the share says nothing


MISSING_POLICIES = ("impute", "error")  # {kind: numeric, missing: ...}; impute is the default
SCALINGS = ("robust", "standard")  # {kind: numeric, scaling: ...}; robust is the default
# The numeric embeddings' bins per numeric input: the train split's quantiles at 0, 1/48, ..., 1 (fewer where
# values repeat), as Gorishniy et al. (NeurIPS 2022) compute them for piecewise-linear encoding.
QUANTILE_BINS = 48


def quantile_edges(present: np.ndarray) -> list[float]:
    """The numeric embeddings' bin edges of a train column's sorted present values (raw units, increasing): its
    quantiles at 0, 1/QUANTILE_BINS, ..., 1, each a train value, repeats merged. What a numeric input's and a
    datetime input's time since the start are binned by."""
    quantiles = np.quantile(present, np.linspace(0.0, 1.0, QUANTILE_BINS + 1), method="lower")
    return [float(edge) for edge in np.unique(quantiles)]


class NumericCodec(Codec):
    """A number per row, float32. Nulls are values: by default (``missing: impute``) a null or NaN is replaced by
    the train split's center of the input (the median; the mean under ``scaling: standard``), and an input whose
    train split held any gets a 0/1 missing indicator, a column of the numeric block
    (``InputInfo.missing_indicator``), as boosting learns a direction for missing values. ``missing: error``
    makes a null invalid, as every non-finite value is (``data.on_invalid``): inf is never a missing value.

    Scaling (training/kinds/normalisation.py applies it): ``robust`` (the default) centres on the median,
    divides by the interquartile range (half the range where the quartiles coincide, 1 for a constant) and
    clips smoothly into (-3, 3), as RealMLP does, so heavy-tailed amounts keep their bulk apart;
    ``standard``: the mean and std, unclipped. The bins of the numeric embeddings are the train quantiles
    (``QUANTILE_BINS``), handed to the model normalised (``InputInfo.bins``). Everything is fitted on the train
    split only: its null counts batch by batch (``observe``), its quantiles from the whole train column once
    (``fit_train_column``: exact, so the same for any shard layout), all in encoders.json."""

    reads_train_column = True

    kind = "numeric"
    option_names = ("missing", "scaling")
    model_block = SCALAR
    reference_column = NUMBER
    needs_state = False  # a dataset before PREPARE_VERSION 5 stored none: NaN stays NaN
    takes = staticmethod(is_number)
    takes_what = "a number (integer, float, decimal, bool)"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, options)
        if self.options.get("missing", "impute") not in MISSING_POLICIES:
            raise ValueError(f"numeric input {name!r}: missing must be one of {MISSING_POLICIES}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"numeric input {name!r}: scaling must be one of {SCALINGS}")
        self.rows, self.nulls, self._sum = 0, 0, 0.0
        self.impute: float | None = None  # None: not fitted (before PREPARE_VERSION 5): nulls stay NaN
        self.indicator = False
        # From the whole train column (fit_train_column); None: a dataset before PREPARE_VERSION 6.
        self.center: float | None = None
        self.scale, self.clip = 1.0, False
        self.edges: list[float] = []  # the train quantiles, raw values, increasing: the embeddings' bins

    @property
    def scaling(self) -> str:
        return self.options.get("scaling", "robust")

    @property
    def imputes(self) -> bool:
        return self.options.get("missing", "impute") == "impute"

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.float32()

    def raw(self, array: pa.Array) -> np.ndarray:
        """float32; null -> NaN, beyond float32 -> inf (what the shard stores, nulls as nulls)."""
        array = plain(array)
        if not pa.types.is_floating(array.type) or array.null_count:
            array = pc.fill_null(pc.cast(array, pa.float64()), np.nan)
        with np.errstate(over="ignore", invalid="ignore"):
            return array.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)

    def encode(self, array: pa.Array) -> np.ndarray:
        """float32; a null or NaN is the fitted imputed value (NaN when the input takes none), inf stays inf."""
        values = self.raw(array)
        if self.imputes and self.impute is not None:
            missing = np.isnan(values)
            if missing.any():
                values = np.where(missing, np.float32(self.impute), values)
        return values

    def missing(self, array: pa.Array) -> np.ndarray:
        """The missing indicator: float32 1 where the row's value is null or NaN, else 0."""
        return np.isnan(self.raw(array)).astype(np.float32)

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        values = self.raw(array)
        return ~np.isinf(values) if self.imputes else np.isfinite(values)

    def observe(self, array: pa.Array) -> None:
        """Train rows: how many, how many null or NaN, the sum of the others (their mean is the imputed value under
        ``scaling: standard``; under ``robust`` it is the median, ``fit_train_column``)."""
        values = self.raw(array)
        present = values[~np.isnan(values)]
        self.rows += len(values)
        self.nulls += len(values) - len(present)
        self._sum += float(present.sum(dtype=np.float64))

    def fit_train_column(self, array: pa.Array) -> None:
        """The train split's whole column (its shards, read back by prepare): the scaling's statistics and the
        bins, from its sorted present values, so neither the row order nor the shard layout can change them."""
        values = self.raw(array)
        present = np.sort(values[~np.isnan(values)]).astype(np.float64)
        if not len(present):  # every train value missing: imputed as 0, a constant
            self.center, self.scale, self.clip, self.edges = 0.0, 1.0, False, []
            return
        if self.scaling == "standard":
            self.center, self.scale, self.clip = float(present.mean()), float(present.std()), False
        else:
            low, self.center, high = (float(q) for q in np.quantile(present, [0.25, 0.5, 0.75]))
            self.scale, self.clip = high - low, True
            if not self.scale > 0:
                self.scale = (float(present[-1]) - float(present[0])) / 2
        if not self.scale > 0:
            self.scale = 1.0
        self.edges = quantile_edges(present)

    def fit(self) -> dict[str, Any]:
        if self.rows:
            present = self.rows - self.nulls
            self.impute = self._sum / present if present else 0.0
            if self.center is not None and self.scaling == "robust":
                self.impute = self.center  # the median: an imputed value is 0 once scaled, as under standard
            self.indicator = self.imputes and self.nulls > 0
        if self.impute is None:
            return {}
        state = {"impute": self.impute, "indicator": self.indicator, "rows": self.rows, "nulls": self.nulls}
        if self.center is not None:
            state |= {"center": self.center, "scale": self.scale, "clip": self.clip, "edges": self.edges}
        return state

    def load(self, state: dict[str, Any]) -> None:
        if "impute" in state:
            self.impute, self.indicator = float(state["impute"]), bool(state["indicator"])
            self.rows, self.nulls = int(state["rows"]), int(state["nulls"])
        if "center" in state:
            self.center, self.scale, self.clip = float(state["center"]), float(state["scale"]), bool(state["clip"])
            self.edges = [float(edge) for edge in state["edges"]]

    def scaled_edges(self) -> tuple[float, ...] | None:
        """The bins' edges as the model sees its input (scaled and clipped by the one arithmetic,
        ``normalisation.scale_columns_``, in float32), strictly increasing; None before PREPARE_VERSION 6."""
        if self.center is None:
            return None
        import torch

        from training.kinds.normalisation import scale_columns_

        edges = torch.tensor(self.edges, dtype=torch.float32).reshape(-1, 1)
        one = (torch.tensor([value], dtype=torch.float32) for value in (self.center, self.scale))
        scaled = scale_columns_(edges, *one, torch.tensor([self.clip]))
        return tuple(float(edge) for edge in np.unique(scaled.numpy()))  # edges the clip merged: one

    def null_rate(self) -> float:
        """The train split's share of null or NaN values (0 before it is observed)."""
        return self.nulls / self.rows if self.rows else 0.0

    def info(self) -> InputInfo:
        return replace(super().info(), missing_indicator=self.indicator, bins=self.scaled_edges())

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """The rows' running moments and dyadic histogram (nulls and NaN as missing), as prepare keeps a numeric
        feature's: float32, as the shards store it."""
        values = self.raw(array)[None, :]
        moments, histogram = RunningMoments(1), RunningHistogram(1)
        moments.update(values)
        histogram.update(values)
        return {"kind": self.kind, "moments": moments.to_dict(), "histogram": histogram.to_list()[0]}

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        moments = RunningMoments.from_dict(first["moments"]).merged(RunningMoments.from_dict(second["moments"]))
        histogram = merge_histograms(first["histogram"], second["histogram"])
        return {"kind": cls.kind, "moments": moments.to_dict(), "histogram": histogram}

    @classmethod
    def reported_drift_stats(cls, stats: dict[str, Any]) -> dict[str, Any]:
        """``{"kind", "mean", "std", "histogram"}``: a manifest's ``feature_mean``, ``feature_std`` and
        ``feature_histograms`` entries of the input."""
        moments = RunningMoments.from_dict(stats["moments"])
        return {"kind": cls.kind, "mean": float(moments.mean[0]), "std": float(moments.std()[0]),
                "histogram": stats["histogram"]}  # fmt: skip

    @classmethod
    def declared_any(cls, source_type: str | None, info: InputInfo) -> bool:
        """An integer input that imputes nulls: MLflow's ``long`` refuses every null (a float64 NaN, pandas'
        nullable Int64) and its ``double`` a plain int64 column; ``any`` takes the source's int64, float64 with
        NaN and Int64 frames, and ``encode`` reads them, refusing what is not a number."""
        return info.missing_indicator and pa.types.is_integer(source_dtype(source_type))

    @classmethod
    def serving_example(cls, values, source_type: str | None):
        """Numbers of the source's own type (``source_dtype``): the signature MLflow infers from them takes
        the source's frames and hand-built ones alike; the model casts inside (``encode``)."""
        array = pa.array(values.to_numpy(dtype="float64"), from_pandas=True)  # the shard's float32 values
        cast = pc.cast(array, source_dtype(source_type)).to_numpy(zero_copy_only=False)
        return type(values)(cast, index=values.index, name=values.name)


def source_dtype(arrow_type: str | None) -> pa.DataType:
    """What a numeric input is declared as, from its type in the source (``model.pt``'s ``source_types``):
    every integer int64 (MLflow ``long``: int8..int64 and uint8..uint32 frames pass, and pandas' default
    int64; a narrower declaration refuses a hand-built ``[3]``), bool bool (``boolean``), every float float64
    (``double``: float32 and float64 frames pass). float64 for a model.pt without source types, a decimal or any
    other type."""
    try:
        kind = pa.type_for_alias(arrow_type) if arrow_type else pa.float64()
    except ValueError:
        return pa.float64()
    if pa.types.is_integer(kind):
        return pa.int64()
    return pa.bool_() if pa.types.is_boolean(kind) else pa.float64()


DRIFT_TOP_CATEGORIES = 1000  # per categorical input: the most frequent values' train counts, the rest together
# A scoring's part keeps more of its values' counts, so that the merged parts' most frequent are exact.
SCORED_CATEGORIES = 4 * DRIFT_TOP_CATEGORIES


class CategoricalCodec(Codec):
    kind = "categorical"
    option_names = ("min_count", "max_size")
    model_block = EMBEDDING
    drift_measure = "frequencies"
    reference_column = CATEGORY
    dtype = "int64"
    takes = staticmethod(is_category)
    takes_what = "a string, integer or bool"

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, {"min_count": 1, **(options or {})})
        self._counts: list[pa.Table] = []
        self.observed_rows = 0
        self.vocabulary: pa.Array | None = None

    @classmethod
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        given = super().options_from(given)
        return {
            "min_count": given.get("min_count") or 1,
            **({"max_size": given["max_size"]} if given.get("max_size") else {}),
        }

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return plain(pa.array([], type=source_type)).type

    def observe(self, array: pa.Array) -> None:
        array = plain(array)
        self.observed_rows += len(array) - array.null_count
        counts = pc.value_counts(array.drop_null()).flatten()
        self._counts.append(pa.table({"value": counts[0], "count": counts[1]}))
        if len(self._counts) > 32:  # keep the pending tables few however many batches
            self._counts = [self._merged()]

    def _merged(self) -> pa.Table:
        if not self._counts:
            return pa.table({"value": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
        table = pa.concat_tables(self._counts)
        return table.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])

    def fit(self) -> dict[str, Any]:
        counts = self._merged()
        if self.observed_rows >= ID_LIKE_MIN_ROWS and counts.num_rows > ID_LIKE_SHARE * self.observed_rows:
            raise DataError(
                f"categorical input {self.name!r}: {counts.num_rows} distinct values in {self.observed_rows} "
                "train rows; "
                f"it looks like an id: use {{kind: hashed, buckets: N}} for data.inputs.{self.name}"
            )
        ordered = counts.sort_by([("count", "descending"), ("value", "ascending")])
        ordered = ordered.filter(pc.greater_equal(ordered["count"], self.options["min_count"]))
        if self.options.get("max_size"):
            ordered = ordered.slice(0, self.options["max_size"])
        self.vocabulary = ordered["value"].combine_chunks()
        return {
            "value_type": str(self.vocabulary.type),
            "values": self.vocabulary.to_pylist(),
            "counts": ordered["count"].to_pylist(),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.vocabulary = pa.array(state["values"], type=_arrow_type(state["value_type"]))

    def cardinality(self) -> int:
        return len(self.vocabulary) + 2  # + null + unknown

    def drift_stats(self) -> dict[str, Any] | None:
        """The train counts of the most frequent values (``DRIFT_TOP_CATEGORIES``), the rest together."""
        if self.vocabulary is None:
            return None
        state = self.fit()
        top = DRIFT_TOP_CATEGORIES
        return {
            "kind": "categorical",
            "counts": dict(zip(map(str, state["values"][:top]), state["counts"][:top])),
            "other": int(sum(state["counts"][top:])) + int(self.observed_rows - sum(state["counts"])),
        }

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """Each value's count (nulls left out, as prepare leaves them out of the train counts), by its text."""
        counts = pc.value_counts(plain(array).drop_null()).flatten()
        values = dict(zip(map(str, counts[0].to_pylist()), counts[1].to_pylist(), strict=True))
        kept, rest = top_counts(values, SCORED_CATEGORIES)
        return {"kind": self.kind, "counts": kept, "other": rest}

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        return merge_frequencies(first, second, SCORED_CATEGORIES)

    @classmethod
    def reported_drift_stats(cls, stats: dict[str, Any]) -> dict[str, Any]:
        """The ``DRIFT_TOP_CATEGORIES`` most frequent values and the rest as ``other``, as ``drift_stats`` (which
        also counts a train value rarer than ``min_count`` as other)."""
        return merge_frequencies(stats, {"counts": {}, "other": 0}, DRIFT_TOP_CATEGORIES)

    def encode(self, array: pa.Array) -> np.ndarray:
        array = plain(array)
        if array.type != self.vocabulary.type:
            try:
                array = pc.cast(array, self.vocabulary.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise ValueError(
                    f"input column {self.name!r} holds {array.type} values; its vocabulary holds "
                    f"{self.vocabulary.type} ({error})"
                ) from None
        found = pc.index_in(array, value_set=self.vocabulary)
        index = pc.fill_null(pc.add(found, 2), UNKNOWN_INDEX).to_numpy(zero_copy_only=False).astype(np.int64)
        index[pc.is_null(array).to_numpy(zero_copy_only=False)] = NULL_INDEX
        return index


class HashedCodec(Codec):
    kind = "hashed"
    option_names = ("buckets",)
    model_block = EMBEDDING
    reference_column = CATEGORY
    dtype = "int64"
    takes = staticmethod(is_hashable)
    takes_what = "a string, integer or binary"

    @classmethod
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        given = super().options_from(given)
        if given.get("buckets") is None:
            raise ValueError("kind 'hashed' needs buckets (e.g. {kind: hashed, buckets: 1000003})")
        return {"buckets": int(given["buckets"])}

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return plain(pa.array([], type=source_type)).type

    def cardinality(self) -> int:
        return int(self.options["buckets"]) + 1  # + null

    def encode(self, array: pa.Array) -> np.ndarray:
        array = plain(array)
        nulls = pc.is_null(array).to_numpy(zero_copy_only=False)
        if nulls.any():
            filler = "" if pa.types.is_string(array.type) or pa.types.is_binary(array.type) else 0
            array = pc.fill_null(array, pa.scalar(filler, type=array.type))
        buckets = np.uint64(self.options["buckets"])
        index = (hash_values(array) % buckets).astype(np.int64) + 1
        index[nulls] = NULL_INDEX
        return index


class VectorCodec(Codec):
    kind = "vector"
    model_block = DENSE
    drift_measure = "dimension_means"
    hashes_encoded = True  # the split hashes a row's float values
    takes = staticmethod(is_vector)
    takes_what = "a list of numbers (list<float> or fixed_size_list<float>)"
    drift_reads_rows = True  # per-dimension mean and std of the train rows

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, options)
        self.dim: int | None = None
        self._moments: RunningMoments | None = None

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.list_(pa.float32())

    def _lengths(self, array: pa.Array) -> np.ndarray:
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            array = pc.cast(array, pa.list_(pa.float32())) if pa.types.is_fixed_size_list(array.type) else array
        if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
            raise ValueError(f"vector input {self.name!r} has type {array.type}; a vector is a list of numbers")
        return pc.fill_null(pc.list_value_length(array), -1).to_numpy(zero_copy_only=False)

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        """Non-null rows of the first row's length, every element finite; the length is learnt here."""
        lengths = self._lengths(array)
        if self.dim is None and (lengths >= 0).any():
            self.dim = int(lengths[lengths >= 0][0])
            if self.dim == 0:
                raise DataError(f"{where}: vector column {self.name!r}: its first row is empty")
        ok = lengths == self.dim
        if ok.any():
            values = pc.list_flatten(pc.filter(_as_list(array), pa.array(ok)))
            finite = np.isfinite(NumericCodec(self.name).raw(values)).reshape(-1, self.dim).all(axis=1)
            ok[np.flatnonzero(ok)[~finite]] = False
        return ok

    def invalid_error(self, where: str, array: pa.Array, ok: np.ndarray) -> DataError | None:
        """The error for a read batch with invalid rows: the wrong lengths it holds, or null/non-finite rows."""
        if ok.all():
            return None
        lengths = self.bad_lengths(array)
        what = f"rows of length {lengths}" if lengths else "null rows or non-finite elements"
        return DataError(
            f"{where}: vector column {self.name!r} has {int((~ok).sum())} {what} in one read batch; every row must "
            f"have length {self.dim} (its first row's) and finite values: fix the data or set data.on_invalid=drop"
        )

    @classmethod
    def serving_example(cls, values, source_type: str | None):
        """Each row a list of Python floats (a list<double> column of the signature)."""
        return [list(map(float, row)) for row in values]

    def bad_lengths(self, array: pa.Array) -> list[int]:
        """The row lengths other than ``dim`` in ``array`` (null rows excluded), distinct, sorted."""
        lengths = self._lengths(array)
        return sorted({int(n) for n in lengths if n >= 0 and n != self.dim})

    def fit(self) -> dict[str, Any]:
        return {"dim": self.dim}

    def load(self, state: dict[str, Any]) -> None:
        self.dim = int(state["dim"])

    def shape(self) -> tuple[int, ...]:
        return (int(self.dim),)

    def encode(self, array: pa.Array) -> np.ndarray:
        array = _as_list(plain(array))
        lengths = self._lengths(array)
        wrong = np.flatnonzero(lengths != self.dim)
        if len(wrong):
            raise ValueError(
                f"vector input {self.name!r}: row {int(wrong[0])} has length {int(lengths[wrong[0]])} "
                f"(null: -1); the model takes vectors of length {self.dim}"
            )
        values = NumericCodec(self.name).raw(pc.list_flatten(array))
        return values.reshape(len(array), self.dim)

    def drift_update(self, array: pa.Array) -> None:
        if self._moments is None:
            self._moments = RunningMoments(self.dim)
        self._moments.update(self.encode(array).T)

    def drift_stats(self) -> dict[str, Any] | None:
        if self._moments is None:
            return None
        return {"kind": "vector", "mean": self._moments.mean.tolist(), "std": self._moments.std().tolist()}

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """Each dimension's running moments (as ``drift_update`` keeps them for the train rows)."""
        moments = RunningMoments(self.dim)
        moments.update(self.encode(array).T)
        return {"kind": self.kind, "moments": moments.to_dict()}

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        merged = RunningMoments.from_dict(first["moments"]).merged(RunningMoments.from_dict(second["moments"]))
        return {"kind": cls.kind, "moments": merged.to_dict()}

    @classmethod
    def reported_drift_stats(cls, stats: dict[str, Any]) -> dict[str, Any]:
        moments = RunningMoments.from_dict(stats["moments"])
        return {"kind": cls.kind, "mean": moments.mean.tolist(), "std": moments.std().tolist()}


def _as_list(array: pa.Array) -> pa.Array:
    if pa.types.is_fixed_size_list(array.type):
        return pc.cast(array, pa.list_(array.type.value_type))
    return array


def _arrow_type(name: str) -> pa.DataType:
    return pa.string() if name in ("string", "large_string", "string_view") else pa.type_for_alias(name)
