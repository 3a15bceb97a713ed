"""Batch scoring, end to end (plain Python, no Prefect): the model resolved (MLflow, or a model.pt), the table scored
on torchrun ranks (``ddpflow/launch/scoring.py``), the scoring recorded in MLflow (``ddpflow/tracking/scoring.py``).

    summary = score_table(config)   # config.score: model, source, output, keep, output_kind, nproc_per_node, ...

What `ddpflow score` and the score-pipeline flow call. See docs/scoring.md.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

from ddpflow.launch.scoring import ScoreRequest, run_scoring
from ddpflow.launch.supervisor import OutputLine
from ddpflow.tracking.scoring import ScoringRun, is_model_file, scoring_model
from training.core.config import PipelineConfig


def with_score_settings(
    config: PipelineConfig, model: str | None = None, source: str | None = None, output: str | None = None
) -> PipelineConfig:
    """The config with the command line's --model / --source / --output over its score section."""
    updates = {key: value for key, value in {"model": model, "source": source, "output": output}.items() if value}
    return config.model_copy(update={"score": config.score.model_copy(update=updates)}) if updates else config


def model_spec(config: PipelineConfig) -> str:
    """score.model, else registry.model_name@champion."""
    return config.score.model or f"{config.registry.model_name}@champion"


def score_table(
    config: PipelineConfig,
    on_line: Callable[[OutputLine], None] = print,
    should_cancel: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Score ``config.score.source`` into ``config.score.output``; returns the manifest plus ``elapsed_s`` and
    ``rows_per_s`` (the whole command, start-up included).

    The model is read once (a registered version through MLflow; a model.pt without importing MLflow), while
    torchrun starts where it can (``ddpflow/launch/scoring.py``). The MLflow run is created on a thread as the
    ranks start (``ScoringRun``), and completed once they end."""

    started = time.monotonic()
    spec = model_spec(config)
    tracking_uri = None if is_model_file(spec) else _tracking_uri(config)
    with tempfile.TemporaryDirectory(prefix="ddpflow-score-") as scratch:
        run = ScoringRun(config, tracking_uri)
        request = ScoreRequest(config, lambda: scoring_model(spec, tracking_uri, scratch), on_line=on_line,
                               should_cancel=should_cancel, on_ranks_start=run.start)  # fmt: skip
        try:
            manifest = run_scoring(request)
        except BaseException:
            run.fail()
            raise
        seconds = time.monotonic() - started
        summary = {**manifest, "output": config.score.output, "elapsed_s": round(seconds, 3),
                   "rows_per_s": round(manifest["rows"] / seconds, 1) if seconds > 0 else None}  # fmt: skip
        if manifest.get("already_complete"):
            return summary  # recorded when it was scored
        model = run.model
        distribution, profile = table_statistics(config, model.file.meta, manifest, model.registered)
    run_id, drift = run.finish(summary, distribution, profile)
    return {**summary, "mlflow_run_id": run_id, "score_distribution": distribution, "data_drift": drift.summary()}


def _tracking_uri(config: PipelineConfig) -> str:
    from ddpflow.tracking.tracking_uri import resolve_tracking_uri

    return resolve_tracking_uri(config)


def table_statistics(
    config: PipelineConfig, meta: dict[str, Any], manifest: dict[str, Any], registered: bool = True
) -> tuple[dict[str, float], dict[str, Any] | str]:
    """The scores' distribution (read back from the parts) and the scored table's drift profile (the parts'
    footers merged: ``training/inference/scored_drift.py``), or why there is none: drift compares it with the
    training data of a registered version, which a model.pt does not name. ``meta``: the model's entries."""
    from training.inference.model_file import checkpoint_inputs
    from training.inference.scored_drift import NoDriftStatistics, scored_profile
    from training.inference.scored_table import score_distribution

    distribution = score_distribution(config.score.output, meta["task"])
    if not registered:
        return distribution, "drift needs a registered model (its training data): a model.pt has none"
    try:
        return distribution, scored_profile(config.score.output, manifest["files"], checkpoint_inputs(meta))
    except NoDriftStatistics as why:
        return distribution, str(why)
