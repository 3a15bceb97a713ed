"""What a finished training script left for the gate and the registry (no Prefect here).

    outcome = script_outcome(run_dir)        # the exported model (or why there is none) and the reported metrics
    metric, why_not = gate_metric(config, outcome.reported)       # a script without a data section
    model_path = dataset_model_file(run_dir, outcome.program, dataset_dir)   # with one: a model.pt to evaluate

A script's ranks write their files through ddpflow's API (ddpflow/script/): ``ddpflow.report`` appends to
RUN_DIR/script/reports.jsonl, ``ddpflow.log_model`` exports RUN_DIR/script/model.pt2 (or records why it could not).
With a data section the script's model takes the model contract's batch, so ddpflow evaluates it itself, exactly,
on the test split (a model.pt of the program and the dataset's encoders: training/inference/model_file.py:
``exported_checkpoint``), and serves it on the source's raw rows. Without one, the gate judges the metric the
script reported (``gate_metric``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from training.core.config import PipelineConfig
from training.core.fileio import atomic_write, read_metrics_lines
from training.core.layout import FINAL_MODEL, SCRIPT_PROGRAM, SCRIPT_REFUSED, SCRIPT_REPORTS, run_file
from training.core.manifest import read_manifest
from training.kinds.registry import read_encoders

TEST_PREFIX = "test_"  # a script's held-out metrics: what the gate may judge without registry.metric


@dataclass(frozen=True)
class ScriptOutcome:
    """The model a script logged (its program, or torch.export's reason it has none) and its reported metrics."""

    program: Path | None
    refused: str | None
    reported: dict[str, float]  # each metric's last reported value

    def nothing_to_register(self) -> str | None:
        """Why there is no model to register, or None when there is one."""
        if self.program is not None:
            return None
        if self.refused is not None:
            return f"ddpflow.log_model could not export the model: {self.refused.splitlines()[0]}"
        return "the script logged no model (ddpflow.log_model), so there is nothing to register"


def script_outcome(run_dir: str | Path) -> ScriptOutcome:
    program = run_file(run_dir, SCRIPT_PROGRAM)
    refused = _read_json(run_file(run_dir, SCRIPT_REFUSED))
    return ScriptOutcome(
        program if program.is_file() else None,
        refused.get("reason") if refused is not None else None,
        last_reported(run_dir),
    )


def last_reported(run_dir: str | Path) -> dict[str, float]:
    """Each metric's last value in RUN_DIR/script/reports.jsonl (a torn last line is skipped)."""
    values: dict[str, float] = {}
    for line in read_metrics_lines(run_file(run_dir, SCRIPT_REPORTS)):
        values.update(line.get("metrics") or {})
    return values


def gate_metric(config: PipelineConfig, reported: dict[str, float]) -> tuple[str | None, str | None]:
    """The metric the gate judges a script's model on, when ddpflow has no test split of its own: ``registry.metric``
    (it must have been reported), else the one ``test_*`` metric reported. (metric, None), or (None, why not)."""
    wanted = config.registry.metric
    if wanted is not None:
        if wanted in reported:
            return wanted, None
        return None, f"registry.metric {wanted!r} was never reported (ddpflow.report); reported: {sorted(reported)}"
    tests = sorted(name for name in reported if name.startswith(TEST_PREFIX))
    if len(tests) == 1:
        return tests[0], None
    if not tests:
        return None, (
            f"the script reported no {TEST_PREFIX}* metric to judge it on (reported: {sorted(reported) or 'none'}); "
            f"report one (ddpflow.report) or name one with registry.metric"
        )
    return (
        None,
        f"the script reported several {TEST_PREFIX}* metrics {tests}: name the one to judge by in registry.metric",
    )


def dataset_model_file(run_dir: str | Path, program: Path, dataset_dir: str | Path) -> Path:
    """RUN_DIR/model.pt of a script's exported model on its prepared dataset: what ddpflow evaluates and serves."""
    from training.inference.model_file import exported_checkpoint

    manifest = read_manifest(dataset_dir)
    checkpoint = exported_checkpoint(program.read_bytes(), manifest, read_encoders(dataset_dir, manifest))

    def write(handle) -> None:
        import torch

        torch.save(checkpoint, handle)

    return atomic_write(run_file(run_dir, FINAL_MODEL), write)


def _read_json(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
