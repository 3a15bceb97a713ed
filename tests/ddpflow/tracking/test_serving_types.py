"""Without a server or a launch: how `ddpflow serve` reads NAME[@alias|/version], and which type the served
model's signature declares for each source type (training/kinds/tabular.py: NumericCodec.serving_example,
source_dtype; training/inference/serving.py: raw_example)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ddpflow.tracking.served_model import model_uri, served_model
from training.kinds.tabular import NumericCodec, source_dtype


def test_a_model_is_named_by_alias_or_version_and_champion_by_default():
    assert model_uri("churn") == ("churn", "champion", None)
    assert model_uri("churn@challenger") == ("churn", "challenger", None)
    assert model_uri("churn/12") == ("churn", None, "12")
    for bad in ("churn/latest", "@champion", "churn@", ""):
        with pytest.raises(ValueError, match="NAME"):
            model_uri(bad)


def test_a_store_that_does_not_exist_is_named_not_created(tmp_path):
    missing = tmp_path / "mlflow.db"
    with pytest.raises(ValueError, match=f"no MLflow store at {missing}"):
        served_model("churn", f"sqlite:///{missing}")
    assert not missing.exists()


@pytest.mark.parametrize(
    ("source", "declared"),
    [
        ("int8", "int64"),
        ("int16", "int64"),
        ("int32", "int64"),
        ("int64", "int64"),
        ("uint8", "int64"),
        ("uint32", "int64"),
        ("uint64", "int64"),  # MLflow has no unsigned 64-bit type
        ("bool", "bool"),
        ("halffloat", "float64"),
        ("float", "float64"),
        ("double", "float64"),
        ("decimal128(10, 2)", "float64"),
        (None, "float64"),  # a model.pt from before source_types: as it was served
    ],
)
def test_a_numeric_input_is_declared_in_its_source_kind(source, declared):
    shard = pd.Series(np.array([0, 1, 7], dtype=np.float32), name="x")  # the shard's float32 values
    example = NumericCodec.serving_example(shard, source)
    assert example.dtype == np.dtype(declared)
    assert example.tolist() == [0, 1, 7] if declared != "bool" else example.tolist() == [False, True, True]
    assert isinstance(source_dtype(source), pa.DataType)
