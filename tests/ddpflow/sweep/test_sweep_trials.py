"""The sweep's trial loop with ``sweep.parallel: 2``, without ranks: ``SweepSetup.train`` is a stand-in
that writes metrics.jsonl as rank 0 does and obeys the verdict files as the ranks do
(training/loop/selection.py: stop_requested), so the loop's own logic is checked: no trial asked beyond
``trials``, a failed trial recorded while the others go on, one child run per trial under the parent, the
parent's table. Real ranks: tests/flows/test_sweep.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import yaml
from mlflow import MlflowClient

from ddpflow.launch.stage import TrainResult, last_metrics
from ddpflow.sweep.session import open_sweep, summarise
from ddpflow.sweep.space import load_sweep
from ddpflow.sweep.study import FAIL_REASON, finished_trials
from ddpflow.sweep.trials import run_trials
from training.core.topology import RankLayout
from training.loop.selection import read_verdict
from training.prepare.dataset import prepare_dataset

LRS = [0.01, 0.02, 1e-7, 1e30, 0.03, 0.04]


def _stand_in(concurrent: list[int], peak: list[int], lock: threading.Lock):
    def train(request, run_id):
        with lock:
            concurrent[0] += 1
            peak[0] = max(peak[0], concurrent[0])
        try:
            lr, epochs, run_dir = request.config.train.lr, request.config.train.epochs, Path(request.run_dir)
            if lr > 1:
                raise RuntimeError("epoch 0 step 2: the loss is nan (non-finite)")
            for epoch in range(epochs):
                loss = abs(lr - 0.02) * 10 + 0.1 / (epoch + 1) + (5.0 if lr < 1e-5 else 0.0)
                line = {"epoch": epoch, "val_loss": loss, "selected_epoch": epoch, "selected_val_loss": loss}
                with (run_dir / "metrics.jsonl").open("a") as sink:
                    sink.write(json.dumps(line) + "\n")
                if epoch + 1 < epochs and read_verdict(run_dir, epoch, 30.0):
                    break
            (run_dir / "model.pt").write_bytes(b"stand-in")
            return TrainResult(str(run_dir), str(run_dir / "model.pt"), last_metrics(run_dir / "metrics.jsonl"))
        finally:
            with lock:
                concurrent[0] -= 1

    return train


def test_parallel_trials_end_at_trials_in_all_and_a_failure_does_not_stop_the_others(tmp_path, mlflow_store):
    tracking_uri, artifacts = mlflow_store
    raw = {
        "data": {"source": "synthetic://classification?rows=600&features=4&classes=2&seed=1", "root": str(tmp_path)},
        "train": {"epochs": 3, "batch_size": 32, "nproc_per_node": 1, "run_root": str(tmp_path / "runs")},
        "mlflow": {"tracking_uri": tracking_uri, "experiment": "sweep-loop", "artifact_location": artifacts},
        "sweep": {
            "trials": 5, "parallel": 2, "sampler": "random", "startup_trials": 1, "name": "loop",
            "space": {"train.lr": {"choices": LRS}}, "enqueue": [{"train.lr": lr} for lr in LRS[:5]],
        },
    }  # fmt: skip
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(raw))
    sweep = load_sweep(tmp_path / "sweep.yaml")
    prepared = prepare_dataset(sweep.base.data)
    lines, concurrent, peak, lock = [], [0], [0], threading.Lock()
    setup, study = open_sweep(
        sweep, str(prepared.dataset_dir), prepared.manifest, RankLayout(1, 1, "gloo", 0), tracking_uri, {},
        _stand_in(concurrent, peak, lock), report=lines.append,
    )  # fmt: skip
    run_trials(setup, study)
    best = summarise(setup, study)

    assert len(study.get_trials()) == 5 and len(finished_trials(study)) == 5  # none asked beyond trials
    assert peak[0] == 2  # two at once, never more
    failed = [t for t in study.get_trials() if t.state.name == "FAIL"]
    assert [t.params["train.lr"] for t in failed] == [1e30]
    assert "non-finite" in failed[0].user_attrs[FAIL_REASON]
    assert len(lines) == 5 and lines[-1].count("5/5 done") == 1
    assert best is not None and best.params == {"train.lr": 0.02} and Path(best.model_path).is_file()
    for trial in study.get_trials():
        if trial.state.name == "PRUNED":  # stopped at the verdict, as the ranks would
            run_dir = Path(trial.user_attrs["ddpflow.run_dir"])
            assert (
                len((run_dir / "metrics.jsonl").read_text().splitlines())
                == 1 + trial.user_attrs["ddpflow.pruned_at_epoch"]
            )
    client = MlflowClient(tracking_uri=tracking_uri)
    parent = client.get_run(setup.parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{setup.parent_run_id}'"
    )
    assert len(children) == 5
    assert sorted(run.info.status for run in children) == ["FAILED"] + ["FINISHED"] * 4
    assert parent.data.tags["sweep.best_run_id"] == best.run_id
