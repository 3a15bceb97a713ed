"""Curves within an epoch: rank 0's steps.jsonl every train.log_every_steps optimizer steps, and its mirror
into the pipeline's MLflow run at step = the optimizer steps done (real SQLite MLflow store)."""

from __future__ import annotations

from training.core.fileio import read_metrics_lines
from training.core.layout import METRICS, STEP_METRICS
from training.loop.counting import StepMetricsSink, StepReport


def report(index: int, loss_sum: float, rows: int = 4, grad_norm: float = 1.0, lr: float = 0.1) -> StepReport:
    return StepReport(index=index, loss_sum=loss_sum, rows=rows, grad_norm=grad_norm, lr=lr)


def test_a_line_every_n_steps_with_the_window_means_and_none_twice_after_a_resume(tmp_path):
    sink = StepMetricsSink(tmp_path, enabled=True, every=2, optimizer_steps=3, loss_scale=10.0)
    for epoch in range(2):
        for index in range(3):
            sink.add(
                epoch, report(index, loss_sum=float(epoch * 3 + index), grad_norm=float(index + 1), lr=0.1 + index)
            )
    lines = read_metrics_lines(tmp_path / STEP_METRICS)
    assert [line["step"] for line in lines] == [2, 4, 6]
    # Steps 1-2 of the run: loss sums 0 and 1 over 4 + 4 rows, on the scale loss_scale gives; norms 1 and 2.
    assert lines[0] == {"step": 2, "epoch": 0, "step/lr": 1.1, "step/grad_norm": 1.5, "step/train_loss": 1.25}
    assert lines[1]["epoch"] == 1 and lines[1]["step/lr"] == 0.1  # step 4 = epoch 1's first step

    resumed = StepMetricsSink(tmp_path, enabled=True, every=2, optimizer_steps=3)  # a restart re-trains epoch 1
    for index in range(3):
        resumed.add(1, report(index, loss_sum=1.0))
    assert [line["step"] for line in read_metrics_lines(tmp_path / STEP_METRICS)] == [2, 4, 6]


def test_other_ranks_and_none_write_nothing(tmp_path):
    for enabled, every in ((False, 1), (True, None)):
        sink = StepMetricsSink(tmp_path, enabled=enabled, every=every, optimizer_steps=2)
        sink.add(0, report(0, 1.0))
        sink.add(0, report(1, 1.0))
    assert not (tmp_path / STEP_METRICS).exists()


def test_the_mirror_logs_each_step_line_once_at_its_step(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    from ddpflow.tracking.metrics import EpochMetricsFollower

    uri, artifacts = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("curves", artifact_location=artifacts)).info.run_id
    sink = StepMetricsSink(tmp_path, enabled=True, every=5, optimizer_steps=10)
    for epoch in range(2):
        for index in range(10):
            sink.add(epoch, report(index, loss_sum=4.0 - epoch, lr=0.01 * (index + 1)))
    (tmp_path / METRICS).write_text('{"epoch": 0, "train_loss": 1.0, "selected_epoch": 0}\n')
    EpochMetricsFollower(tmp_path / METRICS, run_id, uri).catch_up()
    EpochMetricsFollower(tmp_path / METRICS, run_id, uri).catch_up()  # a retried task's follower: no duplicates
    loss = client.get_metric_history(run_id, "step/train_loss")
    assert sorted((point.step, point.value) for point in loss) == [(5, 1.0), (10, 1.0), (15, 0.75), (20, 0.75)]
    assert sorted(point.step for point in client.get_metric_history(run_id, "step/lr")) == [5, 10, 15, 20]
    assert [point.step for point in client.get_metric_history(run_id, "train_loss")] == [0]
    assert [point.value for point in client.get_metric_history(run_id, "selected_epoch")] == [0]
    assert client.get_metric_history(run_id, "epoch") == [], "a step line's epoch is not a metric"


def test_the_step_loss_is_the_weighted_mean_the_step_optimises(tmp_path):
    """With data.weight the curve is Σ w·ℓ / Σ w (the step's loss), not Σ w·ℓ over the rows."""
    sink = StepMetricsSink(tmp_path, enabled=True, every=2, optimizer_steps=2)
    sink.add(0, StepReport(index=0, loss_sum=3.0, rows=4, grad_norm=1.0, lr=0.1, weight=2.0))
    sink.add(0, StepReport(index=1, loss_sum=3.0, rows=4, grad_norm=1.0, lr=0.1, weight=10.0))
    assert read_metrics_lines(tmp_path / STEP_METRICS)[0]["step/train_loss"] == 0.5  # 6 / 12, not 6 / 8
