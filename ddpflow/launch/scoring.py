"""The scoring stage's launch: a model.pt scores ``score.source`` into ``score.output`` on torchrun ranks (plain
Python, no Prefect, no MLflow: the model is already a local file).

    manifest = run_scoring(ScoreRequest(config, model_path, {"name": ..., "version": ..., "uri": ...}, on_line=print))

Before any rank starts: the model's task picks ``score.output_kind`` (auto: probabilities for a classifier, value
for a regression), the plan is made (the source's files cut into row ranges; a missing or mistyped input column is a
``DataError`` naming the file and column), and the output directory is checked: one that holds another model's or
another source's scores (or anything that is not a ddpflow scoring output) is refused; one of the same model and
source is continued, from its part files (``training/inference/batch_scoring.py``), and one already complete
(its manifest written) is returned as it is. Then ``supervisor.launch`` runs torchrun with the scoring ranks, owning
their tree (timeouts, signals, cancellation, the OUTPUT/.score lock: two scorings never share an output).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ddpflow.launch.command import launch_env, torchrun_command
from ddpflow.launch.failure import RankFailed
from ddpflow.launch.supervisor import DEFAULT_GRACE_S, OutputLine, launch
from training.core.config import ConfigError, PipelineConfig
from training.core.errors import DataError
from training.core.topology import resolve_ranks, visible_gpus
from training.inference.batch_scoring import (
    JOB_FILE,
    MANIFEST,
    PLAN_FILE,
    SCORE_DIR,
    Plan,
    ScoreJob,
    make_plan,
)

SCORING_ENTRYPOINT = "training.inference.batch_scoring"
KINDS = {
    "classification": ("label", "probabilities"),
    "multilabel": ("label", "probabilities"),
    "regression": ("value",),
}


@dataclass(frozen=True)
class ScoreRequest:
    config: PipelineConfig  # its score section (source and output resolved) and train.backend / timeouts
    model_path: str  # a local model.pt
    model: dict[str, str]  # {"name", "version", "uri"}: recorded in the manifest and the part files
    on_line: Callable[[OutputLine], None] = print
    should_cancel: Callable[[], str | None] | None = None
    grace_s: float = DEFAULT_GRACE_S


def run_scoring(request: ScoreRequest) -> dict[str, Any]:
    """Score as ``request`` says; returns the output's manifest (``resumed``: part files an earlier run left)."""
    job = scoring_job(request)
    output = Path(job.output)
    layout = resolve_ranks(_rank_config(request.config).train, visible_gpus())
    # DataError naming file and column; nothing written. Large row groups are cut into one piece per rank.
    plan = make_plan(job, _model_inputs(request.model_path), layout.nproc_per_node)
    done = check_output(output, plan, job)
    if done is not None:
        return {**done, "already_complete": True}
    state = output / SCORE_DIR
    state.mkdir(parents=True, exist_ok=True)
    resumed = sorted(path.name for path in output.glob("part-*.parquet"))
    if not resumed or not (state / PLAN_FILE).is_file():  # a new scoring: this plan; a resumed one: its own
        from training.core.fileio import atomic_write_json

        atomic_write_json(state / PLAN_FILE, plan.to_dict())
    job = replace(job, pending=Plan.read(state / PLAN_FILE).pending(output))  # the saved plan: a resume's own
    job.write(state / JOB_FILE)
    for stale in output.glob(".part-*.tmp"):  # a stopped rank's unfinished part: its range is scored again
        stale.unlink()
    rank_config = _rank_config(request.config)
    argv = torchrun_command(rank_config, state / JOB_FILE, gpus=layout.gpus, entrypoint=SCORING_ENTRYPOINT)
    env = launch_env(rank_config, state, gpus=layout.gpus, grace_s=request.grace_s)
    try:
        launch(
            argv,
            state,
            env=env,
            on_line=request.on_line,
            timeout_s=request.config.score.timeout_s,
            grace_s=request.grace_s,
            should_cancel=request.should_cancel,
        )
    except RankFailed as failure:
        cause = failure.root_cause or ""
        if cause.startswith("DataError: "):  # the user's data, named by the rank: said once, no traceback
            raise DataError(cause.removeprefix("DataError: ")) from None
        raise
    manifest = json.loads((output / MANIFEST).read_text())
    return {**manifest, "resumed_parts": len(resumed)}


def scoring_job(request: ScoreRequest) -> ScoreJob:
    """The job every rank reads, with score.output_kind and score.keep resolved for this model, and a relative
    score.source made absolute in the caller's directory (the project root, where `ddpflow score`
    and a deployment's flow run both start): the ranks run elsewhere (the package's root), and the manifest names
    the source a reader can find."""
    from training.inference.model_file import load_model_checkpoint

    config, score = request.config, request.config.score
    if not score.source or not score.output:
        raise ConfigError("score.source and score.output are required (or --source and --output)")
    meta = load_model_checkpoint(request.model_path)[1]
    task = meta["task"]
    kind = score.output_kind
    if kind == "auto":
        kind = "value" if task == "regression" else "probabilities"
    if kind not in KINDS.get(task, ()):
        raise ConfigError(f"score.output_kind {kind!r}: a {task} model gives {' or '.join(KINDS.get(task, ()))}")
    return ScoreJob(
        model_path=str(Path(request.model_path).resolve()),
        model={key: str(value) for key, value in request.model.items()},
        source=in_caller_directory(score.source),
        file_format=score.format,
        output=str(Path(score.output).resolve()),
        keep=default_keep(config, meta),
        output_kind=kind,
        batch_size=score.batch_size,
        on_invalid=score.on_invalid,
        backend=resolve_ranks(_rank_config(config).train, visible_gpus()).backend,
        # The ranks' one collective, at the end, waits for the slowest share: score.timeout_s bounds the scoring.
        collective_timeout_s=max(config.train.collective_timeout_s, score.timeout_s or 86_400.0),
    )


def default_keep(config: PipelineConfig, meta: dict[str, Any]) -> list[str]:
    """score.keep; unset: data.key when the config sets it, else the key the model was trained with (model.pt's
    ``key``), else none."""
    if config.score.keep is not None:
        return list(config.score.keep)
    key = config.data.key or meta.get("key")
    return [key] if key else []


def in_caller_directory(path: str) -> str:
    """A local path made absolute in the current directory; a URL (s3://, gs://, ...) as it is."""
    if "://" in path.removeprefix("file://"):
        return path
    return os.path.abspath(os.path.expanduser(path.removeprefix("file://")))


def check_output(output: Path, plan: Plan, job: ScoreJob) -> dict[str, Any] | None:
    """None: score into ``output`` (new, or the same scoring stopped part-way); the manifest of the same scoring
    already complete; a DataError when the directory holds something else, which is never mixed in."""
    if not output.exists() or not any(output.iterdir()):
        return None
    state = output / SCORE_DIR
    if not (state / PLAN_FILE).is_file() or not (state / JOB_FILE).is_file():
        if not any(path.name != SCORE_DIR for path in output.iterdir()):
            return None  # a launch stopped before its plan was whole: nothing scored, start over
        raise DataError(f"score.output {output} is not empty and is not a ddpflow scoring output: choose another")
    earlier_plan, earlier = Plan.read(state / PLAN_FILE), ScoreJob.read(state / JOB_FILE)
    mine = (job.model["name"], job.model["version"], plan.fingerprint, job.output_kind, job.keep)
    theirs = (
        earlier.model["name"],
        earlier.model["version"],
        earlier_plan.fingerprint,
        earlier.output_kind,
        earlier.keep,
    )
    if mine != theirs:
        raise DataError(
            f"score.output {output} holds the scores of {earlier.model['name']} v{earlier.model['version']} on "
            f"{earlier.source} (source fingerprint {earlier_plan.fingerprint}, {earlier.output_kind}, keep "
            f"{earlier.keep}); this scoring is {job.model['name']} v{job.model['version']} on {job.source} "
            f"(fingerprint {plan.fingerprint}, {job.output_kind}, keep {job.keep}): choose another output, or "
            "remove that one; scores of two models or sources are never mixed"
        )
    manifest = output / MANIFEST
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def _rank_config(config: PipelineConfig) -> PipelineConfig:
    """The config the launch helpers read: score.nproc_per_node ranks, no torchrun restarts (a re-run resumes)."""
    train = config.train.model_copy(update={"nproc_per_node": config.score.nproc_per_node, "max_restarts": 0})
    return config.model_copy(update={"train": train})


def _model_inputs(model_path: str) -> dict[str, Any]:
    from training.inference.model_file import checkpoint_inputs, load_model_checkpoint

    return checkpoint_inputs(load_model_checkpoint(model_path)[1])
