"""The ``score-pipeline`` flow: a registered model (``score.model``, default ``registry.model_name@champion``)
scores ``score.source`` into ``score.output`` on torchrun ranks, each row once, resumable (docs/scoring.md).

Deployed (prefect.yaml) as ``score-pipeline/score-nightly`` (03:00 UTC, after the nightly retraining) and
``score-pipeline/score-on-new-champion``, triggered by ``ddpflow.champion.moved``, the event the register task emits
when ``@champion`` moves (tasks/register.py), for configs/score.yaml's model only: its new champion re-scores the
table (``model`` and ``output`` from the event, the rest from the deployment's config). Its parameters are
``train-pipeline``'s (``config``, ``config_file``, ``overrides``) plus ``model``, ``source`` and ``output``, which
win over the config's ``score`` section like `ddpflow score --model/--source/--output`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from ddpflow.scoring import with_score_settings
from flows.params import resolve_config
from tasks.score import score_table_task
from training.core.config import PipelineConfig


@flow(name="score-pipeline", log_prints=True)
def score_pipeline(
    config: PipelineConfig | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    model: str | None = None,
    source: str | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Score a whole table with a model: the output's manifest, rows/s and the MLflow run."""
    resolved = with_score_settings(resolve_config(config, config_file, overrides), model, source, output)
    return score_table_task(resolved)
