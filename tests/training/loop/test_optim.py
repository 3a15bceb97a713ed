"""The optimizer's parameter groups, its choice and keywords, the warmup schedule, the optimizer state that
placement counts, and the selection rules (no ranks: the pieces the Trainer is built from)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from training.core.config import ConfigError, load_config
from training.loop.optim import build_optimizer, build_schedule, optimizer_states_per_parameter, param_groups
from training.loop.selection import Selection

REPO = Path(__file__).resolve().parents[3]


def train_config(*overrides: str):
    return load_config(None, [f"train.{text}" for text in overrides]).train


class RMSNorm(nn.Module):  # a user's norm: recognised by its class name
    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width, 1))  # 2-D on purpose: the module, not the shape, exempts it

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain.squeeze(-1)


class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.linear = nn.Linear(4, 4)
        self.layer_norm = nn.LayerNorm(4)
        self.batch_norm = nn.BatchNorm1d(4)
        self.rms = RMSNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight  # tied: one parameter, listed once, not decayed


def test_weight_decay_applies_to_weight_matrices_only():
    model = Everything()
    decayed, exempt = param_groups(model, weight_decay=0.1)
    names = {id(param): name for name, param in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and [names[id(p)] for p in decayed["params"]] == ["linear.weight"]
    assert exempt["weight_decay"] == 0.0
    assert sorted(names[id(p)] for p in exempt["params"]) == [
        "batch_norm.bias", "batch_norm.weight", "embedding.weight", "layer_norm.bias", "layer_norm.weight",
        "linear.bias", "rms.gain",
    ]  # fmt: skip
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("overrides", "kind", "expected"),
    [
        ((), torch.optim.AdamW, {"betas": (0.9, 0.999)}),
        (("optimizer=adam", "optimizer_kwargs={betas: [0.8, 0.9]}"), torch.optim.Adam, {"betas": (0.8, 0.9)}),
        (("optimizer=sgd", "optimizer_kwargs={momentum: 0.9, nesterov: true}"), torch.optim.SGD, {"momentum": 0.9}),
    ],
)
def test_the_optimizer_and_its_keywords_are_the_configs(overrides, kind, expected):
    optimizer = build_optimizer(nn.Linear(3, 2), train_config("lr=0.05", "weight_decay=0.2", *overrides))
    assert type(optimizer) is kind
    decayed = optimizer.param_groups[0]
    assert decayed["lr"] == 0.05 and decayed["weight_decay"] == 0.2 and optimizer.param_groups[1]["weight_decay"] == 0
    for key, value in expected.items():
        assert tuple(decayed[key]) == value if isinstance(value, tuple) else decayed[key] == value


def test_bad_optimizer_keywords_are_named():
    with pytest.raises(ValueError, match=r"train.optimizer_kwargs .*'nesterov'.*adamw"):
        build_optimizer(nn.Linear(3, 2), train_config("optimizer_kwargs={nesterov: true}"))
    with pytest.raises(ConfigError, match=r"train.optimizer_kwargs: \['lr'\] have their own train fields"):
        train_config("optimizer_kwargs={lr: 0.1}")
    from training.preflight import check_machine  # before anything starts: the flow's first check

    with pytest.raises(ConfigError, match=r"train.optimizer_kwargs .*'momentum'"):
        check_machine(load_config(None, ["train.optimizer=adam", "train.optimizer_kwargs={momentum: 0.9}"]), gpus=0)


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_the_preflight_builds_no_optimizer_without_keywords(optimizer):
    """Without train.optimizer_kwargs no optimizer can fail (the config bounds lr and weight_decay), so the
    preflight builds none: the first one built in a process imports torch._dynamo, a second of CPU before the ranks
    start. In a fresh interpreter, as the train task runs it; the ranks build theirs."""
    program = (
        "import sys\n"
        "from training.core.config import load_config\n"
        "from training.preflight import check_machine\n"
        f"check_machine(load_config(None, ['train.optimizer={optimizer}']), gpus=0)\n"
        "print('torch' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"], done.stdout


def lrs(schedule: str, warmup: int, steps: int, lr: float = 0.1) -> list[float]:
    config = train_config(f"lr={lr}", f"warmup_steps={warmup}", f"lr_schedule={schedule}")
    optimizer = build_optimizer(nn.Linear(2, 1), config)
    scheduler = build_schedule(optimizer, config, steps)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return seen


def test_warmup_rises_linearly_to_the_lr_then_holds_it():
    assert lrs("constant", warmup=4, steps=7) == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1], abs=1e-12)
    assert lrs("constant", warmup=0, steps=3) == [0.1, 0.1, 0.1]


def test_after_warmup_the_cosine_covers_the_steps_left():
    cosine = [0.05 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]  # 10 steps - 4 of warmup
    assert lrs("cosine", warmup=4, steps=10) == pytest.approx([0.025, 0.05, 0.075, 0.1, *cosine], abs=1e-12)


def test_without_warmup_the_cosine_is_the_one_before_warmup_existed():
    config = train_config("lr=0.1", "lr_schedule=cosine")
    reference = torch.optim.AdamW(nn.Linear(2, 1).parameters(), lr=0.1)
    torch_cosine = torch.optim.lr_scheduler.CosineAnnealingLR(reference, T_max=9)
    expected = []
    for _ in range(9):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        torch_cosine.step()
    assert type(build_schedule(build_optimizer(nn.Linear(2, 1), config), config, 9)).__name__ == "CosineAnnealingLR"
    assert lrs("cosine", warmup=0, steps=9) == expected  # bit for bit


@pytest.mark.parametrize(
    ("overrides", "states"),
    [((), 2), (("optimizer=adam", "optimizer_kwargs={amsgrad: true}"), 3), (("optimizer=sgd",), 0),
     (("optimizer=sgd", "optimizer_kwargs={momentum: 0.9}"), 1)],
)  # fmt: skip
def test_placement_counts_the_chosen_optimizers_state(overrides, states):
    from training.loading.placement import training_state_to_come

    config = train_config(*overrides)
    assert optimizer_states_per_parameter(config) == states
    model = nn.Linear(10, 10)  # 110 float32 parameters
    assert training_state_to_come(model, optimizer_states_per_parameter(config)) == (1 + states) * 110 * 4


# --- selection and early stopping (training/loop/selection.py) ------------------------------------------------


def judged(values: list[float], *overrides: str) -> Selection:
    selection = Selection.from_config(train_config(*overrides))
    for epoch, value in enumerate(values):
        if selection.stopped:
            break
        metric = selection.monitor
        selection.observe(epoch, {metric: value, "val_samples": 10})
    return selection


def test_the_monitor_direction_is_the_gates_rule_or_given():
    assert judged([3.0, 1.0, 2.0]).best_epoch == 1  # val_loss: lower is better
    assert judged([0.5, 0.9, 0.7], "monitor=val_accuracy").best_epoch == 1  # higher is better
    assert judged([3.0, 1.0, 2.0], "monitor=val_loss", "monitor_mode=max").best_epoch == 0
    with pytest.raises(ConfigError, match="train.monitor: 'test_rmse' is not a validation metric"):
        train_config("monitor=test_rmse")
    with pytest.raises(
        ValueError,
        match=r"train.monitor='val_f1' is not a validation metric of this run; it has \['val_loss', 'val_rmse'\]",
    ):
        Selection.from_config(train_config("monitor=val_f1")).observe(0, {"val_loss": 1.0, "val_rmse": 1.0})


def test_patience_counts_epochs_without_an_improvement_beyond_min_delta():
    selection = judged([1.0, 0.95, 0.99, 0.7, 0.69, 0.695, 0.5], "early_stopping_patience=2", "min_delta=0.02")
    # 0.95 and 0.69 do not beat the best by more than 0.02: epochs 1-2 and 4-5 are two without improvement.
    assert (selection.best_epoch, selection.stopped, selection.epochs_without_improvement) == (3, True, 2)
    assert judged([1.0, 2.0, 3.0, 4.0]).stopped is False  # no patience: never stops


def test_without_a_val_split_the_last_epoch_is_selected_and_early_stopping_is_refused(tmp_path):
    from manifest_datasets import make_dataset

    from training.core.manifest import read_manifest
    from training.preflight import check_data, check_machine

    selection = Selection.from_config(train_config("early_stopping_patience=1"))
    for epoch in range(3):
        assert selection.observe(epoch, {"val_samples": 0}) is False
    assert selection.selected_epoch(last_epoch=2) == 2 and not selection.stopped
    manifest = read_manifest(make_dataset(tmp_path, rows={"train": 64, "val": 0, "test": 8}))
    config = load_config(None, ["train.early_stopping_patience=2", "train.batch_size=8", "train.nproc_per_node=1"])
    with pytest.raises(ConfigError, match="train.early_stopping_patience: the val split is empty"):
        check_data(config, manifest, check_machine(config, gpus=0))


def test_a_nan_never_improves_and_select_last_takes_the_last_epoch():
    assert judged([float("nan"), 2.0, float("nan")]).best_epoch == 1
    assert judged([float("nan")]).selected_epoch(last_epoch=0) == 0
    assert judged([1.0, 2.0], "select=last").selected_epoch(last_epoch=1) == 1


def test_the_selection_resumes_from_its_state():
    before = judged([1.0, 0.5, 0.6], "early_stopping_patience=3")
    resumed = Selection.from_config(train_config("early_stopping_patience=3"))
    resumed.load_state_dict(before.state_dict())
    resumed.observe(3, {"val_loss": 0.7})
    assert (resumed.best_epoch, resumed.epochs_without_improvement, resumed.stopped) == (1, 2, False)
    resumed.observe(4, {"val_loss": 0.8})
    assert resumed.stopped
