"""The scoring job the launcher writes for its ranks (ddpflow/launch/scoring.py: ``scoring_job``): a relative
score.source resolved in the caller's directory (the project root, where `ddpflow score` and a deployment's flow
run both start; the ranks start in the package's root), and score.keep's default, the model's own data.key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddpflow.launch.scoring import scoring_job, scoring_layout
from ddpflow.tracking.scoring import ScoringModel
from training.core.config import PipelineConfig, load_config
from training.inference.batch_scoring import make_plan
from training.inference.model_file import ModelFile, checkpoint_inputs, load_model_checkpoint

MODEL = {"name": "churn", "version": "3", "uri": "models:/churn/3"}


def day_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"customer_id": np.arange(rows, dtype=np.int64) + 1000, "tenure": rng.normal(size=rows),
                     "active": rng.random(rows) > 0.5, "churned": rng.integers(0, 2, rows)})  # fmt: skip


@pytest.fixture(scope="module")
def keyed_model(tmp_path_factory) -> Path:
    """A model.pt trained (untrained weights will do) on a table whose data.key is ``customer_id``."""
    from tests.flows.test_batch_scoring import untrained_model
    from training.prepare.dataset import prepare_dataset

    root = tmp_path_factory.mktemp("keyed")
    pq.write_table(day_table(200, seed=0), root / "train.parquet")
    inputs = json.dumps({"tenure": "numeric", "active": "numeric"})
    settings = [f"data.source={root / 'train.parquet'}", f"data.root={root / 'shards'}", "data.label=churned",
                "data.key=customer_id", f"data.inputs={inputs}"]  # fmt: skip
    return untrained_model(prepare_dataset(load_config(None, settings).data).dataset_dir, root / "model.pt")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project directory with today's table under data/today/, as the current directory."""
    (tmp_path / "data" / "today").mkdir(parents=True)
    pq.write_table(day_table(50, seed=1), tmp_path / "data" / "today" / "day.parquet")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def job_for(model: Path, **sections):
    config = PipelineConfig.model_validate({"score": {"source": "data/today/", "output": "data/scores/today"},
                                            **sections})  # fmt: skip
    scoring = ScoringModel(model, MODEL["name"], MODEL["version"], MODEL["uri"], ModelFile.read(model))
    return scoring_job(config, scoring, scoring_layout(config))


def test_a_relative_source_is_the_callers_and_the_ranks_read_it_from_anywhere(keyed_model, project, monkeypatch):
    job = job_for(keyed_model)
    assert job.source == str(project / "data" / "today")
    assert job.output == str((project / "data" / "scores" / "today").resolve())
    # The ranks start in the package's root (ddpflow/launch/supervisor.py): the job names the same files there.
    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    plan = make_plan(job, checkpoint_inputs(load_model_checkpoint(keyed_model)[1]))
    assert plan.files == [[str(project / "data" / "today" / "day.parquet"), 50]]


def test_a_url_source_is_left_as_it_is(keyed_model, project):
    from ddpflow.launch.scoring import in_caller_directory

    assert in_caller_directory("s3://bucket/today/*.parquet") == "s3://bucket/today/*.parquet"
    assert in_caller_directory("file://data/today") == str(project / "data" / "today")
    assert in_caller_directory("/srv/today/") == "/srv/today"


def test_keep_defaults_to_the_models_data_key_unless_the_config_says(keyed_model, project):
    assert job_for(keyed_model).keep == ["customer_id"]  # recorded in model.pt: a trigger run passes no keep
    assert job_for(keyed_model, data={"key": "tenure"}).keep == ["tenure"]  # the config's data.key first
    assert job_for(keyed_model, score={"source": "data/today/", "output": "o", "keep": []}).keep == []
    assert job_for(keyed_model, score={"source": "data/today/", "output": "o", "keep": ["active"]}).keep == ["active"]


def test_a_source_without_the_models_key_is_named_with_how_to_keep_none(keyed_model, project):
    from training.core.errors import DataError

    pq.write_table(day_table(50, seed=1).drop(["customer_id"]), project / "data" / "today" / "day.parquet")
    job = job_for(keyed_model)
    with pytest.raises(DataError, match=r"lacks the score.keep columns \['customer_id'\].*score.keep, \[\] for none"):
        make_plan(job, checkpoint_inputs(load_model_checkpoint(keyed_model)[1]))


def test_an_output_that_is_a_file_or_holds_other_files_is_refused_before_anything_runs(project):
    """``scoring_output``: checked before torchrun starts, so nothing is written into what is refused."""
    from ddpflow.launch.scoring import scoring_output
    from training.core.errors import DataError

    (project / "data" / "scores").mkdir(parents=True)
    (project / "data" / "scores" / "notes.txt").write_text("mine")
    (project / "data" / "scores.parquet").write_bytes(b"PAR1")
    for output, why in (
        ("data/scores", "is not empty and is not a ddpflow scoring output"),
        ("data/scores.parquet", "is a file"),
    ):
        config = PipelineConfig.model_validate({"score": {"source": "data/today/", "output": output}})
        with pytest.raises(DataError, match=why):
            scoring_output(config)
    assert sorted(path.name for path in (project / "data" / "scores").iterdir()) == ["notes.txt"]
    config = PipelineConfig.model_validate({"score": {"source": "data/today/", "output": "data/new"}})
    assert scoring_output(config) == project / "data" / "new" and not (project / "data" / "new").exists()
