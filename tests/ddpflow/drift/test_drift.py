"""Drift's inputs and numbers: the per-feature histogram prepare keeps, the cheap source fingerprint the
watch uses, and the PSI / mean shift between two prepared datasets (ddpflow/drift/)."""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddpflow.drift.psi import PSI_EPSILON, DriftUnavailable, common_grid, histogram_psi, population_stability_index
from ddpflow.drift.report import compare
from training.core.errors import DataError
from training.core.manifest import read_manifest
from training.kinds.stats import HISTOGRAM_BINS, RunningHistogram
from training.prepare.dataset import fingerprint_from_listing, prepare_dataset
from training.prepare.sources import open_source


def streamed(values: np.ndarray, batch: int = 1000) -> dict:
    """One column streamed through a RunningHistogram in batches; its manifest entry."""
    histogram = RunningHistogram(1)
    for start in range(0, len(values), batch):
        histogram.update(np.asarray(values[start : start + batch])[None, :])
    return histogram.to_list()[0]


def grid_edges(entry: dict) -> np.ndarray:
    return (entry["offset"] + np.arange(len(entry["counts"]) + 1)) * 2.0 ** entry["exponent"]


# ---------------------------------------------------------------- the histogram prepare keeps


STREAMS = [
    np.random.default_rng(0).normal(0, 1, 20_000),
    # grows to the left and to the right batch after batch: a widening random walk
    np.cumsum(np.random.default_rng(1).normal(0, 1, 20_000)),
    np.random.default_rng(2).integers(0, 2, 20_000),  # a 0/1 flag
    1.7e9 + np.random.default_rng(3).normal(0, 1000, 20_000),  # far from zero, narrow
    np.r_[np.full(5_000, 3.5), np.random.default_rng(4).exponential(50, 15_000)],  # constant, then spread
]
STREAM_IDS = ["normal", "random-walk", "flag", "offset", "constant-first"]


@pytest.mark.parametrize("values", STREAMS, ids=STREAM_IDS)
def test_the_streamed_histogram_equals_one_histogram_of_all_values_on_its_final_grid(values):
    values = values.astype(np.float32)
    entry = streamed(values, batch=777)
    counts = np.asarray(entry["counts"])
    expected, _ = np.histogram(values.astype(np.float64), bins=grid_edges(entry))
    assert counts.sum() == len(values)
    np.testing.assert_array_equal(counts, expected)  # exact: merging dyadic bins loses nothing
    assert entry["min"] == values.min() and entry["max"] == values.max()
    # the finest grid that holds the data: at half the width it would not fit in the bins
    finer = 2.0 ** (entry["exponent"] - 1)
    spans_more_than_half = math.floor(values.max() / finer) - math.floor(values.min() / finer) >= HISTOGRAM_BINS
    assert spans_more_than_half or values.min() == values.max()


@pytest.mark.parametrize("values", STREAMS, ids=STREAM_IDS)
def test_a_scorings_parts_merged_hold_the_statistics_prepare_streams(values):
    """A batch scoring's parts (``NumericCodec.scored_drift_stats`` of each, merged in any order) give the
    histogram one RunningHistogram over all the rows holds (exactly: its final grid) and their mean and std."""
    from training.kinds.stats import RunningMoments
    from training.kinds.tabular import NumericCodec

    values = values.astype(np.float32)
    codec = NumericCodec("x")
    cuts = np.sort(np.random.default_rng(5).integers(0, len(values), size=6))
    parts = [codec.scored_drift_stats(pa.array(part)) for part in np.split(values, cuts)]
    left = parts[0]
    for part in parts[1:]:
        left = codec.merge_drift_stats(left, part)
    halves = codec.merge_drift_stats(  # another order: each half's parts, then the halves
        *(codec.merge_drift_stats(codec.merge_drift_stats(a, b), c) for a, b, c in (parts[:3], parts[3:6]))
    )
    halves = codec.merge_drift_stats(halves, parts[6])
    moments = RunningMoments(1)
    moments.update(values[None, :])
    for merged in (left, halves):
        reported = codec.reported_drift_stats(merged)
        assert reported["histogram"] == streamed(values, batch=777)
        assert reported["mean"] == pytest.approx(moments.mean[0], rel=1e-9, abs=1e-9)
        assert reported["std"] == pytest.approx(moments.std()[0], rel=1e-9)


def test_a_scorings_categorical_parts_merged_count_as_prepare_does():
    """Value counts of parts, merged, then cut to the 1000 most frequent with the rest as other: what prepare's
    ``drift_stats`` holds of the same rows (1500 distinct values here; nulls left out)."""
    from training.kinds.tabular import DRIFT_TOP_CATEGORIES, CategoricalCodec

    rng = np.random.default_rng(6)
    values = rng.zipf(1.3, size=30_000) % 1500
    column = pa.array([f"v{v}" if v % 97 else None for v in values])
    prepared = CategoricalCodec("c")
    prepared.observe(column)
    prepared.fit()
    scoring = CategoricalCodec("c")
    merged = None
    for start in range(0, len(column), 7000):
        part = scoring.scored_drift_stats(column.slice(start, 7000))
        merged = part if merged is None else scoring.merge_drift_stats(merged, part)
    reported = scoring.reported_drift_stats(merged)
    assert reported == prepared.drift_stats() and len(reported["counts"]) == DRIFT_TOP_CATEGORIES
    assert reported["other"] > 0


def test_the_most_frequent_values_come_first_and_ties_by_value():
    """``top_counts``: the ``keep`` largest counts, most frequent first and equal counts in the values' order (the
    order of the key (-count, value)), and the sum of the rest; counts as they are when they fit."""
    from training.kinds.stats import top_counts

    rng = np.random.default_rng(7)
    counts = {f"m{i}": int(n) for i, n in enumerate(rng.integers(1, 6, size=500))}  # many equal counts
    kept, rest = top_counts(counts, 300)
    expected = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    assert list(kept.items()) == expected[:300] and rest == sum(n for _, n in expected[300:])
    assert top_counts(counts, 500) == (counts, 0)


def test_a_constant_column_keeps_its_value_in_one_bin():
    entry = streamed(np.full(3000, -2.25, dtype=np.float32))
    assert sum(1 for count in entry["counts"] if count) == 1
    assert entry["min"] == entry["max"] == -2.25


def test_prepare_keeps_a_histogram_per_feature_of_the_train_split(table_file, make_config, dh):
    prepared = prepare_dataset(make_config(table_file(dh.numeric_table())))
    manifest = read_manifest(prepared.dataset_dir)
    assert manifest.feature_histograms is not None and len(manifest.feature_histograms) == manifest.n_features
    train = dh.read_split(prepared, "train")
    for name, entry in zip(manifest.features, manifest.feature_histograms):
        column = train.column(name).to_numpy()
        expected, _ = np.histogram(column.astype(np.float64), bins=grid_edges(entry))
        np.testing.assert_array_equal(entry["counts"], expected, err_msg=name)


# ---------------------------------------------------------------- the cheap fingerprint (watch-data)


def test_the_listing_fingerprint_is_prepares_and_changes_with_an_appended_row(tmp_path, make_config):
    source = tmp_path / "src" / "data.csv"
    source.parent.mkdir()
    source.write_text("x,label\n" + "".join(f"{i * 0.5},{i % 2}\n" for i in range(200)))
    config = make_config(source.parent)
    identity, fingerprint = fingerprint_from_listing(config)
    assert identity == open_source(config.source, config.format).identity()
    assert fingerprint == prepare_dataset(config).fingerprint
    assert fingerprint_from_listing(config)[1] == fingerprint  # the prepared shards under data.root do not count
    with source.open("a") as handle:
        handle.write("1.5,1\n")
    assert fingerprint_from_listing(config)[1] != fingerprint


def test_the_listing_fingerprint_opens_no_file(tmp_path, make_config):
    """A corrupt file stops prepare (its schema is read) but not a look at the listing."""
    good = tmp_path / "src" / "a.parquet"
    good.parent.mkdir()
    pq.write_table(pa.table({"x": [1.0, 2.0], "label": [0, 1]}), good)
    (good.parent / "b.parquet").write_bytes(b"not parquet at all")
    config = make_config(good.parent)
    with pytest.raises(DataError, match="b.parquet"):
        open_source(config.source, config.format)
    identity, _ = fingerprint_from_listing(config)
    assert [entry[0].rsplit("/", 1)[1] for entry in identity["files"]] == ["a.parquet", "b.parquet"]


# ---------------------------------------------------------------- PSI


def test_psi_of_known_proportions():
    # (0.9 - 0.5) ln(0.9 / 0.5) + (0.1 - 0.5) ln(0.1 / 0.5)
    assert population_stability_index([0.5, 0.5], [0.9, 0.1]) == pytest.approx(
        0.4 * math.log(1.8) + 0.4 * math.log(5.0), rel=1e-12
    )
    assert population_stability_index([50, 50], [90, 10]) == pytest.approx(0.8788898309344879)  # counts work too


def test_psi_of_identical_distributions_is_zero():
    assert population_stability_index([3, 0, 7, 1], [30, 0, 70, 10]) == 0.0
    assert population_stability_index([0.2] * 5, [0.2] * 5) == 0.0


def test_psi_floors_empty_bins_at_epsilon_instead_of_dividing_by_zero():
    value = population_stability_index([0.5, 0.5, 0.0], [0.5, 0.4, 0.1])
    expected = (0.4 - 0.5) * math.log(0.4 / 0.5) + (0.1 - PSI_EPSILON) * math.log(0.1 / PSI_EPSILON)
    assert math.isfinite(value) and value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("expected", "actual"),
    [([0.5, 0.5], [1.0]), ([], []), ([0, 0], [1, 1]), ([1, -1], [1, 1])],
)
def test_psi_refuses_bins_that_do_not_match_or_are_not_counts(expected, actual):
    with pytest.raises(ValueError, match="PSI needs"):
        population_stability_index(expected, actual)


def test_psi_of_a_shifted_normal_matches_the_decile_formula():
    rng = np.random.default_rng(5)
    reference = streamed(rng.normal(0.0, 1.0, 200_000), batch=10_000)
    shifted = streamed(rng.normal(0.5, 1.0, 200_000), batch=10_000)
    resample = streamed(rng.normal(0.0, 1.0, 200_000), batch=10_000)
    # N(0, 1) deciles against N(0.5, 1): the PSI of the exact bin shares.
    deciles = [NormalDist().inv_cdf(k / 10) for k in range(1, 10)]
    shares = np.diff([0.0, *(NormalDist(0.5, 1.0).cdf(edge) for edge in deciles), 1.0])
    theory = population_stability_index(np.full(10, 0.1), shares)
    assert histogram_psi(reference, shifted) == pytest.approx(theory, abs=0.02)
    assert histogram_psi(reference, resample) < 0.01  # sampling noise only
    assert histogram_psi(reference, reference) == 0.0


def test_psi_of_discrete_features_is_exact_on_the_common_grid():
    rng = np.random.default_rng(6)
    even = streamed((rng.random(100_000) < 0.5).astype(np.float32))
    skewed = streamed((rng.random(100_000) < 0.7).astype(np.float32))
    observed = [sum(even["counts"]), sum(skewed["counts"])]
    shares = [np.count_nonzero(even["counts"]), np.count_nonzero(skewed["counts"])]
    assert observed == [100_000, 100_000] and shares == [2, 2]
    first, second = common_grid(even, skewed)
    assert np.count_nonzero(first) == np.count_nonzero(second) == 2  # 0 and 1 stay apart, no smearing
    expected = population_stability_index(first[first > 0], second[second > 0])
    assert histogram_psi(even, skewed) == pytest.approx(expected, rel=1e-12)
    assert histogram_psi(even, skewed) == pytest.approx(population_stability_index([0.5, 0.5], [0.3, 0.7]), abs=0.01)


def test_a_value_the_reference_never_had_counts_as_large_drift():
    flags = streamed(np.random.default_rng(7).integers(0, 2, 50_000).astype(np.float32))
    with_new_value = streamed(np.random.default_rng(8).integers(0, 3, 50_000).astype(np.float32))
    assert histogram_psi(flags, with_new_value) > 1.0


def test_histograms_far_apart_still_compare():
    rng = np.random.default_rng(9)
    assert histogram_psi(streamed(rng.normal(0, 1, 5000)), streamed(rng.normal(1e6, 1, 5000))) > 10


# ---------------------------------------------------------------- two prepared datasets


def test_compare_ranks_the_shifted_feature_first(table_file, make_config, dh):
    table = dh.numeric_table()
    # Split by the id: both datasets hold the same rows in each split, only x1 moved.
    reference = prepare_dataset(make_config(table_file(table, "a.parquet"), key="id")).manifest
    x1 = table.column("x1").to_numpy()
    shifted = table.set_column(table.schema.get_field_index("x1"), "x1", pa.array(x1 + 6.0))  # +2 std (std 3)
    current = prepare_dataset(make_config(table_file(shifted, "b.parquet"), key="id")).manifest
    report = compare(reference, current)
    assert [drift.feature for drift in report.features][0] == "x1"
    assert report.worst.psi > 1.0 and report.max_psi == report.worst.psi
    assert report.worst.mean_shift == pytest.approx(2.0, abs=0.1)
    assert [drift.psi for drift in report.features] == sorted((drift.psi for drift in report.features), reverse=True)
    others = {drift.feature: drift for drift in report.features[1:]}
    assert set(others) == {"x0", "x2", "count"}
    assert all(drift.psi == 0.0 and drift.mean_shift == 0.0 for drift in others.values())  # the same rows
    assert report.to_dict()["worst_feature"] == "x1"


def test_the_histogram_counts_missing_values_apart_and_its_bins_stay_exact():
    values = np.random.default_rng(5).normal(0, 1, 9000).astype(np.float32)
    values[::4] = np.nan
    values[:1000] = np.nan  # whole batches of nothing but missing values too
    entry = streamed(values, batch=500)
    present = values[~np.isnan(values)]
    expected, _ = np.histogram(present.astype(np.float64), bins=grid_edges(entry))
    np.testing.assert_array_equal(np.asarray(entry["counts"]), expected)
    assert entry["nulls"] == int(np.isnan(values).sum()) and entry["min"] == present.min()
    empty = streamed(np.full(100, np.nan, dtype=np.float32))  # nothing but missing values
    assert empty["nulls"] == 100 and sum(empty["counts"]) == 0
    assert histogram_psi(empty, empty) == 0.0 and histogram_psi(entry, empty) > 0.25  # compared, not refused


def test_a_shift_of_a_columns_null_rate_is_drift_and_both_rates_are_reported(table_file, make_config, dh):
    """The same rows, x0's null rate 0 -> 30%: the present values keep their distribution (each split keeps its
    rows, nulls drawn at random), yet x0 drifts (its nulls are a PSI group of their own) and reports both rates."""
    table = dh.numeric_table()
    reference = prepare_dataset(make_config(table_file(table, "a.parquet"), key="id")).manifest
    x0 = table.column("x0").to_numpy().copy()
    x0[np.random.default_rng(6).random(len(x0)) < 0.3] = np.nan
    nulls = table.set_column(table.schema.get_field_index("x0"), "x0", pa.array(x0))
    current = prepare_dataset(make_config(table_file(nulls, "b.parquet"), key="id")).manifest
    report = compare(reference, current)
    assert report.worst.feature == "x0" and report.worst.psi > 0.25  # large, by the rule of thumb
    assert report.worst.reference_null_rate == 0.0
    assert report.worst.current_null_rate == pytest.approx(0.3, abs=0.03)
    assert abs(report.worst.mean_shift) < 0.1  # the present values did not move
    assert all(drift.psi == 0.0 for drift in report.features[1:])  # the other columns: the same rows
    assert report.to_dict()["features"][0]["current_null_rate"] == report.worst.current_null_rate


def test_a_manifest_without_histograms_makes_drift_unavailable_not_an_error(table_file, make_config, dh):
    current = prepare_dataset(make_config(table_file(dh.numeric_table()))).manifest
    old = dataclasses.replace(current, fingerprint="0ld0ld0ld0ld0ld0", feature_histograms=None)
    with pytest.raises(DriftUnavailable, match="0ld0ld0ld0ld0ld0 was prepared without feature histograms"):
        compare(old, current)


def test_datasets_with_no_feature_in_common_cannot_be_compared(table_file, make_config, dh):
    current = prepare_dataset(make_config(table_file(dh.numeric_table()))).manifest
    renamed = dataclasses.replace(current, features=[f"other_{name}" for name in current.features])
    with pytest.raises(DriftUnavailable, match="no feature column in common"):
        compare(renamed, current)


def test_drift_per_kind_categorical_frequencies_vector_dimensions_and_the_label(tmp_path):
    """Categorical PSI over category frequencies with an unseen bucket, a vector's per-dimension mean shift,
    and the label's distribution: 0 for the same data, large where only that part changed."""
    import pyarrow.parquet as pq

    from training.core.config import load_config
    from training.prepare.dataset import prepare_dataset

    def prepared(name: str, colours, shift: float, positive: float):
        rng = np.random.default_rng(0)
        rows = 3000
        table = pa.table(
            {
                "x": rng.normal(size=rows),
                "colour": rng.choice(colours, size=rows),
                "vec": (rng.normal(size=(rows, 3)) + [0.0, shift, 0.0]).tolist(),
                "y": (rng.uniform(size=rows) < positive).astype(np.int64),
            }
        )
        pq.write_table(table, tmp_path / f"{name}.parquet")
        inputs = '{"x": numeric, "colour": categorical, "vec": vector}'
        overrides = [f"data.source={tmp_path / name}.parquet", f"data.root={tmp_path / 'shards'}", "data.label=y"]
        return prepare_dataset(load_config(None, [*overrides, f"data.inputs={inputs}"]).data).manifest

    reference = prepared("reference", ["red", "green"], 0.0, 0.5)
    same = compare(reference, prepared("same", ["red", "green"], 0.0, 0.5))
    assert same.max_psi == 0.0 and "colour" in {d.feature for d in same.features} and same.label.psi == 0.0
    vector = next(d for d in same.features if d.feature.startswith("vec["))
    assert vector.mean_shift == 0.0
    changed = compare(reference, prepared("changed", ["red", "blue"], 2.0, 0.9))  # blue: never seen before
    by_name = {d.feature: d for d in changed.features}
    assert by_name["colour"].psi > 1.0 and by_name["x"].psi < 0.1 and changed.worst.feature == "colour"
    assert changed.label.feature == "label:y" and changed.label.psi > 0.25
    assert "vec[1]" in by_name and by_name["vec[1]"].mean_shift == pytest.approx(2.0, abs=0.15)
