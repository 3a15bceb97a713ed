"""A sweep's ``sweep:`` section: what it tunes, how, and every check that refuses it before anything starts.

    sweep:
      trials: 24
      parallel: 1                 # trials at once; each takes train.nproc_per_node ranks
      objective: val_loss         # a validation metric; its direction from the gate's rule
      sampler: tpe                # tpe | random | grid
      pruner: median              # median | asha | none
      space:
        train.lr: {low: 1.0e-4, high: 3.0e-2, log: true}
        train.model_kwargs.hidden: {choices: [[128], [256, 256]]}
        train.epochs: {low: 2, high: 8}          # both ends integers on an integer field: whole numbers

``load_sweep(path, overrides)`` -> ``Sweep``: the base ``PipelineConfig`` (the file without its ``sweep``
section) and the validated ``SweepConfig``. Every trial trains on the base config with its own values of
the space's keys applied as ``--set`` overrides (``Sweep.trial_config``); only ``train.*`` keys that change
the weights may vary, so every trial shares one prepared dataset. Every error is a ``ConfigError`` naming
``sweep.<field>``: an empty space, a key that does not exist, a ``data.*`` key, ``low > high``, ``log`` with
``low <= 0``, an end of a range or a choice the field itself refuses, a test metric as the objective, more
ranks at once than the machine has (``check_sweep_machine``). A training script's sweep tunes its
``train.script_params.KEY`` (or any weight-changing train key) and is judged by the metric it reports.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.core.config import (
    ConfigError,
    PipelineConfig,
    TrainConfig,
    apply_overrides,
    format_validation_error,
    read_yaml,
    validate_config,
)
from training.core.digest import json_digest
from training.core.directions import higher_is_better
from training.core.topology import RankLayout
from training.kinds.registry import hashed_inputs

SECTION = "sweep"
# train dicts whose keys belong to the model, the optimizer or a training script (its --key value arguments)
FREE_FORM = ("model_kwargs", "optimizer_kwargs", "script_params")
# Weight-changing train fields that are the sweep's shape, not a hyperparameter of one trial.
NOT_TUNABLE = {
    "nproc_per_node": "every trial runs on the same ranks (parallel x nproc_per_node is checked against the machine)",
    "nnodes": "every trial runs on the same nodes",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Dimension(_Strict):
    """One entry of ``sweep.space``: a range ``{low, high, log}`` or a list ``{choices: [...]}``."""

    low: int | float | None = None  # pydantic's smart union keeps an integer an integer
    high: int | float | None = None
    log: bool = False
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _a_range_or_choices(self) -> Dimension:
        if self.choices is not None:
            if self.low is not None or self.high is not None or self.log:
                raise ValueError("give either choices or a range (low, high, log), not both")
            if not self.choices:
                raise ValueError("choices is empty: list at least one value")
            return self
        if self.low is None or self.high is None:
            raise ValueError("a range needs both low and high (or give choices: [...])")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low above 0 (got low={self.low:g}): a log scale has no 0")
        return self

    @property
    def values_to_check(self) -> list[Any]:
        """What a trial may be given at the edges: each choice, or both ends of the range."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SweepConfig(_Strict):
    trials: int = Field(..., ge=1, description="Trials in all, a resumed sweep's included.")
    parallel: int = Field(1, ge=1, description="Trials at once; each takes train.nproc_per_node ranks.")
    objective: str | None = Field(
        None,
        description="The validation metric a trial is judged by (default train.monitor); never a test metric. A "
        "training script's trial: the metric it reports (ddpflow.report), required.",
    )
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Literal["median", "asha", "none"] = "median"
    startup_trials: int = Field(
        5, ge=0, description="median pruner: trials that finish before it prunes any (Optuna's n_startup_trials)."
    )
    space: dict[str, Dimension] = Field(default_factory=dict)
    seed: int = Field(0, description="The sampler's seed: the same config samples the same trials.")
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list, description="Points tried first, each {key: value} over space keys (others sampled)."
    )
    name: str | None = Field(None, description="The study's name; default: from the model name and the config.")

    @field_validator("space")
    @classmethod
    def _not_empty(cls, value: dict[str, Dimension]) -> dict[str, Dimension]:
        if not value:
            raise ValueError("the space is empty: name at least one train.* key to tune, e.g. train.lr")
        return value


@dataclass(frozen=True)
class Sweep:
    """The base config every trial starts from, its raw form (overrides apply to it), and the sweep section."""

    base: PipelineConfig
    raw: dict[str, Any]
    sweep: SweepConfig

    @property
    def objective(self) -> str:
        return self.sweep.objective or self.base.train.monitor

    @property
    def maximize(self) -> bool:
        """The gate's rule on the objective's name (training/core/directions.py)."""
        return higher_is_better(self.objective)

    def trial_config(self, params: dict[str, Any]) -> PipelineConfig:
        """The base config with a trial's values (``{"train.lr": 0.01}``) set as ``--set`` would set them."""
        raw = json.loads(json.dumps(self.raw))  # a deep copy
        for key, value in params.items():
            _set(raw, key, value)
        return validate_config(raw)

    def as_raw(self) -> dict[str, Any]:
        """The whole config again, its sweep section included (what the flow takes as a parameter)."""
        return {**json.loads(json.dumps(self.raw)), SECTION: self.sweep.model_dump(mode="json", exclude_unset=True)}

    def study_name(self) -> str:
        """``sweep.name``, else ``<model>-<12 hex>`` of the config and the space (not ``trials`` or
        ``parallel``): the same command finds the same study, and more trials continue it."""
        if self.sweep.name:
            return self.sweep.name
        shape = self.sweep.model_dump(mode="json", exclude={"trials", "parallel", "name"})
        base = self.base.model_dump(mode="json")
        if self.base.data is not None:  # its inputs as a hash reads them (training/kinds/registry.py)
            base["data"]["inputs"] = hashed_inputs(self.base.data)
        digest = json_digest({"base": base, "sweep": shape}, 12, compact=False)
        return f"{self.base.registry.model_name}-{digest}"


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def load_sweep(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Sweep:
    """The file's ``sweep`` section validated, and the rest as the base config (``--set`` applies to both)."""
    raw = apply_overrides(read_yaml(path) if path else {}, list(overrides or []))
    return sweep_from_raw(raw)


def sweep_from_raw(raw: dict[str, Any]) -> Sweep:
    """``raw``: a whole config, its ``sweep`` section included (the flow's parameter form)."""
    raw = json.loads(json.dumps(raw))
    section = raw.pop(SECTION, None)
    if section is None:
        raise ConfigError("sweep: the config has no sweep section (trials, objective, space...); see docs/sweeps.md")
    try:
        sweep = SweepConfig.model_validate(section)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error).replace(": ", ": sweep.", 1)) from None
    base = validate_config(raw)
    _check_objective(sweep.objective, base)
    result = Sweep(base, raw, sweep)
    for key, dimension in sweep.space.items():
        _check_key(key)
        _check_values(result, key, dimension)
    _check_enqueued(sweep)
    _check_grid(result)
    return result


def _check_objective(objective: str | None, base: PipelineConfig) -> None:
    """ddpflow's trainer: a validation metric (the test split is the best trial's alone, through the gate). A
    training script: the metric it reports, named, whatever its split (the script's data is its own)."""
    if base.train.script:
        if objective is None:
            raise ConfigError(
                "sweep.objective: name the metric your script reports (ddpflow.report) that a trial is judged by"
            )
        return
    if objective is not None and not objective.startswith("val_"):
        why = " (the test split is only for the best trial, through the gate)" if objective.startswith("test_") else ""
        raise ConfigError(
            f"sweep.objective: {objective!r} is not a validation metric{why}: name one such as val_loss or val_accuracy"
        )


def _check_key(key: str) -> None:
    """A ``train.*`` field that changes the weights, or a key of its free-form dicts."""
    where = f"sweep.space.{key}"
    section, _, rest = key.partition(".")
    if section == "data":
        raise ConfigError(
            f"{where}: a data.* key would change the prepared dataset; every trial trains on the same prepared "
            "data, so a sweep tunes train.* keys only (prepare once, tune many)"
        )
    if section != "train" or not rest:
        raise ConfigError(f"{where}: a sweep tunes train.* keys only (e.g. train.lr, train.model_kwargs.hidden)")
    field, _, sub = rest.partition(".")
    if field not in TrainConfig.model_fields:
        raise ConfigError(f"{where}: train has no field {field!r}")
    if sub and field not in FREE_FORM:
        raise ConfigError(f"{where}: train.{field} has no keys to tune; only {list(FREE_FORM)} do")
    if field in FREE_FORM and not sub:
        raise ConfigError(f"{where}: name one key of train.{field}, e.g. train.{field}.hidden")
    if field in NOT_TUNABLE:
        raise ConfigError(f"{where}: not tunable: {NOT_TUNABLE[field]}")
    if field not in TrainConfig.weight_fields():
        raise ConfigError(f"{where}: train.{field} does not change the trained weights; nothing to tune")


def _check_values(sweep: Sweep, key: str, dimension: Dimension) -> None:
    """Each choice, and both ends of a range, as the trial's config would hold them: the field's own rules."""
    for value in dimension.values_to_check:
        value = int(value) if dimension.choices is None and is_integer_range(key, dimension) else value
        try:
            sweep.trial_config({key: value})
        except ConfigError as error:
            raise ConfigError(f"sweep.space.{key}: {value!r} is refused: {error}") from None


def _check_enqueued(sweep: SweepConfig) -> None:
    for index, point in enumerate(sweep.enqueue):
        unknown = sorted(set(point) - set(sweep.space))
        if unknown:
            raise ConfigError(f"sweep.enqueue[{index}]: {unknown} are not keys of sweep.space")


def _check_grid(sweep: Sweep) -> None:
    if sweep.sweep.sampler != "grid":
        return
    for key, dimension in sweep.sweep.space.items():
        if dimension.choices is None and not is_integer_range(key, dimension):
            raise ConfigError(
                f"sweep.space.{key}: sampler grid needs choices or an integer range; "
                f"give choices: [...] or use sampler tpe or random"
            )
    points = 1
    for dimension in sweep.sweep.space.values():
        points *= len(dimension.choices) if dimension.choices is not None else int(dimension.high - dimension.low) + 1
    if sweep.sweep.trials > points:
        raise ConfigError(
            f"sweep.trials: {sweep.sweep.trials} trials, but the grid has {points} point(s): every trial beyond "
            "them would repeat one; lower sweep.trials or widen the space"
        )


def is_integer_range(key: str, dimension: Dimension) -> bool:
    """Whole numbers: both ends written as integers, on an integer field (or a model/optimizer keyword)."""
    if dimension.choices is not None or not (_is_int(dimension.low) and _is_int(dimension.high)):
        return False
    field = key.split(".")[1]
    if field in FREE_FORM:
        return True
    annotation = str(TrainConfig.model_fields[field].annotation)
    return "int" in annotation and "float" not in annotation


def check_sweep_machine(sweep: Sweep, layout: RankLayout) -> None:
    """``parallel`` trials of ``nproc_per_node`` ranks each must fit this machine at once (local launcher;
    Slurm queues each trial's job on nodes of its own)."""
    if sweep.base.train.launcher != "local":
        return
    wanted = sweep.sweep.parallel * layout.nproc_per_node
    if wanted > layout.slots:
        raise ConfigError(
            f"sweep.parallel: {sweep.sweep.parallel} trials at once x {layout.nproc_per_node} rank(s) each = "
            f"{wanted} ranks, but this machine has {layout.slots} {layout.slot_kind}"
        )
