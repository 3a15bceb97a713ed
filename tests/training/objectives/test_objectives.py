"""training/objectives/registry.py and metrics.py: the loss contract, the exact weighted denominator, and metrics
that equal known answers on tiny examples (no torchrun: the ranks are simulated in one process)."""

from __future__ import annotations

import math
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from stand_in_models import NumericLinear

from training.core.config import ConfigError, load_config
from training.loading.batches import SplitTensors, TrainBatches
from training.loop.step import StepSettings, TrainStep
from training.objectives.builtin import Binary, Huber, Multilabel, Softmax
from training.objectives.metrics import pr_auc, roc_auc
from training.objectives.registry import build_objective, check_objective, class_weight_vector, make_objective

# --- per-row losses: known values ---------------------------------------------------------------------


def test_softmax_with_label_smoothing_is_the_smoothed_cross_entropy_per_row():
    # p = (0.25, 0.75), label 1, eps 0.2: 0.8 * -ln 0.75 + 0.1 * (-ln 0.25 - ln 0.75)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    expected = 0.8 * -math.log(0.75) + 0.1 * (-math.log(0.25) - math.log(0.75))
    loss = Softmax(2, label_smoothing=0.2).per_row_loss(logits, torch.tensor([1]))
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert float(loss[0]) == pytest.approx(expected, rel=1e-6)
    assert float(Softmax(2).per_row_loss(logits, torch.tensor([1]))[0]) == pytest.approx(-math.log(0.75), rel=1e-6)


def test_binary_huber_and_multilabel_per_row_losses():
    binary = Binary(2).per_row_loss(torch.tensor([[0.0], [math.log(3.0)]]), torch.tensor([0, 1]))
    assert binary.tolist() == pytest.approx([math.log(2.0), -math.log(0.75)], rel=1e-6)  # sigmoid(ln 3) = 0.75
    huber = Huber(None, delta=1.0).per_row_loss(torch.tensor([[0.5], [3.0]]), torch.tensor([0.0, 0.0]))
    assert huber.tolist() == pytest.approx([0.125, 2.5])  # 0.5 e² inside delta, delta (|e| - delta/2) outside
    # Averaged over the row's 2 labels: (ln 2 + ln 2) / 2, whatever the label count.
    multi = Multilabel(2).per_row_loss(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))
    assert multi.tolist() == pytest.approx([math.log(2.0)], rel=1e-6)


def test_bf16_outputs_get_an_fp32_loss():
    logits = torch.tensor([[0.1, 0.7, -0.3]], dtype=torch.bfloat16)
    assert Softmax(3).per_row_loss(logits, torch.tensor([2])).dtype == torch.float32


# --- the exact denominator: Σ w·ℓ / Σ w over the global batch ----------------------------------------------


class RecordingSGD(torch.optim.SGD):
    """lr 0: records each step's gradients and leaves the weights alone."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.steps: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.steps.append([p.grad.clone() for group in self.param_groups for p in group["params"]])


def simulated_ddp_gradients(split, objective, world: int, batch: int) -> list[list[torch.Tensor]]:
    """Each optimizer step's gradient as DDP would all-reduce it: the mean over ``world`` ranks."""
    per_rank = []
    for rank in range(world):
        torch.manual_seed(0)
        model = NumericLinear(split.features.shape[1], 3)
        optimizer = RecordingSGD(model.parameters())
        batches = TrainBatches(
            split, rank, world, batch, seed=5, device=torch.device("cpu"), pin_memory=False,
            row_weights=objective.row_weights(split.labels),
        )  # fmt: skip
        settings = StepSettings("classification", torch.device("cpu"), objective=objective)
        step = TrainStep(model, optimizer, None, batches, settings)
        for index, rows in enumerate(batches.epoch(0)):
            step(index, rows)
        per_rank.append(optimizer.steps)
    return [[sum(grads) / world for grads in zip(*steps)] for steps in zip(*per_rank)]


def test_class_weighted_steps_are_the_weighted_mean_on_any_world_size():
    """23 rows, 3 classes, balanced weights: every step of 2 ranks x 4 and of 1 rank x 8 has the gradient of
    torch's cross_entropy(weight=..., reduction='mean') over that step's global batch (the last one short)."""
    generator = torch.Generator().manual_seed(3)
    split = SplitTensors(torch.randn(23, 4, generator=generator), torch.tensor([0] * 12 + [1] * 8 + [2] * 3))
    objective = make_objective("softmax", "classification", 3)
    objective.class_weights = class_weight_vector("balanced", ["a", "b", "c"], [12, 8, 3], "test")
    two_ranks = simulated_ddp_gradients(split, objective, world=2, batch=4)
    one_rank = simulated_ddp_gradients(split, objective, world=1, batch=8)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(5)).tolist()  # DistributedSampler's
    assert len(two_ranks) == len(one_rank) == 3  # 8 + 8 + 7 rows
    for step, (a, b) in enumerate(zip(two_ranks, one_rank)):
        rows = torch.tensor(order[step * 8 : (step + 1) * 8])
        torch.manual_seed(0)
        reference = torch.nn.Linear(4, 3)
        F.cross_entropy(reference(split.features[rows]), split.labels[rows], weight=objective.class_weights).backward()
        for got_two, got_one, want in zip(a, b, [reference.weight.grad, reference.bias.grad]):
            torch.testing.assert_close(got_two, want, atol=1e-6, rtol=0)
            torch.testing.assert_close(got_one, want, atol=1e-6, rtol=0)


def test_global_weight_is_the_weight_of_the_steps_rows_on_all_ranks():
    split = SplitTensors(torch.zeros(7, 1), torch.tensor([0, 1, 1, 0, 1, 0, 0]))
    weights = torch.tensor([1.0, 10.0, 10.0, 1.0, 10.0, 1.0, 1.0])
    batches = [TrainBatches(split, r, 2, 2, 0, torch.device("cpu"), False, row_weights=weights) for r in (0, 1)]
    seen = [[], []]
    for rank, rank_batches in enumerate(batches):
        for batch in rank_batches.epoch(0):
            seen[rank].append(float(batch.weights.sum()))
    # Step s of both ranks together: the same Σ w on each rank, and the epoch's total is every row's once.
    for step in range(len(batches[0])):
        total = seen[0][step] + seen[1][step]
        assert batches[0].global_weight(step, step + 1) == batches[1].global_weight(step, step + 1) == total
    assert batches[0].global_weight(0, len(batches[0])) == 34.0
    unweighted = TrainBatches(split, 0, 2, 2, 0, torch.device("cpu"), False)
    assert unweighted.global_weight(0, 2) == unweighted.global_rows(0, 2) == 7  # no weights: the row count


# --- class weights, auto, errors ------------------------------------------------------------------------


def test_balanced_class_weights_are_n_over_classes_times_count():
    weights = class_weight_vector("balanced", ["x", "y", "z"], [6, 3, 1], "test")
    assert weights.tolist() == pytest.approx([10 / 18, 10 / 9, 10 / 3])
    named = class_weight_vector({"z": 4.0}, ["x", "y", "z"], None, "test")
    assert named.tolist() == [1.0, 1.0, 4.0]
    with pytest.raises(ConfigError, match=r"labels \['w'\] are not classes of test"):
        class_weight_vector({"w": 2.0}, ["x", "y", "z"], None, "test")


class FakeManifest:
    def __init__(self, task="classification", label_mapping=("a", "b"), counts=None):
        self.task, self.label_mapping, self.train_class_counts = task, list(label_mapping), counts
        self.fingerprint, self.extra = "fp-x", {}


def train(*overrides: str):
    return load_config(None, list(overrides)).train


def test_auto_keeps_softmax_for_two_classes_and_mse_for_regression():
    assert build_objective(train(), FakeManifest()).name == "softmax"
    assert build_objective(train(), FakeManifest()).n_outputs(2) == 2  # today's models: the same weights
    regression = build_objective(train(), FakeManifest("regression", ()))
    assert regression.name == "mse" and regression.n_outputs(None) == 1
    assert build_objective(train("train.objective=binary"), FakeManifest()).n_outputs(2) == 1


@pytest.mark.parametrize(
    ("overrides", "manifest", "message"),
    [
        (["train.objective=binary"], FakeManifest(label_mapping="abc"), "'binary' needs a label of exactly 2 classes"),
        (["train.objective=huber"], FakeManifest(), "'huber' is a regression objective"),
        (["train.label_smoothing=0.1"], FakeManifest("regression", ()), "softmax objective only; .* 'mse'"),
        (["train.class_weights=balanced"], FakeManifest(), "needs the train split's class counts"),
        (["train.class_weights=balanced"], FakeManifest("regression", ()), "applies to class labels"),
        (["train.objective=nowhere.module:make"], FakeManifest(), "cannot import module 'nowhere.module'"),
    ],
)
def test_an_objective_that_does_not_fit_is_named(overrides, manifest, message):
    with pytest.raises(ConfigError, match=message):
        build_objective(train(*overrides), manifest)


USER_OBJECTIVES = """
import torch
from training.objectives.base import Objective


class Absolute(Objective):
    def per_row_loss(self, outputs, labels):
        return (outputs.reshape(labels.shape) - labels).abs()

    def metric_names(self):
        return ("within_one",)

    def row_metrics(self, outputs, labels):
        return {"within_one": ((outputs.reshape(labels.shape) - labels).abs() < 1).float()}


class Summed(Objective):
    def per_row_loss(self, outputs, labels):
        return (outputs.reshape(labels.shape) - labels).abs().sum()  # one number, not one per row


def absolute(n_classes, **kwargs):
    return Absolute(n_classes)


def summed(n_classes):
    return Summed(n_classes)


def not_an_objective(n_classes):
    return "mse"
"""


@pytest.fixture
def user_objectives(tmp_path, monkeypatch):
    (tmp_path / "my_objectives.py").write_text(textwrap.dedent(USER_OBJECTIVES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_objectives"
    sys.modules.pop("my_objectives", None)


def test_a_user_objective_trains_and_reports_the_metrics_it_names(user_objectives):
    objective = build_objective(train(f"train.objective={user_objectives}:absolute"), FakeManifest("regression", ()))
    check_objective(objective, None)
    tally = objective.tally(None)
    tally.add(torch.tensor([[0.5], [3.0]]), torch.tensor([0.0, 0.0]))
    assert tally.metrics(tally.sums(), "val") == {"val_loss": 1.75, "val_within_one": 0.5}
    assert objective.describe() == {"name": f"{user_objectives}:absolute", "kwargs": {}}


def test_a_user_objective_of_the_wrong_shape_or_type_is_named(user_objectives):
    summed = build_objective(train(f"train.objective={user_objectives}:summed"), FakeManifest("regression", ()))
    with pytest.raises(ConfigError, match=r"my_objectives:summed.per_row_loss returned shape \(\) .*shape \(2,\)"):
        check_objective(summed, None)
    with pytest.raises(ConfigError, match="returned str; it must return a training.objectives.registry.Objective"):
        build_objective(train(f"train.objective={user_objectives}:not_an_objective"), FakeManifest())


# --- metrics: known answers --------------------------------------------------------------------------------


def one_hot_logits(predicted: list[int], classes: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(predicted), classes).float() * 5.0


def test_softmax_metrics_are_the_known_answers():
    # sklearn's f1_score docs example: macro F1 0.2666..., accuracy 2/6.
    tally = Softmax(3).tally(3)
    tally.add(one_hot_logits([0, 2, 1, 0, 0, 1], 3), torch.tensor([0, 1, 2, 0, 1, 2]))
    metrics = tally.metrics(tally.sums(), "val")
    assert metrics["val_accuracy"] == pytest.approx(2 / 6)
    assert metrics["val_macro_f1"] == pytest.approx(0.26666666666666666)
    assert "val_top5_accuracy" not in metrics  # only above 10 classes
    uniform = Softmax(3).tally(3)
    uniform.add(torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]))
    assert uniform.metrics(uniform.sums(), "test")["test_log_loss"] == pytest.approx(math.log(3), rel=1e-6)


def test_top5_accuracy_counts_a_label_among_the_five_most_likely_above_ten_classes():
    logits = torch.arange(12, dtype=torch.float32).repeat(3, 1)  # class 11 most likely, then 10, 9, 8, 7
    tally = Softmax(12).tally(12)
    tally.add(logits, torch.tensor([7, 6, 11]))  # rank 5, rank 6, rank 1
    metrics = tally.metrics(tally.sums(), "val")
    assert metrics["val_top5_accuracy"] == pytest.approx(2 / 3) and metrics["val_accuracy"] == pytest.approx(1 / 3)


def test_multilabel_micro_and_macro_f1_are_the_known_answers():
    # label 0: F1 1; label 1: 1 TP, 1 FN -> 2/3; label 2: 1 FP, 1 FN -> 0. Micro: 2 TP, 1 FP, 2 FN -> 4/7.
    tally = Multilabel(3).tally(3)
    truth = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    predicted = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, 1.0]])  # logits: > 0 means predicted
    tally.add(predicted, truth)
    metrics = tally.metrics(tally.sums(), "val")
    assert metrics["val_macro_f1"] == pytest.approx(5 / 9)
    assert metrics["val_micro_f1"] == pytest.approx(4 / 7)
    assert metrics["val_exact_match"] == 0.0


def test_tallies_add_up_across_batches_and_ranks_like_one_pass():
    logits, labels = torch.randn(40, 4, generator=torch.Generator().manual_seed(1)), torch.arange(40) % 4
    whole, halves = Softmax(4).tally(4), [Softmax(4).tally(4), Softmax(4).tally(4)]
    whole.add(logits, labels)
    halves[0].add(logits[:13], labels[:13])
    halves[1].add(logits[13:], labels[13:])
    summed = halves[0].sums() + halves[1].sums()  # what the all-reduce of the ranks' vectors gives
    assert whole.metrics(summed, "val") == pytest.approx(whole.metrics(whole.sums(), "val"), rel=1e-12)


@pytest.mark.parametrize(
    ("scores", "labels", "auc"),
    [
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),  # sklearn's roc_auc_score docs example
        ([1.0, 2.0, 2.0, 3.0], [0, 0, 1, 1], 0.875),  # a tie between a positive and a negative counts 1/2
        ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),  # all tied: chance
        ([0.9, 0.8, 0.1], [1, 1, 0], 1.0),
    ],
)
def test_roc_auc_is_the_known_answer_with_ties(scores, labels, auc):
    assert roc_auc(np.array(scores), np.array(labels)) == pytest.approx(auc)


def test_roc_auc_is_undefined_for_one_class():
    assert math.isnan(roc_auc(np.array([0.2, 0.3]), np.array([1, 1])))


@pytest.mark.parametrize(
    ("scores", "labels", "average_precision"),
    [
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 5 / 6),  # sklearn's average_precision_score docs example
        ([1.0, 2.0, 2.0, 3.0], [0, 0, 1, 1], 0.5 * 1 + 0.5 * 2 / 3),  # tied rows enter at one threshold
        ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),  # all tied: the positives' share
        ([0.9, 0.8, 0.1], [1, 1, 0], 1.0),
        ([0.3, 0.2], [1, 1], 1.0),  # no negative: every threshold is precise
    ],
)
def test_pr_auc_is_the_average_precision_with_ties(scores, labels, average_precision):
    assert pr_auc(np.array(scores), np.array(labels)) == pytest.approx(average_precision, abs=1e-12)
    assert math.isnan(pr_auc(np.array([0.2, 0.3]), np.array([0, 0])))


# --- the preflight ----------------------------------------------------------------------------------------


def test_the_preflight_names_an_objective_that_does_not_import_fit_or_return_one_loss_per_row(
    dataset_factory, user_objectives
):
    from training.core.manifest import read_manifest
    from training.preflight import check_data, check_machine

    with pytest.raises(ConfigError, match="train.objective: cannot import module 'nowhere'"):
        check_machine(load_config(None, ["train.objective=nowhere:make"]), gpus=0)
    manifest = read_manifest(dataset_factory(n_classes=3, rows={"train": 200, "val": 20, "test": 20}))
    small = ["train.batch_size=16"]
    config = load_config(None, [*small, "train.objective=binary"])
    with pytest.raises(ConfigError, match="'binary' needs a label of exactly 2 classes; this one has 3"):
        check_data(config, manifest, check_machine(config, gpus=0))
    config = load_config(None, [*small, f"train.objective={user_objectives}:summed"])
    with pytest.raises(ConfigError, match=r"summed.per_row_loss failed on outputs of shape \(2, 3\)"):
        check_data(config, manifest, check_machine(config, gpus=0))  # a value loss on 3 class logits
    regression = read_manifest(dataset_factory(task="regression", rows={"train": 200, "val": 20, "test": 20}))
    with pytest.raises(ConfigError, match=r"summed.per_row_loss returned shape \(\) .* shape \(2,\)"):
        check_data(config, regression, check_machine(config, gpus=0))
    fine = load_config(None, [*small, "train.class_weights={cat: 2.0}", "train.label_smoothing=0.1"])
    check_data(fine, manifest, check_machine(fine, gpus=0))


def test_prepare_records_the_train_splits_class_counts(tmp_path):
    import pyarrow.parquet as pq

    from training.prepare.dataset import prepare_dataset

    data = load_config(
        None,
        ["data.source=synthetic://classification?rows=900&features=3&classes=3&seed=2", f"data.root={tmp_path}"],
    ).data
    prepared = prepare_dataset(data)
    manifest = prepared.manifest
    labels = np.concatenate(
        [pq.read_table(path)["label"].to_numpy() for path in manifest.split_files(prepared.dataset_dir, "train")]
    )
    assert manifest.train_class_counts == np.bincount(labels, minlength=3).tolist()
    assert sum(manifest.train_class_counts) == manifest.rows("train")


@pytest.mark.parametrize("objective", [Binary(2), Softmax(2), Softmax(3), make_objective("huber", "regression", None)])
def test_validation_sharded_over_ranks_reports_what_one_pass_does(objective):
    """Two ranks' slices of the val split, their sums added (the all-reduce) and scored rows gathered, give
    the metrics of one pass over the whole split: ROC AUC and PR AUC included for two classes, whichever
    objective (binary's logit, softmax's log-odds of class 1)."""
    from training.loop.step import validate, validation_metrics

    generator = torch.Generator().manual_seed(4)
    classes = objective.n_classes or 0
    labels = (
        torch.randint(0, classes, (101,), generator=generator) if classes else torch.randn(101, generator=generator)
    )
    split = SplitTensors(torch.randn(101, 5, generator=generator), labels)
    torch.manual_seed(0)
    model = NumericLinear(5, objective.n_outputs(objective.n_classes))
    settings = StepSettings("classification" if classes else "regression", torch.device("cpu"), objective=objective)
    whole = validate(model, split, 0, 101, 16, settings)
    shards = [validate(model, split, 0, 50, 16, settings), validate(model, split, 50, 101, 7, settings)]
    gathered = [shard.scored for shard in shards] if whole.scored is not None else None
    one = validation_metrics(whole.sums.tolist(), settings, 2.0, [whole.scored] if whole.scored else None)
    two = validation_metrics((shards[0].sums + shards[1].sums).tolist(), settings, 2.0, gathered)
    # Counts are exact; float32 outputs of other batch sizes differ in the last bits.
    assert one == pytest.approx(two, rel=1e-6) and one["val_samples"] == 101
    expected = {Binary: "val_roc_auc", Softmax: "val_macro_f1", Huber: "val_rmse"}[type(objective)]
    assert expected in one
    assert ("val_roc_auc" in one, "val_pr_auc" in one) == (classes == 2, classes == 2)
    if classes == 2:
        outputs = model.linear(split.features).detach()
        scores = (outputs[:, 1] - outputs[:, 0] if outputs.shape[1] == 2 else outputs.reshape(-1)).numpy()
        assert one["val_roc_auc"] == pytest.approx(roc_auc(scores, (labels == 1).numpy()))
        assert one["val_pr_auc"] == pytest.approx(pr_auc(scores, (labels == 1).numpy()))
