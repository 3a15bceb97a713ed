"""The training program under REAL torchrun launches (gloo, CPU ranks, tiny data), started with the
production launcher's own argv and environment (``torchrun_command``, ``launch_env``).

One launch feeds several assertions (module-scoped fixtures), so the whole file
runs a bounded number of launches. Datasets are written straight from the
manifest contract with exact split sizes:

- ``dataset``: 1024 train rows (divisible by every batch used), 201 val rows
  (odd, so exact validation cannot hide behind padding);
- ``uneven``: 211 train rows = 13 x 16 + 3 = 14 x 15 + 1, so 2 ranks x 8 end
  each epoch on a global batch of 3 rows (2 on rank 0, 1 on rank 1) and
  3 ranks x 5 on one of 1 row (ranks 1 and 2 hold only sampler padding).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from devtools.ports import free_port
from tests.multi_case import launch_cases
from training.core.config import PipelineConfig, load_config
from training.core.job import TrainJob
from training.core.manifest import Manifest, ShardInfo, SplitInfo, read_manifest, write_manifest
from training.kinds.inputs import numeric_input
from training.models.registry import ModelSpec

pytestmark = pytest.mark.torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN_ROWS, VAL_ROWS, FEATURES, CLASSES = 1024, 201, 8, 3
BATCH = 64  # per rank, with 2 ranks
EPOCHS = 2
HIDDEN = [32]
UNEVEN_ROWS, UNEVEN_VAL_ROWS = 211, 101
EXACT = 1e-5  # final weights of runs that take the same optimizer steps
# A user factory with dropout: resuming to the same weights needs every rank's RNG restored.
DROPOUT_MODEL = {"model": "tests.dropout_model:dropout_mlp", "model_kwargs": {"hidden": 32, "p": 0.3}}
DROPOUT_RESUME = {"epochs": 3, "batch_size": 8, **DROPOUT_MODEL}  # the resume test's runs
TEST_HOOKS = ("DDPFLOW_FAULT", "DDPFLOW_RECORD_INDICES")


def production_launcher():
    """The launcher's argv and environment builders: the ONE import to change when they move."""
    from ddpflow.launch.command import launch_env, torchrun_command

    return launch_env, torchrun_command


# --- data and launches -------------------------------------------------------------------------


def write_dataset(
    root: Path, rows: dict[str, int], seed: int = 0, name: str = "fp-test", classes: int = CLASSES
) -> Path:
    """A prepared dataset per training/core/manifest.py, two shards per split; ``classes`` 0: a regression
    target (standardised in training by the manifest's label_mean/label_std)."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(FEATURES, max(classes, 1)))
    features = [f"f{i}" for i in range(FEATURES)]
    dataset_dir = root / name
    splits, train_x, train_y = {}, None, None
    for split, count in rows.items():
        z = rng.normal(size=(count, FEATURES))
        x = (z * 5.0 + 20.0).astype(np.float32)
        if classes:
            # A skewed first class (+0.8): balanced class weights then differ from 1.
            y = (z @ teacher + np.eye(classes)[0] * 0.8).argmax(axis=1).astype(np.int64)
        else:
            y = (3.0 * (z @ teacher)[:, 0] + 7.0).astype(np.float32)
        (dataset_dir / split).mkdir(parents=True)
        shards, half = [], count // 2
        for number, (lo, hi) in enumerate([(0, half), (half, count)]):
            table = pa.table({**{name: x[lo:hi, i] for i, name in enumerate(features)}, "label": y[lo:hi]})
            relative = f"{split}/part-{number:05d}.parquet"
            pq.write_table(table, dataset_dir / relative, row_group_size=100)
            shards.append(ShardInfo(relative, hi - lo, (dataset_dir / relative).stat().st_size))
        splits[split] = SplitInfo(count, shards)
        if split == "train":
            train_x, train_y = x, y
    write_manifest(
        dataset_dir,
        Manifest(
            fingerprint=name,
            source="test",
            task="classification" if classes else "regression",
            label="label",
            key=None,
            features=features,
            label_mapping=["a", "b", "c", "d", "e"][:classes] if classes else None,
            feature_mean=train_x.mean(axis=0).tolist(),
            feature_std=train_x.std(axis=0).tolist(),
            splits=splits,
            schema=[],
            config={},
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
            versions={},
            label_mean=None if classes else float(train_y.mean()),
            label_std=None if classes else float(train_y.std()),
            train_class_counts=np.bincount(train_y, minlength=classes).tolist() if classes else None,
        ),
    )
    return dataset_dir


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def model(self) -> dict:
        return torch.load(self.run_dir / "model.pt", weights_only=True)

    def dataset_dir(self) -> Path:
        return Path(json.loads((self.run_dir / "train_config.json").read_text())["dataset_dir"])

    def passes(self, rank: int, epoch: int) -> list[list[int]]:
        """Every completed pass of ``rank`` over ``epoch`` (DDPFLOW_RECORD_INDICES appends one line per pass)."""
        path = self.run_dir / "indices" / f"rank{rank}-epoch{epoch}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def indices(self, rank: int, epoch: int) -> list[int]:
        """The rows ``rank`` trained on in ``epoch``, which it completed exactly once."""
        passes = self.passes(rank, epoch)
        assert len(passes) == 1, f"rank {rank} completed epoch {epoch} {len(passes)} times"
        return passes[0]


def job_config(nproc: int = 2, max_restarts: int = 0, **train) -> PipelineConfig:
    settings = {
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "num_threads": 1,
        "model_kwargs": {"hidden": HIDDEN},
        "lr": 0.01,
        "progress_interval_s": 0.2,
        "collective_timeout_s": 60,
        "nproc_per_node": nproc,
        "max_restarts": max_restarts,
        **train,
    }
    return load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in settings.items()])


def write_job(run_dir: Path, dataset_dir: Path, config: PipelineConfig, init_weights: Path | None = None) -> Path:
    job = TrainJob(
        config=config,
        dataset_dir=str(dataset_dir),
        run_dir=str(run_dir),
        init_weights=str(init_weights) if init_weights else None,
    )
    return job.write(run_dir / "train_config.json")


def production_env(config: PipelineConfig, run_dir: Path, **hooks: str) -> dict[str, str]:
    """What the launcher gives torchrun, on this machine's environment minus stray test hooks, plus ``hooks``."""
    launch_env, _ = production_launcher()
    base = {name: value for name, value in os.environ.items() if name not in TEST_HOOKS}
    return {**launch_env(config, run_dir, gpus=0, base=base), **hooks}


def launch(
    run_dir: Path,
    dataset_dir: Path,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    init_weights: Path | None = None,
    **train,
) -> Launch:
    config = job_config(nproc, max_restarts, **train)
    job_path = write_job(run_dir, dataset_dir, config, init_weights)
    _, torchrun_command = production_launcher()
    done = subprocess.run(
        torchrun_command(config, job_path, gpus=0),
        cwd=REPO,
        env=production_env(config, run_dir, **(env or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Launch(run_dir, done.returncode, done.stdout + done.stderr)


def succeeded(result: Launch) -> Launch:
    assert result.returncode == 0, result.output[-4000:]
    return result


def assert_same_weights(a: dict, b: dict, atol: float) -> float:
    """Every tensor within ``atol``; returns the largest absolute difference (printed by the exactness tests)."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


def report(what: str, difference: float) -> None:
    print(f"\n[exactness] {what}: max |weight difference| = {difference:.2e}")


# --- fixtures: one launch each, shared by the tests ----------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("shards"), {"train": TRAIN_ROWS, "val": VAL_ROWS, "test": 16})


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> Path:
    rows = {"train": UNEVEN_ROWS, "val": UNEVEN_VAL_ROWS, "test": 16}
    return write_dataset(tmp_path_factory.mktemp("uneven"), rows, seed=1, name="fp-uneven")


@pytest.fixture(scope="module")
def two_ranks(exact_runs) -> Launch:
    """2 ranks x BATCH on ``dataset``, indices recorded: one case of the exact-update runs' 2-rank launch."""
    return exact_runs["two_ranks"]


# --- tests ------------------------------------------------------------------------------------------


def test_each_epoch_covers_the_train_split_exactly_once_in_a_new_order(two_ranks):
    for epoch in range(EPOCHS):
        rank0, rank1 = two_ranks.indices(0, epoch), two_ranks.indices(1, epoch)
        assert not set(rank0) & set(rank1)
        assert sorted(rank0 + rank1) == list(range(TRAIN_ROWS))
    assert two_ranks.indices(0, 0) != two_ranks.indices(0, 1)


def test_per_epoch_metrics_are_exact_and_ranks_agree(two_ranks):
    records = two_ranks.metrics()
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    for record in records:
        assert record["train_samples"] == TRAIN_ROWS
        assert record["val_samples"] == VAL_ROWS  # 201 rows over 2 ranks: no padding, no row dropped
        assert record["weights_in_sync"] is True
        assert record["restart_count"] == 0 and record["world_size"] == 2
        assert 0 < record["val_accuracy"] <= 1 and record["train_loss"] > 0 and record["lr"] == 0.01
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert two_ranks.output.count("epoch 1/2 done") == 1  # rank 0 alone prints


POLLING_LINE = (
    "polling for the gradient all-reduce"  # rank 0's set-up line (training/distributed/process.py: ProcessSetup)
)


@pytest.mark.parametrize(
    ("sleeping", "polling"),
    [("uneven_w2", "uneven_w2_poll"), ("uneven_w3", "uneven_w3_poll")],
)
def test_polling_for_the_all_reduce_trains_bit_identical_weights_at_the_same_world_size(sleeping, polling, exact_runs):
    """train.cpu_poll_allreduce=true against the default (false), the same data and world size, W=2 and W=3.
    Tolerance 0: the weights are bit-identical, because the polling hook averages each bucket as DDP's reducer
    does (times 1/W, then SUM). With torch's allreduce_hook (divide by W) W=3 differs in the last bits."""
    off, on = exact_runs[sleeping], exact_runs[polling]
    assert POLLING_LINE in on.output and POLLING_LINE not in off.output  # opt-in: the default does not poll
    weights_off, weights_on = off.model()["model"], on.model()["model"]
    assert weights_off.keys() == weights_on.keys()
    differing = [name for name in weights_off if not torch.equal(weights_off[name], weights_on[name])]
    assert differing == [], f"polling changed {differing}"
    assert on.metrics() != [] and [r["train_loss"] for r in on.metrics()] == [r["train_loss"] for r in off.metrics()]


def test_checkpoints_are_complete_and_load_with_weights_only(two_ranks):
    assert sorted(p.name for p in (two_ranks.run_dir / "checkpoints").iterdir()) == ["last.pt"]  # no temp files left
    last = torch.load(two_ranks.run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == EPOCHS and last["fingerprint"] == "fp-test" and last["world_size"] == 2
    assert len(last["rng"]["per_rank"]) == 2 and last["config"]["train"]["batch_size"] == BATCH
    assert {"model", "optimizer", "scheduler", "metrics"} <= last.keys()
    final = two_ranks.model()
    numeric = [numeric_input(f"f{i}").to_dict() for i in range(FEATURES)]
    assert final["model_spec"] == ModelSpec("mlp", FEATURES, CLASSES, {"hidden": HIDDEN}, numeric).to_dict()
    assert final["features"] == [f"f{i}" for i in range(FEATURES)] and final["label_mapping"] == ["a", "b", "c"]
    assert final["task"] == "classification" and final["epochs"] == EPOCHS and final["fingerprint"] == "fp-test"
    assert len(final["feature_mean"]) == FEATURES and final["metrics"]["epoch"] == EPOCHS - 1
    assert final["label_mean"] is None and final["label_std"] is None  # classification: no target statistics
    assert_same_weights(final["model"], last["model"], atol=0)


# --- the exact update: W ranks x b, one rank x W*b and grad_accum take the same steps on any split ------------


@pytest.mark.parametrize(("world", "double"), [(2, "uneven_w1x2"), (3, "uneven_w1x3")])
def test_the_global_batch_of_w_ranks_is_the_one_rank_batch(world, double, exact_runs):
    """DistributedSampler's rank r takes perm[r::W] of the permutation the one rank walks in order: step s of
    the W ranks together holds exactly the rows of the one rank's step s (padding excluded)."""
    ranks = exact_runs[{2: "uneven_w2", 3: "uneven_w3"}[world]]
    single = exact_runs[double]
    for epoch in range(EPOCHS):
        order = single.indices(0, epoch)
        assert sorted(order) == list(range(UNEVEN_ROWS))
        for rank in range(world):
            assert ranks.indices(rank, epoch) == order[rank::world]


# Objectives and weightings beyond the default (softmax, unweighted): (dataset classes, train settings, the
# metrics validation must report). One case may check several settings: each pair of launches costs ~10 s.
OBJECTIVE_CASES = {
    "default": (CLASSES, {}, ("val_accuracy", "val_macro_f1", "val_log_loss")),
    # Balanced class weights and label smoothing enter the per-row loss and the step's denominator.
    "softmax_balanced_smoothed": (
        CLASSES,
        {"class_weights": "balanced", "label_smoothing": 0.1},
        ("val_accuracy", "val_macro_f1", "val_log_loss"),
    ),
    "binary_class_weights": (
        2,
        {"objective": "binary", "class_weights": {"b": 3.0}},
        ("val_accuracy", "val_macro_f1", "val_log_loss", "val_roc_auc", "val_pr_auc"),
    ),
    "huber": (0, {"objective": "huber", "objective_kwargs": {"delta": 0.5}}, ("val_rmse", "val_mae", "val_r2")),
}


def objective_runs(case: str) -> tuple[str, str]:
    """The EXACT_RUNS of an OBJECTIVE_CASES entry: (2 ranks x 8, 1 rank x 16) on a 211-row train split."""
    return ("uneven_w2", "uneven_w1x2") if case == "default" else (f"{case}_w2", f"{case}_w1x2")


@pytest.mark.parametrize("case", OBJECTIVE_CASES)
def test_two_ranks_train_the_weights_of_one_rank_with_twice_the_batch(case, exact_runs):
    """For every objective and class weighting: the last step of each epoch holds 3 rows, 2 on rank 0 and
    1 (+ 1 padding) on rank 1; the weights, losses and metrics of 2 ranks x 8 equal those of 1 rank x 16."""
    ranks, single = (exact_runs[name] for name in objective_runs(case))
    difference = assert_same_weights(ranks.model()["model"], single.model()["model"], EXACT)
    report(f"{case}: 2 ranks x 8 vs 1 rank x 16, 211 rows (last global batch 3)", difference)
    _, train, reported = OBJECTIVE_CASES[case]
    for a, b in zip(ranks.metrics(), single.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
        for name in reported:
            assert a[name] == pytest.approx(b[name], abs=2 / UNEVEN_VAL_ROWS), name  # a boundary row may flip
    final = ranks.model()
    assert final["objective"]["name"] == train.get("objective", "softmax")
    assert final["model_spec"]["n_outputs"] == {"binary": 1, "huber": 1}.get(train.get("objective"), CLASSES)
    if train.get("class_weights") or train.get("label_smoothing"):
        # The weighted, smoothed loss is not the plain log loss: the settings reached the ranks.
        last = ranks.metrics()[-1]
        assert abs(last["val_loss"] - last["val_log_loss"]) > 1e-3


def test_three_ranks_train_the_weights_of_one_rank_with_three_times_the_batch(exact_runs):
    # The last step of each epoch holds 1 row, on rank 0; ranks 1 and 2 hold only padding.
    difference = assert_same_weights(
        exact_runs["uneven_w3"].model()["model"], exact_runs["uneven_w1x3"].model()["model"], EXACT
    )
    report("3 ranks x 5 vs 1 rank x 15, 211 rows (last global batch 1)", difference)


def test_accumulating_two_micro_batches_trains_the_weights_of_one_double_batch(exact_runs):
    """2 ranks x 4 rows x grad_accum 2 against 2 ranks x 8: each epoch's last optimizer step is ONE micro-batch
    (27 per rank) holding 3 real rows and 1 padding, so both the divisor and the short group are exercised."""
    accumulated = exact_runs["accumulated"]
    weights = accumulated.model()["model"]
    difference = assert_same_weights(weights, exact_runs["uneven_w2"].model()["model"], EXACT)
    report("2 ranks x 4 x grad_accum 2 vs 2 ranks x 8, 211 rows (last step: 1 micro-batch)", difference)
    report("... vs 1 rank x 16", assert_same_weights(weights, exact_runs["uneven_w1x2"].model()["model"], EXACT))
    assert [r["train_samples"] for r in accumulated.metrics()] == [UNEVEN_ROWS] * EPOCHS


def write_categorical_dataset(root: Path) -> Path:
    """A table the numeric column cannot explain (the label is a function of a categorical), with a hashed id
    and a vector, prepared by the real prepare stage: 237 train-ish rows, so 2 ranks end on a padded step."""
    from training.prepare.dataset import prepare_dataset

    rng = np.random.default_rng(5)
    rows = 300
    colour = rng.choice(["red", "green", "blue", "grey"], size=rows)
    table = pa.table(
        {
            "noise": rng.normal(size=rows),
            "colour": colour,
            "shop": [f"shop-{i % 40}" for i in range(rows)],
            "vec": [rng.normal(size=2).tolist() for _ in range(rows)],
            "label": np.isin(colour, ["red", "blue"]).astype(np.int64),
        }
    )
    source = root / "categorical.parquet"
    pq.write_table(table, source)
    inputs = {"noise": "numeric", "colour": "categorical", "shop": {"kind": "hashed", "buckets": 31}, "vec": "vector"}
    data = load_config(
        None, [f"data.source={source}", f"data.root={root / 'shards'}", f"data.inputs={json.dumps(inputs)}"]
    ).data
    return Path(prepare_dataset(data).dataset_dir)


def test_a_categorical_model_on_two_ranks_trains_the_weights_of_one_rank_with_twice_the_batch(exact_runs):
    """The exact update with embeddings (a categorical, a hashed id) and a vector: 2 ranks x 8 against 1 rank x 16
    on an uneven split; and the model served on raw rows predicts what evaluation scores."""
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor

    two, one = exact_runs["categorical_w2"], exact_runs["categorical_w1x2"]
    dataset = two.dataset_dir()
    train_rows = json.loads((dataset / "manifest.json").read_text())["splits"]["train"]["rows"]
    assert train_rows % 16, "pick rows whose last global step is short"
    weights_two, weights_one = two.model()["model"], one.model()["model"]
    assert any(name.startswith("embeddings.colour") for name in weights_two)
    assert two.model()["model_spec"]["model_kwargs"]["scale_embeddings"] is True  # the default a run records
    report("categorical 2 ranks x 8 vs 1 rank x 16", assert_same_weights(weights_two, weights_one, atol=EXACT))
    evaluation = evaluate_split(two.run_dir / "model.pt", dataset, "test", return_predictions=True)
    manifest = json.loads((dataset / "manifest.json").read_text())
    frame = pd.concat(
        [pq.read_table(dataset / shard["file"]).to_pandas() for shard in manifest["splits"]["test"]["shards"]]
    )
    served = Predictor.from_checkpoint(two.run_dir / "model.pt").predict(frame)
    labels = np.asarray(manifest["label_mapping"])
    assert (served == labels[evaluation.predictions]).all()


# Weighted rows and a multilabel label, each on a table the real prepare stage writes: (table builder, data
# overrides, the val metrics both world sizes must agree on). Uneven train splits: the last global step is short.
def _weighted_table(rng: np.random.Generator, rows: int) -> dict:
    x = rng.normal(size=(rows, 3))
    return {
        **{f"f{i}": x[:, i] for i in range(3)},
        # Weights 0.5 .. 3, not a function of the label: a denominator of rows instead of Σ w moves the weights.
        "w": rng.uniform(0.5, 3.0, size=rows),
        "label": (x @ [1.0, -1.0, 0.5] > 0).astype(np.int64),
    }


def _multilabel_table(rng: np.random.Generator, rows: int) -> dict:
    x = rng.normal(size=(rows, 3))
    names = np.array(["news", "sport", "tech"])
    hits = np.stack([x[:, 0] > 0, x[:, 1] > 0.3, x[:, 0] + x[:, 2] > 0], axis=1)
    return {**{f"f{i}": x[:, i] for i in range(3)}, "label": [list(names[row]) for row in hits]}


def _nulls_table(rng: np.random.Generator, rows: int) -> dict:
    """Numbers as real tables hold them: an int64 input with nulls (a missing one means label 1), a float
    input with NaN and nulls, and a heavy-tailed int64 amount (lognormal, a few of 10^9); the default inputs
    impute the nulls and add a missing indicator each, scale robustly and embed each number on its bins."""
    x = rng.normal(size=(rows, 2))
    visits = rng.integers(0, 50, size=rows)
    no_visits = rng.random(rows) < 0.2
    spend = np.where(rng.random(rows) < 0.1, np.nan, x[:, 1])
    amount = np.round(rng.lognormal(3.0, 1.5, size=rows)).astype(np.int64)
    amount[::37] = 10**9
    return {
        "visits": pa.array(visits, mask=no_visits),
        "spend": pa.array(spend, mask=rng.random(rows) < 0.05),
        "f0": x[:, 0],
        "amount": amount,
        "label": (no_visits | (x[:, 0] > 0.5)).astype(np.int64),
    }


def _users_table(rng: np.random.Generator, rows: int) -> dict:
    """A table as a user brings it, for the default model: an int64 count with nulls (informative), a float with
    NaN and nulls, a heavy-tailed int64 amount, a colour (strings: a categorical) and a binary label each moves."""
    x = rng.normal(size=(rows, 3))
    visits = rng.integers(0, 50, size=rows)
    no_visits = rng.random(rows) < 0.15
    amount = np.round(rng.lognormal(3.0, 1.5, size=rows)).astype(np.int64)
    colour = rng.choice(["red", "green", "blue", "grey", "teal"], size=rows)
    logit = x[:, 0] + 0.5 * np.isin(colour, ["red", "blue"]) + 0.02 * visits - 0.8 * no_visits
    logit += 0.3 * np.log1p(amount) - 1.2
    return {
        "visits": pa.array(visits, mask=no_visits),
        "spend": pa.array(np.where(rng.random(rows) < 0.1, np.nan, x[:, 1]), mask=rng.random(rows) < 0.05),
        "f0": x[:, 0],
        "amount": amount,
        "colour": colour,
        "label": (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64),
    }


USERS_INPUTS = {"visits": "numeric", "spend": "numeric", "f0": "numeric", "amount": "numeric", "colour": "categorical"}


def _datetime_table(rng: np.random.Generator, rows: int) -> dict:
    """Times as a source holds them: a zoned Parquet timestamp (the label: ordered at night, its own zone's
    clock) that also splits the rows by time, a date, and a naive timestamp with nulls (a missing indicator)."""
    start = np.datetime64("2024-01-01T00:00", "m")
    minutes = np.sort(rng.integers(0, 200 * 24 * 60, size=rows))
    ordered = start + minutes.astype("timedelta64[m]")
    shipped = ordered + rng.integers(60, 72 * 60, size=rows).astype("timedelta64[m]")
    hour = (minutes // 60) % 24
    return {
        "ordered": pa.array(ordered.astype("datetime64[us]"), pa.timestamp("us", tz="Europe/Oslo")),
        "day": pa.array(ordered.astype("datetime64[D]"), pa.date32()),
        "shipped": pa.array(shipped.astype("datetime64[us]"), mask=rng.random(rows) < 0.1),
        "basket": rng.gamma(2.0, 20.0, size=rows),
        "label": ((hour >= 22) | (hour < 6)).astype(np.int64),
    }


DATETIME_DATA = {
    "inputs": {"ordered": "datetime", "day": "datetime", "shipped": "datetime", "basket": "numeric"},
    "split": {"by": "time", "column": "ordered", "test": 0.12},  # val and test: the newest rows; 234 train rows
}
PREPARED_CASES = {
    "weighted_rows": (_weighted_table, {"weight": "w"}, ("val_accuracy", "val_macro_f1")),
    "multilabel": (_multilabel_table, {}, ("val_micro_f1", "val_macro_f1", "val_exact_match")),
    "numeric_nulls": (_nulls_table, {}, ("val_accuracy",)),
    "datetime": (_datetime_table, DATETIME_DATA, ("val_accuracy", "val_roc_auc")),
}
# table -> (builder, data overrides): the PREPARED_CASES' tables and the default model's (DEFAULT_RUNS).
PREPARED_TABLES = {case: (build, data) for case, (build, data, _) in PREPARED_CASES.items()}
PREPARED_TABLES["users"] = (_users_table, {"inputs": USERS_INPUTS})


def write_prepared_dataset(root: Path, case: str, rows: int = 300) -> Path:
    """``case``'s table through ``prepare_dataset`` (PREPARED_TABLES), with a train split that 16 does not divide."""
    from training.prepare.dataset import prepare_dataset

    build, data = PREPARED_TABLES[case]
    source = root / f"{case}.parquet"
    pq.write_table(pa.table(build(np.random.default_rng(11), rows)), source)
    overrides = [f"data.source={source}", f"data.root={root / 'shards'}"]
    overrides += [f"data.{key}={json.dumps(value)}" for key, value in data.items()]
    return Path(prepare_dataset(load_config(None, overrides).data).dataset_dir)


# --- the shared runs: all of one world size in ONE torchrun launch (tests/multi_case.py) ------------------

# run name -> (world size, dataset in exact_datasets, train settings): the exact-update pairs, and the runs
# whose files tests only read. The runs of one world size train one after another in one launch, so the table
# costs three launches (W = 1, 2, 3) however many cases it holds; each test compares its own runs' files, so a
# failure names the case. A new exact-update case adds its pair of runs here (and its dataset to
# exact_datasets). All record their row indices (DDPFLOW_RECORD_INDICES).
SCALED = {"hidden": HIDDEN, "scale_embeddings": True}
# The runs a user's config trains: only the epochs set, every other train setting (model, model_kwargs, optimizer,
# lr, batch) at its default, resolved for the dataset as the pipeline resolves it (``default_run_config``).
USERS_ROWS, DEFAULT_EPOCHS = 282, 6  # 211 train rows: the auto batch's last global step holds 3 (2 + 1 on 2 ranks)
SMOOTH = {"epochs": DEFAULT_EPOCHS, "model_kwargs": {"activation": "silu"}}  # the default but a smooth activation
DEFAULT_RUNS: dict[str, tuple[int, str, dict]] = {
    "defaults_w2": (2, "users", {"epochs": DEFAULT_EPOCHS}),
    "defaults_w1x2": (1, "users", {"epochs": DEFAULT_EPOCHS}),
    "smooth_w2": (2, "users", SMOOTH),
    "smooth_w1x2": (1, "users", SMOOTH),
}
EXACT_RUNS: dict[str, tuple[int, str, dict]] = {
    "two_ranks": (2, "dataset", {}),
    "uneven_w2": (2, "uneven", {"batch_size": 8}),
    # true, not auto: polls whether or not this machine has a core per rank to pin.
    "uneven_w2_poll": (2, "uneven", {"batch_size": 8, "cpu_poll_allreduce": True}),
    "uneven_w1x2": (1, "uneven", {"batch_size": 16}),
    "uneven_w3": (3, "uneven", {"batch_size": 5}),
    "uneven_w3_poll": (3, "uneven", {"batch_size": 5, "cpu_poll_allreduce": True}),
    "uneven_w1x3": (1, "uneven", {"batch_size": 15}),
    "accumulated": (2, "uneven", {"batch_size": 4, "grad_accum": 2}),
    **{
        name: (world, case, {"batch_size": batch, **train})
        for case, (_, train, _) in OBJECTIVE_CASES.items()
        if case != "default"  # the default objective is uneven_w2 / uneven_w1x2
        for name, world, batch in zip(objective_runs(case), (2, 1), (8, 16), strict=True)
    },
    # lr 0.002: Adam divides by the gradient's own size, so a unit with a near-zero gradient turns the
    # summation order's rounding into a step of up to lr; at 0.01 one bias of 32 moved 3.6e-5 apart.
    # scale_embeddings: a run's default (training/models/tabular.py: MLP_DEFAULTS); these launches skip the resolve.
    "categorical_w2": (2, "categorical", {"batch_size": 8, "lr": 0.002, "model_kwargs": SCALED}),
    "categorical_w1x2": (1, "categorical", {"batch_size": 16, "lr": 0.002, "model_kwargs": SCALED}),
    **{f"{case}_w2": (2, case, {"batch_size": 8}) for case in PREPARED_CASES},
    **{f"{case}_w1x2": (1, case, {"batch_size": 16}) for case in PREPARED_CASES},
    "regression": (2, "regression", {"epochs": 3, "batch_size": 32}),
    # TabM-mini (model_kwargs ensemble: k) over the default stem (bins, nulls): an option, exact like the mlp.
    "ensemble_w2": (2, "numeric_nulls", {"batch_size": 8, "model_kwargs": {"hidden": HIDDEN, "ensemble": 8}}),
    "ensemble_w1x2": (1, "numeric_nulls", {"batch_size": 16, "model_kwargs": {"hidden": HIDDEN, "ensemble": 8}}),
    # Every setting at its default but the epochs (DEFAULT_RUNS): batch auto is 4 per rank on 2 ranks, 8 on 1.
    **DEFAULT_RUNS,
    # Last of its launch: the resume test's reference, bit for bit (a case trains what its own launch would).
    "dropout_uninterrupted": (2, "uneven", DROPOUT_RESUME),
}


@pytest.fixture(scope="module")
def exact_datasets(dataset, uneven, tmp_path_factory) -> dict[str, Path]:
    rows = {"train": UNEVEN_ROWS, "val": UNEVEN_VAL_ROWS, "test": 16}
    datasets = {"dataset": dataset, "uneven": uneven}
    for case, (classes, _, _) in OBJECTIVE_CASES.items():
        if case != "default":
            root = tmp_path_factory.mktemp(case)
            datasets[case] = write_dataset(root, rows, seed=1, name=f"fp-{case}", classes=classes)
    datasets["categorical"] = write_categorical_dataset(tmp_path_factory.mktemp("categorical"))
    for case in PREPARED_CASES:
        datasets[case] = write_prepared_dataset(tmp_path_factory.mktemp(case), case)
    datasets["regression"] = write_regression_dataset(tmp_path_factory.mktemp("regression"))
    datasets["users"] = write_prepared_dataset(tmp_path_factory.mktemp("users"), "users", USERS_ROWS)
    return datasets


class ExactRuns:
    """Run name -> Launch, each world size launched on the first read of one of its runs (so a test's share of
    the launches is bounded, and `-k` on one world size launches only that one); a read asserts that the
    run's launch succeeded."""

    def __init__(self, datasets: dict[str, Path], root: Path):
        self.datasets, self.root, self.launched = datasets, root, {}

    def __getitem__(self, name: str) -> Launch:
        world = EXACT_RUNS[name][0]
        if name not in self.launched:
            self.launched |= self._launch(world)
        return succeeded(self.launched[name])

    def _launch(self, world: int) -> dict[str, Launch]:
        cases = {
            name: (run_config(name, world, self.datasets[data], train), self.datasets[data])
            for name, (size, data, train) in EXACT_RUNS.items()
            if size == world
        }
        root = self.root / f"w{world}"
        root.mkdir()
        first_config = next(iter(cases.values()))[0]
        env = production_env(first_config, root, DDPFLOW_RECORD_INDICES="1")
        results = launch_cases(root, cases, env)
        return {name: Launch(result.run_dir, result.returncode, result.output) for name, result in results.items()}


def run_config(name: str, world: int, dataset_dir: Path, train: dict) -> PipelineConfig:
    """An EXACT_RUNS entry's config: the test settings of ``job_config``, or for DEFAULT_RUNS ``default_run_config``."""
    return default_run_config(world, dataset_dir, **train) if name in DEFAULT_RUNS else job_config(world, **train)


def default_run_config(nproc: int, dataset_dir: Path, **train) -> PipelineConfig:
    """A user's config on ``nproc`` ranks: ``train`` set, the launch's fields as every case of the launch has them
    (``LAUNCH_FIELDS``), every other train setting at its default, resolved for the dataset (training/resolve.py)."""
    from tests.multi_case import LAUNCH_FIELDS
    from training.resolve import resolve_for_data

    launch = {field: getattr(job_config(nproc).train, field) for field in LAUNCH_FIELDS}
    config = load_config(None, [f"train.{key}={json.dumps(value)}" for key, value in {**launch, **train}.items()])
    return resolve_for_data(config, read_manifest(dataset_dir), nproc)


@pytest.fixture(scope="module")
def exact_runs(exact_datasets, tmp_path_factory) -> ExactRuns:
    """Every EXACT_RUNS entry: one launch per world size."""
    return ExactRuns(exact_datasets, tmp_path_factory.mktemp("exact"))


@pytest.mark.parametrize("case", PREPARED_CASES)
def test_weighted_rows_multilabel_and_nulls_on_two_ranks_train_the_weights_of_one_rank_with_twice_the_batch(
    case, exact_runs
):
    """The exact update where Σ w is not the row count (data.weight 0.5..3), for a sigmoid per label
    (a list<string> label) and for numeric inputs holding nulls (imputed, with missing indicators): 2 ranks x 8
    against 1 rank x 16, the last global step short."""
    two, one = exact_runs[f"{case}_w2"], exact_runs[f"{case}_w1x2"]
    dataset = two.dataset_dir()
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["splits"]["train"]["rows"] % 16, "pick rows whose last global step is short"
    report(
        f"{case}: 2 ranks x 8 vs 1 rank x 16", assert_same_weights(two.model()["model"], one.model()["model"], EXACT)
    )
    _, _, reported = PREPARED_CASES[case]
    for a, b in zip(two.metrics(), one.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
        for name in reported:
            assert a[name] == pytest.approx(b[name], abs=2 / manifest["splits"]["val"]["rows"]), name
    if case == "multilabel":
        assert two.model()["objective"]["name"] == "multilabel"
        assert two.model()["model_spec"]["n_outputs"] == 3
        assert_multilabel_serving_equals_evaluation(two.run_dir / "model.pt", dataset, manifest)
    if case == "datetime":  # each time as its DENSE block (cycles, time since the origin, missing indicator)
        shapes = {entry["name"]: entry["shape"] for entry in two.model()["model_spec"]["inputs"]}
        assert shapes == {"ordered": [9], "day": [7], "shipped": [10], "basket": []}
        # day's and shipped's times since the start go through the numeric embeddings after basket, their steps
        # trained alike; ordered, the time split's column, keeps its time as one number (no bins).
        binned = {entry["name"]: entry.get("bins_column") for entry in two.model()["model_spec"]["inputs"]}
        assert binned == {"ordered": None, "day": 6, "shipped": 8, "basket": None}
        steps = two.model()["model"]["numeric_embeddings.steps"]
        assert steps.shape[0] == 3 and bool((steps[1:].abs().sum(dim=(1, 2)) > 0).all())
        assert manifest["extra"]["split"]["column"] == "ordered" and manifest["splits"]["test"]["rows"] > 0
    if case == "numeric_nulls":
        spec = two.model()["model_spec"]
        assert spec["n_features"] == 6  # visits, spend, f0, amount and two missing indicators
        # The default stem: each number embedded on its train quantile bins (robustly scaled: within (-3, 3)),
        # and its piecewise-linear steps trained (they start at zero), equally on 2 ranks and on 1.
        bins = {entry["name"]: entry["bins"] for entry in spec["inputs"]}
        assert len(bins["amount"]) > 40 and max(map(abs, bins["amount"])) <= 3.0 and two.model()["feature_clip"][0]
        assert two.model()["model"]["numeric_embeddings.steps"].abs().sum() > 0
        assert_serving_with_nulls_equals_evaluation(two.run_dir / "model.pt", dataset, manifest)


def test_an_ensemble_on_two_ranks_trains_the_weights_of_one_rank_with_twice_the_batch(exact_runs):
    """``ensemble: 8`` (TabM-mini: a random-sign scale per member, shared layers, 8 heads, each member trained on
    its own loss) on numeric inputs with nulls and their embeddings: 2 ranks x 8 against 1 rank x 16, the last
    global step short. The members' scales start from the seed, the same on every rank, so the world size does
    not change the weights. Served, its probabilities are the mean of its members', as the evaluation scored."""
    two, one = exact_runs["ensemble_w2"], exact_runs["ensemble_w1x2"]
    weights_two, weights_one = two.model()["model"], one.model()["model"]
    assert weights_two["adapter.scale"].shape[0] == 8
    assert weights_two["net.2.weight"].shape[:2] == (8, HIDDEN[-1])  # 8 heads after the shared hidden layer
    # The members still differ after training: 8 copies of one model would make the option a no-op.
    heads = weights_two["net.2.weight"]
    assert (heads - heads.mean(dim=0)).abs().max() > 1e-3
    report("ensemble 8: 2 ranks x 8 vs 1 rank x 16", assert_same_weights(weights_two, weights_one, EXACT))
    for a, b in zip(two.metrics(), one.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    dataset = two.dataset_dir()
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert_serving_with_nulls_equals_evaluation(two.run_dir / "model.pt", dataset, manifest)
    from training.inference.predict import Predictor

    predictor = Predictor.from_checkpoint(two.run_dir / "model.pt")
    frame = pq.read_table(dataset / manifest["splits"]["test"]["shards"][0]["file"]).to_pandas()
    with torch.inference_mode():
        members = predictor.model(predictor.batch_inputs(frame))
    assert members.shape == (len(frame), 8, 2)  # the model returns every member; the prediction is their mean
    served = predictor.predict_proba(frame).to_numpy()
    np.testing.assert_allclose(served, members.softmax(dim=-1).mean(dim=1).numpy(), atol=1e-6)


DEFAULT_EXACT = 1e-4  # a smooth activation under AdamW: its bar (docs/training.md, "What the exact update promises")
DEFAULT_SAME_TRAINING = 5e-3  # ReLU under AdamW: the epochs' losses, relative (measured 1.3e-3; weights unbounded)


def test_the_default_model_and_optimizer_on_two_ranks_train_as_one_rank_with_twice_the_batch(exact_runs):
    """A user's config, only the epochs set: the default mlp (``defaults_to_record``: 8 members over the numeric
    embeddings on this small table, ReLU) and AdamW with its defaults, 6 epochs of auto batches (4 per rank on
    2 ranks, 8 on 1; the last global step of each epoch 3 rows: 2 on rank 0, 1 on rank 1).
    With ``activation: silu`` (nothing else changed) the last epoch's weights of 2 ranks x 4 and 1 rank x 8 agree
    within DEFAULT_EXACT, and so do the epochs' losses and the weights model.pt selected. With the default ReLU
    the two are the same training (every epoch's losses within DEFAULT_SAME_TRAINING, the same epoch selected),
    while a unit that float rounding puts on the other side of ReLU's kink moves the weights further apart."""
    from training.models.tabular import defaults_to_record

    rows = read_manifest(exact_runs["defaults_w2"].dataset_dir()).rows("train")
    assert rows % 8 == 3
    for pair in (("defaults_w2", "defaults_w1x2"), ("smooth_w2", "smooth_w1x2")):
        trained = [TrainJob.read(exact_runs[n].run_dir / "train_config.json").config.train for n in pair]
        assert [train.batch_size for train in trained] == [4, 8]
        for train in trained:
            assert train.model == "mlp" and train.optimizer == "adamw" and train.optimizer_kwargs == {}
            assert train.lr == 1e-3 and train.model_kwargs["ensemble"] == 8  # TabM's members on a small table
            smooth = {"activation": "silu"} if pair[0] == "smooth_w2" else {}
            assert train.model_kwargs == {**defaults_to_record(rows), **smooth}
    two, one = exact_runs["smooth_w2"], exact_runs["smooth_w1x2"]
    assert "numeric_embeddings.steps" in two.model()["model"]
    last = [torch.load(run.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"] for run in (two, one)]
    difference = assert_same_weights(*last, DEFAULT_EXACT)
    report(f"default model with SiLU, {DEFAULT_EPOCHS} epochs: 2 ranks x 4 vs 1 rank x 8 (last step 3)", difference)
    for a, b in zip(two.metrics(), one.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert two.metrics()[-1]["selected_epoch"] == one.metrics()[-1]["selected_epoch"]
    assert_same_weights(two.model()["model"], one.model()["model"], DEFAULT_EXACT)
    two, one = exact_runs["defaults_w2"], exact_runs["defaults_w1x2"]
    for a, b in zip(two.metrics(), one.metrics(), strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=DEFAULT_SAME_TRAINING)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=DEFAULT_SAME_TRAINING)
    assert two.metrics()[-1]["selected_epoch"] == one.metrics()[-1]["selected_epoch"]
    last = [torch.load(run.run_dir / "checkpoints" / "last.pt", weights_only=True)["model"] for run in (two, one)]
    relu = max((a.float() - b.float()).abs().max().item() for a, b in zip(last[0].values(), last[1].values()))
    report(f"default model (ReLU), {DEFAULT_EPOCHS} epochs: 2 ranks x 4 vs 1 rank x 8, weights", relu)


@pytest.mark.server  # `mlflow models serve`
def test_a_multilabel_model_served_over_http_answers_label_lists_and_probabilities_as_evaluated(
    exact_runs, mlflow_store, tmp_path
):
    """The multilabel run's model.pt logged as the pyfunc and served by `mlflow models serve`: raw rows in over
    HTTP, each row's list of original labels and a sigmoid probability per label out, what the evaluation and
    the in-process Predictor give."""
    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri
    from devtools.model_server import invocations
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor
    from training.inference.serving import log_pyfunc_model, predictions

    run = exact_runs["multilabel_w2"]
    dataset, model_path = run.dataset_dir(), run.run_dir / "model.pt"
    manifest = json.loads((dataset / "manifest.json").read_text())
    frame = pd.concat(
        [pq.read_table(dataset / shard["file"]).to_pandas() for shard in manifest["splits"]["test"]["shards"]]
    )
    rows = frame[["f0", "f1", "f2"]].head(20)
    tracking_uri, artifacts = mlflow_store
    with use_tracking_uri(tracking_uri):
        experiment = mlflow.MlflowClient().create_experiment("multilabel-serve", artifact_location=artifacts)
        run_id = mlflow.MlflowClient().create_run(experiment).info.run_id
        model_uri = log_pyfunc_model(model_path, rows, run_id=run_id).model_uri
    answered = invocations(model_uri, tracking_uri, rows, tmp_path, os.environ.copy(), {"output": "probabilities"})

    labels = np.asarray(manifest["label_mapping"])
    evaluated = evaluate_split(model_path, dataset, "test", return_predictions=True).predictions[:20].astype(bool)
    assert [sorted(row["label"]) for row in answered] == [sorted(labels[hits].tolist()) for hits in evaluated]
    served = np.array([[row[f"probability_{label}"] for label in labels] for row in answered])
    assert ((served > 0.5) == evaluated).all()
    in_process = predictions(Predictor.from_checkpoint(model_path), rows, "probabilities")
    np.testing.assert_allclose(served, in_process[[f"probability_{label}" for label in labels]], rtol=1e-6)


def assert_serving_with_nulls_equals_evaluation(model_path: Path, dataset: Path, manifest: dict) -> None:
    """The test split's raw rows, nulls and all, served as the evaluation scored them."""
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor

    evaluation = evaluate_split(model_path, dataset, "test", return_predictions=True)
    frame = pd.concat(
        [pq.read_table(dataset / shard["file"]).to_pandas() for shard in manifest["splits"]["test"]["shards"]]
    )
    assert frame["visits"].isna().any() and frame["amount"].max() >= 10**9
    predictor = Predictor.from_checkpoint(model_path)
    served = predictor.predict(frame)
    assert (served == np.asarray(manifest["label_mapping"])[evaluation.predictions]).all()
    # The scores too: the served probabilities rank the rows as the evaluation's log-odds did (its ROC AUC).
    from sklearn.metrics import roc_auc_score

    probability = predictor.predict_proba(frame).iloc[:, -1].to_numpy()
    assert roc_auc_score(frame["label"], probability) == pytest.approx(evaluation.metrics["test_roc_auc"], abs=1e-6)
    assert evaluation.metrics["test_accuracy"] > 0.7  # the missing visits are learnt through the indicator


def assert_multilabel_serving_equals_evaluation(model_path: Path, dataset: Path, manifest: dict) -> None:
    """The test split's evaluation (micro/macro F1, exact match) and the Predictor on its raw rows agree: each
    row's list of original labels and a sigmoid probability per label."""
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor
    from training.inference.serving import predictions

    evaluation = evaluate_split(model_path, dataset, "test", return_predictions=True)
    assert {"test_micro_f1", "test_macro_f1", "test_exact_match", "test_loss"} <= set(evaluation.metrics)
    assert evaluation.confusion_matrix is None and evaluation.class_labels == ["news", "sport", "tech"]
    assert evaluation.predictions.shape == (manifest["splits"]["test"]["rows"], 3)
    assert sum(row["support"] for row in evaluation.per_class.values()) == evaluation.targets.sum()
    from ddpflow.tracking.plots import evaluation_figure

    assert evaluation_figure(evaluation)[1] == "per_label_recall.png"
    frame = pd.concat(
        [pq.read_table(dataset / shard["file"]).to_pandas() for shard in manifest["splits"]["test"]["shards"]]
    )
    predictor = Predictor.from_checkpoint(model_path)
    labels = np.asarray(manifest["label_mapping"])
    expected = [labels[row].tolist() for row in evaluation.predictions.astype(bool)]
    assert [list(row) for row in predictor.predict(frame)] == expected
    # The exact-match metric is the share of rows whose predicted set is the true one.
    truth = [sorted(labels[row].tolist()) for row in evaluation.targets.astype(bool)]
    exact = np.mean([sorted(p) == t for p, t in zip(expected, truth, strict=True)])
    assert evaluation.metrics["test_exact_match"] == pytest.approx(exact)
    served = predictions(predictor, frame, "probabilities")
    assert [list(row) for row in served["label"]] == expected
    probabilities = served[[f"probability_{label}" for label in labels]].to_numpy()
    assert ((probabilities > 0.5) == evaluation.predictions.astype(bool)).all()


@pytest.mark.parametrize(
    ("ranks", "single"),
    [("uneven_w2", "uneven_w1x2"), ("uneven_w3", "uneven_w1x3")],
)
def test_metrics_count_every_row_once_and_agree_with_one_rank(ranks, single, exact_runs):
    """Per-epoch losses and validation of the W-rank run equal the one-rank run's: each row is counted once
    (padding excluded) and each rank evaluates its own unpadded slice of the val split."""
    many, one = exact_runs[ranks].metrics(), exact_runs[single].metrics()
    assert [r["epoch"] for r in many] == [r["epoch"] for r in one] == list(range(EPOCHS))
    for a, b in zip(many, one):
        assert a["train_samples"] == b["train_samples"] == UNEVEN_ROWS
        assert a["val_samples"] == b["val_samples"] == UNEVEN_VAL_ROWS
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
        # The weights agree to ~1e-7: a prediction on a decision boundary is the most that could flip.
        assert abs(a["val_accuracy"] - b["val_accuracy"]) <= 1 / UNEVEN_VAL_ROWS
        assert a["weights_in_sync"] is True
    assert many[-1]["val_loss"] != many[0]["val_loss"]  # it trained: the comparison is not of two constants


# --- resume, warm start, several nodes, faults -------------------------------------------------------------


def test_a_failed_launch_and_a_killed_rank_resume_at_their_epoch_to_the_uninterrupted_weights(
    uneven, exact_runs, tmp_path
):
    """``Trainer.state_dict()`` round-trips: a Trainer resumed from last.pt ends with the uninterrupted run's
    weights, bit for bit (tolerance 0). With dropout (each rank's RNG matters). Launch 1 fails at the start of
    epoch 1 (a permanent error: the pipeline's retry path); launch 2 resumes after epoch 0, and rank 1 is
    SIGKILLed in epoch 2, so torchrun restarts the group, which resumes after epoch 1. Every epoch is completed
    exactly once overall. The uninterrupted run is one case of the shared 2-rank launch, after other cases in
    the same processes: the tolerance 0 also shows that a case trains what a launch of its own would."""
    settings = DROPOUT_RESUME
    epochs = settings["epochs"]
    reference = exact_runs["dropout_uninterrupted"]
    run_dir = tmp_path / "resumed"
    recorded = {"DDPFLOW_RECORD_INDICES": "1"}

    failed = launch(run_dir, uneven, env={**recorded, "DDPFLOW_FAULT": "raise:rank=1:epoch=1"}, **settings)
    assert failed.returncode != 0 and "injected fault" in failed.output
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1

    kill = {**recorded, "DDPFLOW_FAULT": "kill:rank=1:epoch=2:step=3"}
    resumed = succeeded(launch(run_dir, uneven, max_restarts=1, env=kill, **settings))
    assert (run_dir / ".fault-kill-done").exists()
    for epoch in range(epochs):  # a restart that began before its checkpoint's epoch would add a second pass
        rows = [row for rank in range(2) for row in resumed.indices(rank, epoch)]
        assert sorted(rows) == list(range(UNEVEN_ROWS))
    assert resumed.output.count("after 1 epoch(s)") == 1 and resumed.output.count("after 2 epoch(s)") == 1
    records = resumed.metrics()
    assert [r["epoch"] for r in records] == [0, 1, 2]  # nothing logged twice
    assert [r["restart_count"] for r in records] == [0, 0, 1]
    difference = assert_same_weights(reference.model()["model"], resumed.model()["model"], atol=0)
    report("resumed twice (dropout model) vs uninterrupted", difference)


def test_two_nodes_on_one_machine_train_like_one_node(two_ranks, dataset, tmp_path):
    """Two torchrun agents (one rank each) rendezvous over c10d. To save a launch they also accumulate
    gradients over 2 micro-batches of BATCH/2 (no_sync on the first): the same rows per optimizer step."""
    run_dir = tmp_path / "two_nodes"
    config = job_config(nproc=1, batch_size=BATCH // 2, grad_accum=2)
    job_path = write_job(run_dir, dataset, config)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "0",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "two-nodes",
                # Both agents run on this host: say which one hosts the store.
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "-m",
                "training.train",
                "--config",
                str(job_path),
            ],  # fmt: skip
            cwd=REPO,
            env=production_env(config, run_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)[-4000:]
    result = Launch(run_dir, 0, "".join(outputs))
    assert all(
        r["weights_in_sync"] and r["world_size"] == 2 and r["train_samples"] == TRAIN_ROWS for r in result.metrics()
    )
    assert_same_weights(two_ranks.model()["model"], result.model()["model"], atol=EXACT)


def test_padded_sampler_rows_count_once_on_a_prepared_dataset(two_ranks, tmp_path):
    """prepare_dataset's own output: its train split (odd size here) is not divisible by the world size."""
    from training.prepare.dataset import prepare_dataset

    data = load_config(
        None,
        [
            "data.source=synthetic://classification?rows=1201&features=5&classes=3&seed=3",
            f"data.root={tmp_path / 'shards'}",
        ],
    ).data
    prepared = prepare_dataset(data)
    train_rows = prepared.manifest.rows("train")
    assert train_rows % 2 == 1, "this test needs an odd train split (change the synthetic rows)"
    # A warm start from a model of other features is refused with a message, and training starts fresh.
    result = succeeded(
        launch(
            tmp_path / "run",
            prepared.dataset_dir,
            epochs=1,
            batch_size=50,
            env={"DDPFLOW_RECORD_INDICES": "1"},
            init_weights=two_ranks.run_dir / "model.pt",
        )
    )
    assert "training from scratch" in result.output
    rows = result.indices(0, 0) + result.indices(1, 0)
    assert sorted(rows) == list(range(train_rows))
    assert result.metrics()[0]["train_samples"] == train_rows
    assert result.metrics()[0]["val_samples"] == prepared.manifest.rows("val")


def test_a_raising_rank_fails_the_launch_with_its_root_cause(two_ranks, dataset, tmp_path):
    # Also a warm start from a matching model.pt (the launch fails before it could train further).
    result = launch(
        tmp_path / "raised",
        dataset,
        env={"DDPFLOW_FAULT": "raise:rank=1:epoch=0"},
        init_weights=two_ranks.run_dir / "model.pt",
    )
    assert "warm start: weights from" in result.output
    assert result.returncode != 0
    assert "injected fault" in result.output
    assert not (tmp_path / "raised" / "model.pt").exists()


def test_a_slow_checkpoint_write_waits_for_checkpoint_timeout_not_the_collective_one(dataset, tmp_path):
    """Rank 0 takes 18 s to write last.pt, longer than train.collective_timeout_s=10: rank 1 waits at the
    checkpoint barrier, under train.checkpoint_timeout_s, and the run completes."""
    slow = {"DDPFLOW_FAULT": "slow_checkpoint:rank=0:epoch=0:seconds=18"}
    result = succeeded(
        launch(tmp_path / "slow", dataset, epochs=1, collective_timeout_s=10, checkpoint_timeout_s=300, env=slow)
    )
    assert "last.pt 18s late" in result.output
    assert torch.load(tmp_path / "slow" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1


def test_a_checkpoint_write_beyond_checkpoint_timeout_fails_naming_it(dataset, tmp_path):
    slow = {"DDPFLOW_FAULT": "slow_checkpoint:rank=0:epoch=0:seconds=60"}
    result = launch(tmp_path / "stuck", dataset, epochs=1, checkpoint_timeout_s=4, env=slow)
    assert result.returncode != 0
    assert "CheckpointTimeout" in result.output
    assert "rank 1: rank 0 did not finish writing" in result.output
    assert "train.checkpoint_timeout_s=4s" in result.output


# --- target standardisation ------------------------------------------------------------------------------


def write_regression_dataset(root: Path) -> Path:
    """write_regression_source's table through the real prepare stage (data.label=price)."""
    from training.prepare.dataset import prepare_dataset

    source = write_regression_source(root / "prices.parquet")
    data = load_config(None, [f"data.source={source}", "data.label=price", f"data.root={root / 'shards'}"]).data
    return Path(prepare_dataset(data).dataset_dir)


def write_regression_source(path: Path, rows: int = 1500, seed: int = 7) -> Path:
    """Raw columns whose target has mean ~150 and std ~10: far from what an untrained network outputs."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(rows, 4))
    target = 150.0 + 10.0 * (z @ np.array([0.6, -0.5, 0.4, 0.48])) + rng.normal(scale=0.5, size=rows)
    frame = pd.DataFrame({f"x{i}": z[:, i] * (i + 1) * 3.0 + 40.0 * i for i in range(4)})
    frame["price"] = target
    frame.to_parquet(path)
    return path


def test_regression_trains_on_the_standardised_target_and_reports_the_original_scale(exact_runs):
    from training.inference.evaluate import evaluate_split
    from training.inference.predict import Predictor

    result = exact_runs["regression"]  # 2 ranks, 3 epochs of 32 rows
    dataset_dir = result.dataset_dir()
    manifest = read_manifest(dataset_dir)
    train_targets = pd.concat(pq.read_table(path).to_pandas() for path in manifest.split_files(dataset_dir, "train"))[
        "price"
    ].to_numpy(np.float64)
    assert manifest.label_mean == pytest.approx(train_targets.mean(), rel=1e-9)
    assert manifest.label_std == pytest.approx(train_targets.std(), rel=1e-9)
    assert 140 < manifest.label_mean < 160

    final = result.model()
    assert (final["label_mean"], final["label_std"]) == (manifest.label_mean, manifest.label_std)

    # Training's validation and the evaluate stage's agree, both on the original scale.
    last = result.metrics()[-1]
    evaluated = evaluate_split(result.run_dir / "model.pt", dataset_dir, "val").metrics
    assert last["val_rmse"] == pytest.approx(evaluated["val_rmse"], rel=1e-4)
    assert last["val_loss"] == pytest.approx(evaluated["val_loss"], rel=1e-4)
    assert last["val_rmse"] < 0.3 * manifest.label_std  # learned in 3 epochs: it never had to find the mean

    test = evaluate_split(result.run_dir / "model.pt", dataset_dir, "test", return_predictions=True)
    assert test.metrics["test_rmse"] < 0.3 * manifest.label_std
    frame = pd.concat(pq.read_table(p).to_pandas() for p in manifest.split_files(dataset_dir, "test"))
    served = Predictor.from_checkpoint(result.run_dir / "model.pt").predict(frame[manifest.features])
    np.testing.assert_allclose(served, test.predictions, rtol=1e-6)
    assert abs(float(np.mean(served)) - float(frame["price"].mean())) < 0.3 * manifest.label_std


def test_ranks_die_with_a_killed_agent(dataset, tmp_path):
    """PR_SET_PDEATHSIG: SIGKILLing torchrun (which cannot then stop its workers) still ends the ranks."""
    import psutil

    run_dir = tmp_path / "orphans"
    config = job_config(collective_timeout_s=600)
    job_path = write_job(run_dir, dataset, config)
    _, torchrun_command = production_launcher()
    agent = subprocess.Popen(
        torchrun_command(config, job_path, gpus=0),
        cwd=REPO,
        env=production_env(config, run_dir, DDPFLOW_FAULT="hang:rank=0:epoch=0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks = []
    try:
        marker = run_dir / ".fault-hang-done"
        deadline = time.monotonic() + 180
        while not marker.exists() and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "rank 0 never reached the hang"
        ranks = psutil.Process(agent.pid).children()
        assert len(ranks) == 2
        agent.kill()
        agent.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"orphaned ranks: {alive}"
    finally:
        for process in ranks:
            if process.is_running():
                process.kill()
        if agent.poll() is None:
            agent.kill()
