"""Batch scoring (`ddpflow score`, training/inference/batch_scoring.py) on a mixed table with real torchrun ranks and
a real SQLite MLflow registry: ONE shared 2-rank scoring of the champion (``NAME@champion``), checked many ways (the
pyfunc's answer on the same raw rows, every row exactly once, the output layout, the manifest, the MLflow run), and
the ways a scoring must not end (a stop and a resume, another model's output, bad input).

The model: a mixed table (every numeric source type, nulls, strings, an unseen category, a hashed id, a vector:
tests/flows/test_mixed_inputs.py's ``churn_table``) prepared for real, and a model.pt trained as the trainer writes
it (tests/ddpflow/tracking/test_registry.py's ``train_typed_model``), registered through the gate as @champion.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.ddpflow.tracking.test_registry import DDP, PREFECT
from tests.flows.test_mixed_inputs import INPUTS, churn_table
from tests.manifest_datasets import train_typed_model
from training.core.errors import DataError

REPO = Path(__file__).resolve().parents[2]
ROWS = 2400
pytestmark = pytest.mark.torchrun


MOVED = ("plan", "spend")  # what moved in the shared launch's table (``source_files(moved=True)``)


def source_files(directory: Path, rows: int = ROWS, moved: bool = False) -> Path:
    """The table as 3 Parquet files, two with small row groups (gathered into ranges), the last one row group (as
    pyarrow writes a file by default: cut into one piece per rank); one country unseen in training, last rows.
    ``moved``: today's input has moved from the training data's: half the plans are a new "enterprise" plan and
    spend is 3 times what it was (the other columns are drawn as the training table's)."""
    table = churn_table(rows, seed=7)
    country = table["country"].to_pylist()
    country[-5:] = ["atlantis"] * 5
    table = table.set_column(table.schema.get_field_index("country"), "country", pa.array(country))
    if moved:
        plan = np.where(np.arange(rows) % 2 == 0, "enterprise", table["plan"].to_numpy(zero_copy_only=False))
        table = table.set_column(table.schema.get_field_index("plan"), "plan", pa.array(plan))
        spend = pa.array(table["spend"].to_numpy() * 3)
        table = table.set_column(table.schema.get_field_index("spend"), "spend", spend)
    directory.mkdir(parents=True, exist_ok=True)
    third = rows // 3
    for index, start in enumerate(range(0, rows, third)):
        groups = third if index == 2 else 150
        pq.write_table(table.slice(start, third), directory / f"day-{index}.parquet", row_group_size=groups)
    return directory


def cli(*args: str, env: dict | None = None, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "score", *args], cwd=cwd, env=env or cli_env(), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def score_here(champion: dict, **settings):
    """``score_table`` in this process (what `ddpflow score` calls), with ``score.*`` settings over the config's."""
    from ddpflow.scoring import score_table

    config = champion["config"]
    return score_table(config.model_copy(update={"score": config.score.model_copy(update=settings)}), on_line=print)


def as_registered(model_path: Path, identity: dict[str, str]):
    """``ScoreRequest.read_model`` for a model.pt standing for a registered version (``identity``)."""
    from ddpflow.tracking.scoring import ScoringModel
    from training.inference.model_file import ModelFile

    name, version, uri = identity["name"], identity["version"], identity["uri"]
    return lambda: ScoringModel(Path(model_path), name, version, uri, ModelFile.read(model_path))


def cli_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("DDPFLOW_")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _migrated_mlflow_db) -> dict:
    """A model.pt trained on the mixed table, its prepared dataset, and the config (not registered yet)."""
    return train_scorer(tmp_path_factory.mktemp("scoring"), _migrated_mlflow_db)


def train_scorer(root: Path, migrated_mlflow_db: Path) -> dict:
    """``trained``'s body, for other modules' fixtures (tests/flows/test_scoring_slurm.py)."""
    from training.core.config import PipelineConfig
    from training.prepare.dataset import prepare_dataset

    shutil.copy(migrated_mlflow_db, root / "mlflow.db")
    train_source = root / "train.parquet"
    pq.write_table(churn_table(2000, seed=0), train_source)
    config = PipelineConfig.model_validate(
        {
            "data": {"source": str(train_source), "root": str(root / "shards"), "label": "churned",
                     "key": "customer_id", "inputs": INPUTS},
            "registry": {"model_name": "scorer"},
            "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "scoring",
                       "artifact_location": (root / "mlartifacts").as_uri()},
            "train": {"nproc_per_node": 2, "backend": "gloo", "collective_timeout_s": 60},
            "score": {"nproc_per_node": 2, "batch_size": 256},
        }
    )  # fmt: skip
    dataset = prepare_dataset(config.data).dataset_dir
    # lr 0.01: at 0.05 the mlp with its numeric embeddings (the default) settles on the majority class here
    model_path = train_typed_model(dataset, root / "run" / "model.pt", steps=100, lr=0.01)
    return {"root": root, "config": config, "dataset": dataset, "model_path": model_path}


@pytest.fixture(scope="module")
def champion(trained) -> dict:
    """The trained model registered as @champion, and the config that names it."""
    from ddpflow.tracking.registration import register_candidate
    from ddpflow.tracking.runs import start_pipeline_run
    from training.core.manifest import read_manifest
    from training.inference.evaluate import evaluate_split

    root, config, dataset, model_path = (trained[key] for key in ("root", "config", "dataset", "model_path"))
    manifest = read_manifest(dataset)
    run_id = start_pipeline_run(config, "run", PREFECT, manifest.fingerprint, manifest, DDP, dataset_dir=dataset)
    metrics = evaluate_split(model_path, dataset).metrics
    decision = register_candidate(config, run_id, str(model_path), str(dataset), metrics, config.mlflow.tracking_uri)
    assert decision.version is not None, decision
    config_file = root / "score.yaml"
    config_file.write_text(json.dumps(config.model_dump(mode="json")))  # JSON is YAML
    return {"root": root, "config": config, "config_file": config_file, "model_path": model_path}


def with_bad_row(directory: Path) -> tuple[Path, int]:
    """The source with an infinite ``tenure`` in one row of its second file (inf stops the model: a refused row)."""
    bad = directory / "day-1.parquet"
    table = pq.read_table(bad)
    tenure = table["tenure"].to_numpy().copy()
    tenure[17] = np.inf
    pq.write_table(table.set_column(table.schema.get_field_index("tenure"), "tenure", pa.array(tenure)), bad,
                   row_group_size=150)  # fmt: skip
    return bad, 17


@pytest.fixture(scope="module")
def scored(champion) -> dict:
    """THE shared launch: `ddpflow score` of NAME@champion on 2 ranks, with one refused row (on_invalid: skip), of
    a table whose plan and spend moved from the training data's (``MOVED``)."""
    root = champion["root"]
    source = source_files(root / "today", moved=True)
    bad_file, bad_row = with_bad_row(source)
    output = root / "scores"
    done = cli("--config", str(champion["config_file"]), "--source", str(source), "--output", str(output), "--json",
               "--set", "score.on_invalid=skip", cwd=root)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {"source": source, "output": output, "summary": json.loads(done.stdout), "stderr": done.stderr,
            "bad_file": bad_file, "bad_row": bad_row}  # fmt: skip


def read_scores(output: Path) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(part) for part in sorted(output.glob("part-*.parquet"))], ignore_index=True)


def test_scores_equal_the_pyfunc_on_the_same_raw_rows(champion, scored):
    import mlflow

    from ddpflow.tracking.runs import use_tracking_uri

    raw = pd.read_parquet(scored["source"])  # the source's own dtypes: int64, bool, Int64 with nulls, strings, lists
    assert raw["children"].isna().any() and (raw["country"] == "atlantis").sum() == 5
    scores = read_scores(scored["output"])
    good = raw[np.isfinite(raw["tenure"])]
    with use_tracking_uri(champion["config"].mlflow.tracking_uri):
        served = mlflow.pyfunc.load_model("models:/scorer@champion")
    expected = served.predict(good[list(INPUTS)], params={"output": "probabilities"})
    assert list(scores.columns) == ["customer_id", "prediction", "probability_0", "probability_1"]
    np.testing.assert_array_equal(scores["customer_id"], good["customer_id"])  # in the source's order
    np.testing.assert_array_equal(scores["prediction"], expected["label"])
    for column in ("probability_0", "probability_1"):
        np.testing.assert_allclose(scores[column], expected[column], atol=1e-5)
    unseen = scores[good["country"].to_numpy() == "atlantis"]
    assert len(unseen) == 5 and unseen["probability_0"].notna().all()  # scored as unknown, never an error


def test_every_row_is_scored_or_rejected_exactly_once_on_two_ranks(scored):
    summary, output = scored["summary"], scored["output"]
    source_ids = pd.read_parquet(scored["source"], columns=["customer_id"])["customer_id"]
    scored_ids = read_scores(output)["customer_id"]
    rejects = pd.read_parquet(output / "rejects")
    assert scored_ids.is_unique and len(scored_ids) + len(rejects) == ROWS
    assert sorted([*scored_ids, *rejects["customer_id"]]) == sorted(source_ids)
    assert summary["rows"] == ROWS and summary["scored"] == ROWS - 1 and summary["rejected"] == 1
    # 2 files x 3 ranges of whole row groups, and the last file's one 800-row group cut in 2 pieces, one per rank.
    assert summary["world_size"] == 2 and summary["parts"] == 8
    files = json.loads((output / "manifest.json").read_text())["files"]
    assert [name for name in files if name.startswith("part-00002")] == [
        "part-00002-000000000000-000000000400.parquet", "part-00002-000000000400-000000000800.parquet"
    ]  # fmt: skip
    # Both ranks scored: each one's log holds its ranges (torchrun's per-rank logs under OUTPUT/.score/logs).
    assert "[rank 0] scored 2400 rows into 8 files" in scored["stderr"]
    # The refused row, named with its file, row and reason; the rest of its file scored.
    (reject,) = rejects.to_dict("records")
    assert reject["source_file"] == str(scored["bad_file"]) and reject["source_row"] == scored["bad_row"]
    assert "tenure" in reject["reason"] and "infinite" in reject["reason"]


def test_the_manifest_and_every_part_name_the_model_and_the_source(champion, scored):
    output = scored["output"]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["model"] == {"name": "scorer", "version": "1", "uri": "models:/scorer@champion"}
    assert manifest["files"] == sorted(path.name for path in output.glob("part-*.parquet"))
    assert manifest["coverage"]["rows"] == ROWS and len(manifest["source"]["fingerprint"]) == 16
    # The ranks' CPU time beside their wall time: positive, and no more than the machine's cores could give (each
    # rank counts from its own start, so allow the ranks' start-up skew).
    assert 0 < manifest["cpu_seconds"] <= 2 * (os.cpu_count() or 1) * manifest["seconds"], manifest
    assert [name for name, _ in manifest["source"]["files"]] == sorted(str(p) for p in scored["source"].iterdir())
    for part in output.glob("part-*.parquet"):
        metadata = pq.read_schema(part).metadata
        assert metadata[b"ddpflow.model"] == b"scorer" and metadata[b"ddpflow.model_version"] == b"1"
        # The labels dictionary-encoded, the probabilities (almost all distinct) plain: a dictionary of them is
        # larger than they are.
        footer = pq.read_metadata(part)
        encodings = {
            footer.schema.column(i).name: footer.row_group(0).column(i).encodings for i in range(footer.num_columns)
        }
        assert "RLE_DICTIONARY" in encodings["prediction"], encodings
        assert all("RLE_DICTIONARY" not in encodings[f"probability_{label}"] for label in (0, 1)), encodings
    assert not list(output.glob(".*.tmp"))
    # The same scoring again: the output is complete, nothing is scored twice or rewritten.
    before = {path: path.stat().st_mtime_ns for path in output.glob("part-*.parquet")}
    again = score_here(champion, source=str(scored["source"]), output=str(output), on_invalid="skip")
    assert again["already_complete"] is True and again["rows"] == ROWS
    assert {path: path.stat().st_mtime_ns for path in output.glob("part-*.parquet")} == before


def test_one_mlflow_run_records_the_scoring_its_scores_and_the_drift_from_the_training_data(champion, scored):
    from mlflow import MlflowClient

    summary = scored["summary"]
    client = MlflowClient(champion["config"].mlflow.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["ddpflow.scoring"] == "true"
    assert run.data.params["score.model"] == "models:/scorer@champion" and run.data.params["score.model_version"] == "1"
    assert run.data.params["score.source"] == str(scored["source"])
    metrics = run.data.metrics
    assert metrics["rows"] == ROWS and metrics["rejected_rows"] == 1 and metrics["rows_per_s"] > 0
    scores = read_scores(scored["output"])
    shares = {label: float(np.mean(scores["prediction"] == label)) for label in (0, 1)}
    assert metrics["score_share_0"] == pytest.approx(shares[0]) and metrics["score_share_1"] == pytest.approx(shares[1])
    assert metrics["score_mean_probability_1"] == pytest.approx(scores["probability_1"].mean(), abs=1e-6)
    # Drift: the scored table's inputs against v1's training data, by the retraining flow's PSI. Today's plan (a
    # categorical) and spend (a numeric) moved: PSI over 0.25, a large change; the others are drawn as before.
    assert run.data.tags["drift.champion_version"] == "1"
    psi = {key.removeprefix("drift_psi/"): value for key, value in metrics.items() if key.startswith("drift_psi/")}
    assert psi["plan"] > 0.25 and psi["spend"] > 0.25, psi
    unchanged = {name: psi[name] for name in ("country", "device", "tenure", "hour", "children", "mobile")}
    assert max(unchanged.values()) < 0.1, unchanged
    assert len([name for name in psi if name.startswith("embedding_")]) == 1  # a vector's worst dimension: its shift
    assert "merchant_id" not in psi  # a hashed id has no measure
    assert metrics["data_drift_max_psi"] == pytest.approx(max(psi.values()))
    drift = summary["data_drift"]
    assert drift["status"] == "measured" and drift["worst_feature"] in MOVED
    assert drift["message"].startswith(
        f"largest drift of the scored table from v1's training data: {drift['worst_feature']}"
    )
    assert {entry["feature"] for entry in drift["top"][:2]} == set(MOVED)
    artifacts = {entry.path for entry in client.list_artifacts(run.info.run_id, "drift")}
    assert artifacts == {"drift/data_drift.png", "drift/data_drift.json"}


def test_the_mlflow_run_is_created_while_the_ranks_score_not_after_them(champion, scored):
    """The run (its MLflow imports, the store's set-up, the run and its params) is made on a thread as the ranks
    start (ddpflow/tracking/scoring.py: ScoringRun), so it is there before the ranks' manifest, which they write
    once every row is scored; what only the end knows (rows/s, the distribution, the drift) comes after."""
    from datetime import datetime

    from mlflow import MlflowClient

    run = MlflowClient(champion["config"].mlflow.tracking_uri).get_run(scored["summary"]["mlflow_run_id"])
    manifest = json.loads((scored["output"] / "manifest.json").read_text())
    ranks_done = datetime.fromisoformat(manifest["created_at"]).timestamp() * 1000
    assert run.info.start_time < ranks_done, (run.info.start_time, manifest["created_at"])
    assert run.data.params["score.output_kind"] == "probabilities" and run.data.params["score.nproc_per_node"] == "2"


# What a `ddpflow score` of a model.pt does in its own process, watched from inside it (audit hooks): every open of
# the model file, whether torchrun had started then, whether torch was imported when it started, and whether MLflow
# was imported when the ranks were about to get their job (ScoringRun.start, called then).
WATCHED_SCORE = """
import os, sys
from pathlib import Path

model = Path(sys.argv[1]).resolve()
opened, torchrun = [], []
def watch(event, args):
    if event == "open" and isinstance(args[0], str | os.PathLike) and Path(args[0]).resolve() == model:
        opened.append(bool(torchrun))
    elif event == "subprocess.Popen" and "ddpflow.launch.agent" in [str(arg) for arg in args[1]]:
        torchrun.append("torch" in sys.modules)
sys.addaudithook(watch)
from ddpflow.tracking import scoring

start = scoring.ScoringRun.start
def start_watched(self, model, job, plan):
    print(f"MLFLOW_BEFORE_RANKS={'mlflow' in sys.modules}", file=sys.stderr)
    start(self, model, job, plan)
scoring.ScoringRun.start = start_watched
from flows.cli import main

status = main(["score", "--model", str(model), *sys.argv[2:]])
print(f"MODEL_OPENS={len(opened)} TORCHRUN_FIRST={all(opened)} TORCH_BEFORE_TORCHRUN={torchrun}", file=sys.stderr)
sys.exit(status)
"""


def test_torchrun_starts_first_and_the_command_reads_the_model_once_and_imports_mlflow_once_the_ranks_start(
    champion, tmp_path
):
    """`ddpflow score` of a model.pt into a new output: torchrun starts before the command reads the model, and,
    on a machine without a GPU driver, before it imports torch, so the agent's and the ranks' imports overlap the
    command's (ddpflow/launch/scoring.py). The command opens the model once (its hash, its inputs and task, the copy
    its ranks load and the statistics afterwards all come from those bytes: ModelFile); each rank then loads the
    copy in OUTPUT/.score once. MLflow (a second of imports) is not imported before the ranks get their job: which
    store the command names comes from ddpflow/tracking/tracking_uri.py, and the scoring's MLflow run is created on
    a thread beside the ranks (ddpflow/tracking/scoring.py: ScoringRun)."""
    from training.core.topology import GPU_DRIVER_NODES

    model = Path(champion["model_path"]).resolve()
    driver = tmp_path / "watched_score.py"
    driver.write_text(WATCHED_SCORE)
    source = source_files(tmp_path / "src", rows=300)
    done = subprocess.run(
        [sys.executable, str(driver), str(model), "--config", str(champion["config_file"]), "--source", str(source),
         "--output", str(tmp_path / "out"), "--set", "score.nproc_per_node=1", "--json"],
        cwd=champion["root"], env=cli_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["rows"] == 300 and summary["model"]["name"] == str(model) and summary["mlflow_run_id"]
    assert "MLFLOW_BEFORE_RANKS=False" in done.stderr, done.stderr[-3000:]
    no_gpu_driver = not any(os.path.exists(node) for node in GPU_DRIVER_NODES)  # else torch counts the GPUs first
    torch_first = "[False]" if no_gpu_driver else "[True]"
    assert f"MODEL_OPENS=1 TORCHRUN_FIRST=True TORCH_BEFORE_TORCHRUN={torch_first}" in done.stderr, done.stderr[-3000:]


def test_the_scored_tables_drift_is_the_retraining_flows_on_the_same_rows(champion, trained, scored, tmp_path):
    """The same PSI as retraining: the scoring run's report (the parts' footers merged) equals ``compare`` of v1's
    training manifest with the scored rows prepared as a dataset (all of them in the train split, the refused row
    dropped as invalid), feature by feature."""
    from mlflow import MlflowClient

    from ddpflow.drift.report import compare
    from training.core.manifest import read_manifest
    from training.prepare.dataset import prepare_dataset

    client = MlflowClient(champion["config"].mlflow.tracking_uri)
    path = client.download_artifacts(scored["summary"]["mlflow_run_id"], "drift/data_drift.json", str(tmp_path))
    logged = json.loads(Path(path).read_text())
    data = champion["config"].data.model_copy(
        update={"source": str(scored["source"]), "root": str(tmp_path), "val_fraction": 0.0, "test_fraction": 0.0,
                "on_invalid": "drop"}
    )  # fmt: skip
    prepared = prepare_dataset(data).manifest
    assert prepared.splits["train"].rows == ROWS - 1  # the rows the model scored
    expected = {drift.feature: drift for drift in compare(read_manifest(trained["dataset"]), prepared).features}
    found = {entry["feature"]: entry for entry in logged["features"]}
    assert found.keys() == expected.keys() and {"plan", "spend", "country", "embedding"} < {
        name.split("[")[0] for name in found
    }  # fmt: skip
    for name, drift in expected.items():
        assert found[name]["psi"] == pytest.approx(drift.psi, rel=1e-9, abs=1e-12), name
        assert found[name]["mean_shift"] == pytest.approx(drift.mean_shift, rel=1e-6, abs=1e-9), name
        assert found[name]["current_null_rate"] == pytest.approx(drift.current_null_rate), name


def test_an_output_of_another_model_or_source_is_refused_and_left_as_it_was(champion, scored):
    output = scored["output"]
    before = sorted(output.rglob("*"))
    with pytest.raises(DataError) as other_model:  # the command says it once, exit 2 (a ValueError: flows/cli.py)
        score_here(champion, model=str(champion["model_path"]), source=str(scored["source"]), output=str(output),
                   on_invalid="skip")  # fmt: skip
    assert str(other_model.value).startswith(f"score.output {output} holds the scores of scorer v1 "), other_model
    assert f"this scoring is {champion['model_path']} vsha256:" in str(other_model.value)
    other_source = champion["root"] / "yesterday"
    source_files(other_source, rows=300)
    with pytest.raises(DataError, match="holds the scores of scorer v1 .* never mixed"):
        score_here(champion, source=str(other_source), output=str(output), on_invalid="skip")
    assert sorted(output.rglob("*")) == before


def test_a_missing_input_column_is_said_once_and_nothing_of_the_launch_is_left(champion, tmp_path):
    """A new output is scored with torchrun started first (ddpflow/launch/scoring.py): the plan's DataError stops
    the ranks waiting for their job. The command says it once (exit 2), with neither a traceback nor torchrun's
    shutdown, and removes what the launch created: no output is left that looks begun, and a directory the user
    made stays as it was."""
    source = source_files(tmp_path / "src", rows=300)
    for path in source.iterdir():
        pq.write_table(pq.read_table(path).drop_columns(["plan"]), path)
    output = tmp_path / "out"
    for made in (False, True):
        if made:
            output.mkdir()
        done = cli("--config", str(champion["config_file"]), "--source", str(source), "--output", str(output),
                   cwd=champion["root"])  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.count(r"day-0.parquet: lacks the model's input columns ['plan']") == 1, done.stderr
        assert "Traceback" not in done.stderr and "[torchrun]" not in done.stderr, done.stderr
        assert (list(output.iterdir()) == []) if made else not output.exists()


def test_a_bad_row_stops_the_scoring_naming_file_row_and_column_with_no_manifest(champion, scored, tmp_path):
    """on_invalid: error (the default): the rank's DataError, raised as the user's error (the command says it once,
    exit 2: flows/cli.py); finished parts stay, no manifest."""
    output = tmp_path / "out"
    with pytest.raises(DataError) as refused:
        score_here(champion, source=str(scored["source"]), output=str(output))
    message = str(refused.value)
    assert message.startswith(f"{scored['bad_file']}: row {scored['bad_row']} (counting from 0): "), message
    assert "tenure" in message and "on_invalid: skip" in message
    assert not (output / "manifest.json").exists()


def test_a_stopped_scoring_resumes_from_its_parts_and_ends_with_every_row_once(champion, tmp_path):
    source = source_files(tmp_path / "src")
    output = tmp_path / "out"
    args = ["--config", str(champion["config_file"]), "--source", str(source), "--output", str(output), "--json"]
    env = cli_env(DDPFLOW_SCORE_PAUSE_S="0.5")  # each rank rests after each part: the stop lands part-way
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "score", *args], cwd=champion["root"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while len(list(output.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    kept = {path.name: path.stat().st_mtime_ns for path in output.glob("part-*.parquet")}
    assert 2 <= len(kept) < 8 and not (output / "manifest.json").exists()
    summary = score_here(champion, source=str(source), output=str(output))  # the same scoring, run again
    assert summary["resumed_parts"] == len(kept) and summary["rows"] == ROWS
    ids = read_scores(output)["customer_id"]
    assert ids.is_unique and sorted(ids) == sorted(pd.read_parquet(source)["customer_id"])
    # The ranges still to score were shared out among the ranks (balanced), the finished ones left alone.
    pending = json.loads((output / ".score" / "job.json").read_text())["pending"]
    assert [summary["files"][i] for i in pending] == [name for name in summary["files"] if name not in kept]
    # The parts finished before the stop were kept as they were, not scored again.
    assert {name: (output / name).stat().st_mtime_ns for name in kept} == kept


def test_the_score_pipeline_flow_scores_and_the_register_task_announces_a_new_champion(
    champion, prefect_harness, tmp_path
):
    """The flow under the session's Prefect server (a real torchrun launch through the task), and the event
    ``ddpflow.champion.moved`` that score-pipeline/score-on-new-champion's trigger waits for (prefect.yaml)."""
    import httpx
    from prefect import flow

    from ddpflow.tracking.gate import GateDecision
    from flows.score_pipeline import score_pipeline
    from tasks.register import CHAMPION_MOVED, announce_new_champion

    source = source_files(tmp_path / "src", rows=300)
    output = tmp_path / "out"
    summary = score_pipeline(config_file=str(champion["config_file"]), model="scorer/1", source=str(source),
                             output=str(output), overrides=["score.output_kind=label"])  # fmt: skip
    assert summary["rows"] == 300 and summary["model"]["uri"] == "models:/scorer/1"
    assert list(read_scores(output).columns) == ["customer_id", "prediction"]  # output_kind: label
    assert json.loads((output / "manifest.json").read_text())["output_kind"] == "label"

    decision = GateDecision("promoted", "first", "scorer", "run-1", "test_accuracy", True, 0.9, version="2")

    @flow
    def register_stand_in() -> None:
        announce_new_champion(decision)

    register_stand_in()
    body = {"filter": {"event": {"name": [CHAMPION_MOVED]}}}
    deadline, events = time.monotonic() + 60, []
    while not events and time.monotonic() < deadline:
        events = httpx.post(f"{prefect_harness}/events/filter", json=body, timeout=30).json()["events"]
        time.sleep(0.5)
    (event,) = events
    assert event["resource"]["prefect.resource.id"] == "ddpflow.model.scorer"
    assert event["payload"] == {"model": "scorer", "version": "2", "previous": None, "run_id": "run-1"}


def untrained_model(dataset: Path, path: Path) -> Path:
    """A model.pt as training writes it for the built-in model its inputs pick (image_cnn, transformer), with the
    dataset's fitted encoders; untrained weights encode and score like trained ones."""
    import torch

    from training.core.manifest import read_manifest
    from training.inference.model_file import inference_checkpoint
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.models.registry import ModelSpec, build_model, pick_model

    manifest = read_manifest(dataset)
    inputs = inputs_from_manifest(manifest)
    spec = ModelSpec.for_inputs(pick_model("auto", inputs), inputs, manifest.n_outputs, {})
    torch.manual_seed(0)
    encoders = read_encoders(dataset, manifest)
    torch.save(inference_checkpoint(build_model(spec).state_dict(), spec, manifest, 0, {}, encoders), path)
    return path


def score_in_one_rank(model_path: Path, source: Path, output: Path, keep: list[str]) -> dict:
    """The scoring rank's own program (plan, part files, coverage, manifest) in this process, as a group of one."""
    from training.core.config import TrainConfig
    from training.core.fileio import atomic_write_json
    from training.core.layout import SCORE_DIR, SCORE_PLAN
    from training.distributed.context import distributed
    from training.inference.batch_scoring import ScoreJob, make_plan, score_rank
    from training.inference.model_file import checkpoint_inputs, load_model_checkpoint

    job = ScoreJob(str(model_path), {"name": "m", "version": "1", "uri": str(model_path)}, str(source), "auto",
                   str(output), keep, "probabilities", 16, "skip")  # fmt: skip
    plan = make_plan(job, checkpoint_inputs(load_model_checkpoint(model_path)[1]))
    atomic_write_json(output / SCORE_DIR / SCORE_PLAN, plan.to_dict())
    with distributed(TrainConfig(backend="gloo", collective_timeout_s=60)) as ctx:
        return score_rank(job, ctx)


@pytest.mark.parametrize("kind", ["image", "text"])
def test_images_and_text_score_as_the_pyfunc_scores_them_and_an_undecodable_image_is_rejected(kind, tmp_path):
    """Images as bytes (one that does not decode: rejected with the reason) and text through the shipped
    tokenizer: the rank's scores beside the pyfunc's own ``predict`` body (``serving.predictions``) on the same
    raw rows, within 1e-5. In this process (a group of one): the encoding is what is checked, not the launch.
    Today's images are larger and today's reviews longer, in words never seen: the scoring's drift shows it."""
    from image_data import image_table

    from training.core.config import load_config
    from training.inference.serving import load_predictor, predictions
    from training.prepare.dataset import prepare_dataset

    if kind == "image":
        table, inputs = image_table(40, size=12), {"photo": {"kind": "image", "size": 12}, "colour": "categorical"}
        label = "shape"
    else:
        rng = np.random.default_rng(0)
        words = np.array(["late", "parcel", "great", "broken", "fast", "refund", "thanks", "never", "again"])
        reviews = [" ".join(rng.choice(words, size=rng.integers(2, 9))) for _ in range(40)]
        table = pa.table({"id": np.arange(40), "review": reviews, "colour": ["red", "blue"] * 20,
                          "stars": rng.integers(1, 6, size=40)})  # fmt: skip
        inputs, label = {"review": {"kind": "text", "tokenizer": {"vocab_size": 40}}, "colour": "categorical"}, "stars"
    pq.write_table(table, tmp_path / "train.parquet")
    settings = [f"data.source={tmp_path / 'train.parquet'}", f"data.root={tmp_path / 'shards'}",
                f"data.label={label}", "data.key=id", f"data.inputs={json.dumps(inputs)}"]  # fmt: skip
    data = load_config(None, settings).data
    dataset = prepare_dataset(data).dataset_dir
    model_path = untrained_model(dataset, tmp_path / "model.pt")
    if kind == "image":  # today's photos are 20 x 20, not 12 x 12 (the model resizes them); one does not decode
        table = image_table(40, size=20)
        photos = table["photo"].to_pylist()
        photos[7] = b"not an image"
        table = table.set_column(table.schema.get_field_index("photo"), "photo", pa.array(photos, pa.binary()))
    else:  # today's reviews: longer, half their words never seen in training
        news = np.array(["awful", "delayed", "cancelled", "lost", "damaged", "late", "parcel", "again"])
        reviews = [" ".join(rng.choice(news, size=rng.integers(8, 15))) for _ in range(40)]
        table = table.set_column(table.schema.get_field_index("review"), "review", pa.array(reviews))
    (tmp_path / "today").mkdir()
    pq.write_table(table, tmp_path / "today" / "day.parquet", row_group_size=16)
    manifest = score_in_one_rank(model_path, tmp_path / "today", tmp_path / "out", ["id"])
    scores = read_scores(tmp_path / "out")
    raw = table.to_pandas()
    good = raw.drop(index=[7]) if kind == "image" else raw
    expected = predictions(load_predictor(model_path), good[list(inputs)], "probabilities")
    np.testing.assert_array_equal(scores["id"], good["id"])
    np.testing.assert_array_equal(scores["prediction"], expected["label"])
    columns = [name for name in expected.columns if name.startswith("probability_")]
    np.testing.assert_allclose(scores[columns].to_numpy(), expected[columns].to_numpy(), atol=1e-5)
    assert manifest["rows"] == 40 and manifest["rejected"] == (1 if kind == "image" else 0)
    if kind == "image":
        (reject,) = pd.read_parquet(tmp_path / "out" / "rejects").to_dict("records")
        assert reject["id"] == 7 and reject["source_row"] == 7 and "photo" in reject["reason"], reject
    scored_inputs_drift(model_path, dataset, tmp_path / "out", manifest["files"], good, kind)


def scored_inputs_drift(model_path: Path, dataset: Path, output: Path, files: list[str], good, kind: str) -> None:
    """The parts' drift statistics (3 parts, merged) are what prepare keeps of the scored rows, and compared with
    the training data's by the retraining flow's ``compare``: today's images or reviews moved, the colour not."""
    from ddpflow.drift.report import Profile, compare
    from training.core.manifest import read_manifest
    from training.inference.model_file import checkpoint_codecs, checkpoint_inputs, load_model_checkpoint
    from training.inference.scored_drift import scored_profile
    from training.kinds.text import text_drift_stats

    meta = load_model_checkpoint(model_path)[1]
    profile = scored_profile(output, files, checkpoint_inputs(meta))
    name = "photo" if kind == "image" else "review"
    codec = checkpoint_codecs(meta)[name]
    column = pa.array(good[name].tolist(), pa.binary() if kind == "image" else pa.string())
    if kind == "image":
        codec.observe(column)  # what prepare keeps of a train split's images
        assert profile["drift_stats"]["inputs"][name] == codec.drift_stats()
    else:
        assert profile["drift_stats"]["inputs"][name] == text_drift_stats(codec, [column])
    report = compare(read_manifest(dataset), Profile.of_scored_table(profile, "today"))
    psi = {drift.feature: drift.psi for drift in report.features}
    moved = ("photo:width", "photo:height") if kind == "image" else ("review:length", "review:words")
    assert min(psi[feature] for feature in moved) > 0.25 and report.worst.feature in moved, psi
    assert psi["colour"] < 0.1, psi
    if kind == "text":  # scored under the model's own tokenizer: its unknown-token rate is compared too
        assert "review:unknown_tokens" in psi


def test_an_image_folder_scores_as_the_pyfunc_scores_it_each_image_once_keyed_by_its_path(tmp_path, monkeypatch):
    """An image folder (``root/<class>/<file>``, what data.source takes) as a scoring source: each class folder a
    file of the plan, its images read in groups; the output keeps each image's ``path`` (the model's data.key, the
    image folder's default) beside the pyfunc's own scores of the same images."""
    from image_data import write_image_folder

    from training.core.config import load_config
    from training.inference.serving import load_predictor, predictions
    from training.prepare import image_folder
    from training.prepare.dataset import prepare_dataset
    from training.prepare.image_folder import ImageFolderSource

    monkeypatch.setattr(image_folder, "GROUP_ROWS", 4)  # 20 images a class: groups of 4 gathered into ranges of 16
    folder = write_image_folder(tmp_path / "shapes", per_class=6, size=12)
    data = load_config(None, [f"data.source={folder}", f"data.root={tmp_path / 'shards'}"]).data
    model_path = untrained_model(prepare_dataset(data).dataset_dir, tmp_path / "model.pt")
    today = write_image_folder(tmp_path / "today", per_class=20, size=12)
    manifest = score_in_one_rank(model_path, today, tmp_path / "out", ["path"])
    scores = read_scores(tmp_path / "out")
    batches = ImageFolderSource(str(today)).iter_batches(["image", "path"], 8)
    raw = pd.concat([batch.to_pandas() for _, batch in batches])
    assert manifest["rows"] == 60 and [rows for _, rows in manifest["source"]["files"]] == [20, 20, 20]
    assert [name[11:] for name in manifest["files"][:2]] == ["000000000000-000000000016.parquet",
                                                              "000000000016-000000000020.parquet"]  # fmt: skip
    assert scores["path"].tolist() == raw["path"].tolist() == sorted(raw["path"])  # each image once, in order
    expected = predictions(load_predictor(model_path), raw[["image"]].reset_index(drop=True), "probabilities")
    columns = [name for name in expected.columns if name.startswith("probability_")]
    np.testing.assert_allclose(scores[columns].to_numpy(), expected[columns].to_numpy(), atol=1e-5)


HEAP_BOUND = 120 * 2**20  # what a rank may hold in this test: anonymous memory above its loaded model
NOTE_CHARS = 3000  # a support ticket's text, kept beside the scores: most of the table's bytes
NOTE_WORDS = np.array([
    "late", "parcel", "refund", "broken", "screen", "charger", "never", "arrived", "again", "thanks", "support",
    "agent", "called", "twice", "store", "credit", "invoice", "wrong", "address", "moved", "courier", "missed",
])  # fmt: skip


def larger_than_a_rank(directory: Path, rows_per_file: int, files: int = 4) -> tuple[Path, int]:
    """(the source, its raw size): the mixed table plus free text kept beside the scores (an ``address`` and a
    support ticket's ``note``), as ``files`` Parquet files alternating one row group each (pyarrow's default for a
    file under 1M rows, scored in pieces that start inside the group) and row groups of 4096 rows. Raw size: the
    Arrow bytes of the columns a rank reads (the kept ones and the model's inputs): what reading it at once holds."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = 0
    rng = np.random.default_rng(3)
    text = " ".join(rng.choice(NOTE_WORDS, size=200_000)).encode()  # ~1.3 MB of words, notes cut from it in turn
    for index in range(files):
        table = churn_table(rows_per_file, seed=10 + index).drop_columns(["churned"])
        ids = pa.array(np.arange(rows_per_file, dtype=np.int64) + index * rows_per_file)
        table = table.set_column(0, "customer_id", ids)
        streets = rng.choice(
            ["Storgata", "Kungsgatan", "Vesterbrogade", "Mannerheimintie", "Laugavegur"], rows_per_file
        )
        numbers = rng.integers(1, 400, size=rows_per_file)
        address = [f"{street} {number}, apt {number % 37}" for street, number in zip(streets, numbers, strict=True)]
        data = np.resize(np.frombuffer(text, np.uint8), rows_per_file * NOTE_CHARS)
        offsets = pa.array(np.arange(rows_per_file + 1, dtype=np.int32) * NOTE_CHARS).buffers()[1]
        notes = pa.StringArray.from_buffers(rows_per_file, offsets, pa.py_buffer(data))
        table = table.append_column("address", pa.array(address, pa.string())).append_column("note", notes)
        raw += table.nbytes
        groups = rows_per_file if index % 2 == 0 else 4096
        pq.write_table(table, directory / f"day-{index}.parquet", row_group_size=groups)
    return directory, raw


def test_a_table_four_times_what_a_rank_may_hold_scores_every_row_once_with_the_heap_flat(
    trained, tmp_path, monkeypatch
):
    """Larger than memory: the ranks read record batches (a buffered Parquet reader, no readahead) and append each
    batch's scores to its part file, so a rank's heap does not grow with the table. Each rank logs its anonymous
    resident memory (RssAnon: heap, Arrow's pool, tensors; not its libraries' pages) after every batch
    (``DDPFLOW_SCORE_MEMORY_LOG``), from the moment its model is loaded, before any row is read. The columns a
    rank reads are 4 x HEAP_BOUND; the rank stays under HEAP_BOUND above its loaded model, and adds less than 4
    batches of raw bytes from the first half of its rows to the second. A rank that read the table, its share or a
    whole row group at once, or kept the rows it wrote (scores and kept columns), breaks one or both."""
    from ddpflow.launch.scoring import ScoreRequest, run_scoring

    rows_per_file = 40_000
    source, raw = larger_than_a_rank(tmp_path / "big", rows_per_file)
    assert raw >= 4 * HEAP_BOUND, raw
    output, memory = tmp_path / "out", tmp_path / "memory"
    memory.mkdir()
    monkeypatch.setenv("DDPFLOW_SCORE_MEMORY_LOG", str(memory))
    config = trained["config"]
    settings = {"source": str(source), "output": str(output), "keep": ["customer_id", "address", "note"],
                "batch_size": 1024, "nproc_per_node": 2, "output_kind": "probabilities"}  # fmt: skip
    config = config.model_copy(update={"score": config.score.model_copy(update=settings)})
    model = {"name": "scorer", "version": "1", "uri": "models:/scorer/1"}
    manifest = run_scoring(ScoreRequest(config, as_registered(trained["model_path"], model), on_line=lambda line: None))
    # (1) Every row once: the manifest's count, and the parts' ids cover the source's ids once.
    rows = 4 * rows_per_file
    assert manifest["rows"] == rows and manifest["scored"] == rows
    parts = [pq.read_table(output / name, columns=["customer_id"]) for name in manifest["files"]]
    ids = pa.concat_tables(parts)["customer_id"].to_numpy()
    assert len(ids) == rows and np.array_equal(np.sort(ids), np.arange(rows))
    # (2) The heap flat, on each rank (each scores half the table: a piece of a one-group file, then a file of
    # small groups).
    for rank in (0, 1):
        marks = [json.loads(line) for line in (memory / f"rank-{rank}.jsonl").read_text().splitlines()]
        base, last = marks[0], marks[-1]
        half, end = (max(m["anon"] for m in marks if m["rows"] <= last["rows"] * part) for part in (1 / 2, 1))
        mb = {"raw": raw, "base_anon": base["anon"], "half": half - base["anon"], "end": end - base["anon"],
              "base_rss": base["rss"], "peak_rss": last["peak"] - base["rss"]}  # fmt: skip
        figures = {"rank": rank, "rows": last["rows"], **{key: round(value / 2**20, 1) for key, value in mb.items()}}
        print(figures)
        assert last["rows"] == rows / 2, figures  # both ranks scored their share
        assert end - base["anon"] < HEAP_BOUND, figures  # a quarter of the table
        # Flat: the second half of its rows adds less than 4 batches of raw bytes. Within that, the peak moves with
        # when Arrow's pool and malloc hand back a batch's buffers (the first half's peak was 65-71.5 MB, the end's
        # 69-73); a rank that kept what it read would add the second half's 39 batches.
        batch = raw / rows * settings["batch_size"]
        assert end - half < 4 * batch, figures
