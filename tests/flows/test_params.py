"""How the flow's parameters combine into one config, and the run names they give."""

from __future__ import annotations

import pytest
import yaml

from flows.params import data_label, resolve_config, run_label
from training.core.config import ConfigError, PipelineConfig


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({"train": {"epochs": 7, "lr": 0.5}, "registry": {"model_name": "from-file"}}))
    return str(path)


def test_file_then_the_fields_set_in_config_then_overrides(config_file):
    config = resolve_config(PipelineConfig.model_validate({"train": {"lr": 0.1}}), config_file, ["train.batch_size=32"])
    assert config.train.epochs == 7, "a field config did not set keeps the file's value, not the default"
    assert config.train.lr == 0.1, "config beats the file"
    assert config.train.batch_size == 32
    assert config.registry.model_name == "from-file"
    assert resolve_config({"train": {"lr": 0.1}}, config_file, ["train.lr=0.2"]).train.lr == 0.2, (
        "overrides beat config"
    )


def test_no_parameters_give_the_defaults_and_bad_values_name_the_field(tmp_path):
    assert resolve_config() == PipelineConfig()
    with pytest.raises(ConfigError, match="train.epochs"):
        resolve_config(overrides=["train.epochs=0"])
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(config_file=str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    ("source", "label"),
    [
        ("synthetic://regression?rows=10&features=2", "synthetic-regression"),
        ("/data/sales/2024.parquet", "2024"),
        ("s3://bucket/churn/", "churn"),
        ("data/events/*.csv", "events"),
    ],
)
def test_data_label(source, label):
    assert data_label(source) == label


def test_run_label_names_the_model_and_the_data():
    config = PipelineConfig.model_validate(
        {"train": {"model": "my_pkg.nets:wide_net"}, "data": {"source": "data/churn.csv"}}
    )
    assert run_label(config) == "wide_net-churn"


def test_run_label_with_the_default_model_auto_names_the_data():
    """auto is resolved only once the data is prepared; a flow run is named before that."""
    assert run_label(PipelineConfig.model_validate({"data": {"source": "data/churn.csv"}})) == "churn"
