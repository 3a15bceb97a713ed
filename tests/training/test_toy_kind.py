"""A kind of a user's own, registered from a test module (tests/training/toy_kind.py, not shipped) through
``DDPFLOW_PLUGINS``, prepared, trained by the real Trainer under real torchrun (one rank, gloo, the
production argv and environment), then evaluated, predicted from raw rows and compared for drift.

Each hook of the kind's record shows in a result, so ignoring any one fails a test here: registration (a
process without the plugin refuses the kind; the rank imports it from the environment), ``options_from``
(the default filled, a bad value and a foreign option refused, naming the input), ``takes`` (a numeric
column refused), ``valid`` (the rows holding a letter dropped), ``observe``/``fit`` (the train split's digit
shares in encoders.json), ``shape``/``encode`` (the model's input width, and a label only the digits carry
learnt), ``model_block`` (``auto`` builds the MLP over it), ``drift_measure``/``drift_stats`` (PSI of the
digits), ``shown_as`` (its column in the confidently-wrong table) and ``reference_column`` (no reference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.core.config import ConfigError, load_config
from training.core.errors import DataError
from training.core.job import TrainJob
from training.models.numeric_embeddings import DEFAULT_DIM
from training.prepare.dataset import prepare_dataset

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "tests.training.toy_kind"
BAD_ROWS = 3  # rows whose digits hold a letter: invalid, dropped
INPUTS = {"code": {"kind": "digits", "scale": 4}, "x": "numeric"}


def digits_table(rows: int, seed: int, low_share: float = 0.5) -> pa.Table:
    """7 digits per row; the label says whether most are below 5 (only the digits carry it; ``x`` is noise)."""
    rng = np.random.default_rng(seed)
    low = rng.random((rows, 7)) < low_share
    digits = np.where(low, rng.integers(0, 5, (rows, 7)), rng.integers(5, 10, (rows, 7)))
    codes = ["".join(map(str, row)) for row in digits]
    for row in range(BAD_ROWS):
        codes[row] = codes[row][:3] + "a" + codes[row][4:]
    return pa.table(
        {
            "id": pa.array(np.arange(rows), pa.int64()),
            "code": codes,
            "x": rng.normal(size=rows),
            "label": np.where((digits < 5).sum(axis=1) >= 4, "low", "high"),
        }
    )


def prepare(root: Path, table: pa.Table, inputs=INPUTS):
    pq.write_table(table, root / "digits.parquet")
    overrides = [
        f"data.source={root / 'digits.parquet'}",
        f"data.root={root / 'shards'}",
        "data.label=label",
        "data.key=id",
        "data.on_invalid=drop",
        f"data.inputs={json.dumps(inputs)}",
    ]
    return prepare_dataset(load_config(None, overrides).data)


@pytest.fixture(scope="module")
def plugin_env():
    """The plugin named in the environment, as a user sets it for the flow, the worker and the ranks."""
    with pytest.MonkeyPatch.context() as patch:
        named = [name for name in os.environ.get("DDPFLOW_PLUGINS", "").split(",") if name]
        patch.setenv("DDPFLOW_PLUGINS", ",".join([*named, PLUGIN]))
        yield dict(os.environ)


@pytest.fixture(scope="module")
def prepared(plugin_env, tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("digits"), digits_table(400, seed=0))


@pytest.fixture(scope="module")
def trained(prepared, plugin_env, tmp_path_factory) -> Path:
    """One rank under torchrun, the production argv and environment: ``python -m training.train``."""
    from ddpflow.launch.command import launch_env, torchrun_command

    run_dir = tmp_path_factory.mktemp("digits-run")
    settings = {"epochs": 8, "batch_size": 16, "lr": 0.02, "nproc_per_node": 1, "num_threads": 1}
    config = load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in settings.items()])
    job = TrainJob(config=config, dataset_dir=str(prepared.dataset_dir), run_dir=str(run_dir), init_weights=None)
    job_path = job.write(run_dir / "train_config.json")
    env = launch_env(config, run_dir, gpus=0, base=plugin_env)
    done = subprocess.run(
        torchrun_command(config, job_path, gpus=0), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return run_dir / "model.pt"


def test_without_the_plugin_a_process_refuses_the_kind():
    """(With it, the rank imports it from the environment: the launch below.)"""
    probe = "from training.kinds.registry import kind_record; kind_record('digits')"
    env = {name: value for name, value in os.environ.items() if name != "DDPFLOW_PLUGINS"}
    bare = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "unknown input kind 'digits'" in bare.stderr, bare.stderr[-2000:]


def test_a_plugin_that_does_not_import_is_named(monkeypatch):
    from training.kinds.registry import kind_record

    monkeypatch.setenv("DDPFLOW_PLUGINS", "tests.training.no_such_kind")
    with pytest.raises(
        ConfigError, match=r"DDPFLOW_PLUGINS / ddpflow.kinds: cannot import 'tests.training.no_such_kind'"
    ):
        kind_record("audio")


def test_its_options_and_its_column_are_checked_by_its_record(plugin_env, tmp_path):
    from training.kinds.registry import check_inputs

    def checked(spec):
        return check_inputs(load_config(None, [f"data.inputs={json.dumps({'code': spec})}"]).data)["code"]

    assert checked("digits") == ("digits", {"scale": 1.0})  # the default, filled by the record
    assert checked({"kind": "digits", "scale": 4}) == ("digits", {"scale": 4.0})
    with pytest.raises(ConfigError, match=r"data.inputs.code: kind 'digits' needs scale > 0, not -1.0"):
        checked({"kind": "digits", "scale": -1})
    with pytest.raises(ConfigError, match=r"data.inputs.code: kind 'digits' takes no option \['buckets'\]"):
        checked({"kind": "digits", "buckets": 3})
    with pytest.raises(DataError, match=r"input column 'x' has type double; data.inputs.x is digits, which takes "):
        prepare(tmp_path, digits_table(40, seed=1), {"x": "digits"})


def test_prepare_validates_fits_and_records_it_through_its_record(prepared):
    manifest = prepared.manifest
    entry = next(entry for entry in manifest.inputs if entry["name"] == "code")
    assert (entry["kind"], entry["dtype"], entry["shape"]) == ("digits", "float32", [10])
    assert manifest.dropped_rows == BAD_ROWS  # ``valid``: the rows holding a letter
    state = json.loads((prepared.dataset_dir / "encoders.json").read_text())["code"]
    assert state["options"] == {"scale": 4.0}
    train = pa.concat_tables(pq.read_table(path) for path in manifest.split_files(prepared.dataset_dir, "train"))
    digits = np.array([int(c) for row in train["code"].to_pylist() for c in row])
    counts = np.bincount(digits, minlength=10)
    assert state["state"]["counts"] == counts.tolist()  # observed on the train split only
    np.testing.assert_allclose(state["state"]["mean"], counts / counts.sum())
    drift = manifest.extra["drift_stats"]["inputs"]["code"]
    assert drift["counts"] == {str(d): int(n) for d, n in enumerate(counts)}


def test_drift_compares_its_digits_by_the_measure_its_record_names(prepared, tmp_path):
    from ddpflow.drift.report import compare

    shifted = prepare(tmp_path, digits_table(400, seed=2, low_share=0.8))
    report = {drift.feature: drift for drift in compare(prepared.manifest, shifted.manifest).features}
    same = {drift.feature: drift for drift in compare(prepared.manifest, prepared.manifest).features}
    assert report["code"].psi > 0.1 and same["code"].psi == 0.0
    assert report["x"].psi < report["code"].psi  # x did not move


def test_no_reference_model_for_it(prepared):
    from training.inference.reference import reference_skip_reason

    assert "'code': 'digits'" in reference_skip_reason(prepared.manifest)


@pytest.mark.torchrun
def test_the_real_trainer_learns_it_and_evaluation_and_prediction_read_it(trained, prepared):
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor

    model = torch.load(trained, weights_only=True)
    assert model["model_spec"]["model"] == "mlp"  # auto: the record's DENSE block feeds the MLP
    first = next(value for key, value in model["model"].items() if key.startswith("net.") and key.endswith("weight"))
    assert first.shape[1] == DEFAULT_DIM + 10  # x's numeric embedding, then the digits' [10] (``shape``)
    result = evaluate_split(trained, prepared.dataset_dir, split="test")
    assert result.metrics["test_accuracy"] > 0.85, result.metrics  # only the encoded digits carry the label
    assert "code" in result.confidently_wrong["columns"]  # ``shown_as``: the table shows its rows
    test = pa.concat_tables(
        pq.read_table(path) for path in prepared.manifest.split_files(prepared.dataset_dir, "test")
    ).to_pandas()
    predicted = Predictor.from_checkpoint(trained).predict(pd.DataFrame(test[["code", "x"]]))
    labels = np.asarray(prepared.manifest.label_mapping)[test["label"].to_numpy()]  # the shard holds class indices
    accuracy = float(np.mean(predicted == labels))
    assert accuracy == pytest.approx(result.metrics["test_accuracy"])  # raw rows in: the same encoding
