"""The non-finite check of one optimizer step, in-process (TrainStep without ranks): it raises before the
update, naming the step, and the step's report carries the loss, rows, gradient norm and lr."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from stand_in_models import NumericLinear

from training.loading.batches import SplitTensors, TrainBatches
from training.loop.nonfinite import NonFiniteStep, is_non_finite_failure, non_finite_error
from training.loop.step import StepSettings, TrainStep, gradient_norm


def one_rank_step(features: torch.Tensor, grad_accum: int = 1, reports: list | None = None):
    torch.manual_seed(0)
    split = SplitTensors(features, torch.randint(0, 3, (len(features),)))
    batches = TrainBatches(split, 0, 1, 4, 0, torch.device("cpu"), False)
    model = NumericLinear(features.shape[1], 3)
    model.no_sync = contextlib.nullcontext  # one process: nothing to keep from all-reducing (DDP's no_sync)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = StepSettings("classification", torch.device("cpu"), grad_accum=grad_accum)
    step = TrainStep(
        model, optimizer, None, batches, settings, on_update=(reports if reports is not None else []).append
    )
    return model, batches, step


def test_a_nan_row_stops_its_optimizer_step_before_the_update():
    features = torch.randn(16, 5)
    _, batches, _ = one_rank_step(features, grad_accum=2)
    poisoned = list(batches.epoch(0))[3].indices[0]
    features[poisoned] = float("nan")  # in micro-batch 3: optimizer step 1 (micro-batches 2-3)
    model, batches, step = one_rank_step(features, grad_accum=2)
    epoch = list(batches.epoch(0))
    for index in range(3):  # optimizer step 0, then the first micro-batch of step 1
        step(index, epoch[index])
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(NonFiniteStep) as caught:
        step(3, epoch[3])
    assert caught.value.steps == range(2, 4) and caught.value.everywhere and math.isnan(caught.value.loss)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} was updated with the NaN gradients"
    message = str(non_finite_error(caught.value, rank=0, epoch=0, loss_ranks=[0]))
    assert "rank 0: non-finite training values at epoch 0 steps 2-3" in message and "train.lr" in message
    assert is_non_finite_failure(f"RankFailed: rank 1 failed: {message}")


def test_each_optimizer_step_reports_its_loss_rows_norm_and_lr():
    reports: list = []
    model, batches, step = one_rank_step(torch.randn(14, 5), reports=reports)  # 4 steps, the last of 2 rows
    total = torch.zeros((), dtype=torch.float64)
    for index, batch in enumerate(batches.epoch(0)):
        total += step(index, batch)
    assert [report.index for report in reports] == [0, 1, 2, 3] and [r.rows for r in reports] == [4, 4, 4, 2]
    assert sum(report.loss_sum for report in reports) == pytest.approx(float(total), rel=1e-12)
    assert all(report.lr == 0.1 and report.grad_norm > 0 for report in reports)


def test_the_gradient_norm_is_the_one_clipping_computes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model(torch.randn(5, 4)).sum().backward()
    norm = gradient_norm(model.parameters())
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")))
    assert torch.equal(norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def test_the_step_lists_its_parameters_once_not_at_every_update():
    """Walking the module tree for the parameters at every optimizer step cost more than the norm itself on a
    small CPU model: the step lists them when it is made (the norm is clipping's: the test above)."""
    reports: list = []
    model, batches, step = one_rank_step(torch.randn(14, 5), reports=reports)
    walks = []
    listed = model.parameters
    model.parameters = lambda *args, **kwargs: walks.append(1) or listed(*args, **kwargs)
    for index, batch in enumerate(batches.epoch(0)):
        step(index, batch)
    assert len(reports) == 4 and walks == []
