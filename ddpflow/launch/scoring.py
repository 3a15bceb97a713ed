"""The scoring stage's launch: a model.pt scores ``score.source`` into ``score.output`` on torchrun ranks (plain
Python, no Prefect, no MLflow: the model is already a local file).

    manifest = run_scoring(ScoreRequest(config, read_model=lambda: model))   # model: path, identity(), file

Before any row is scored: the model is read (``ScoreRequest.read_model``, once), its task picks
``score.output_kind`` (auto: probabilities for a classifier, value for a regression), the plan is made (the source's
files cut into row ranges; a missing or mistyped input column is a ``DataError`` naming the file and column), and
the output directory is checked: one that holds anything but a ddpflow scoring output is refused at once; one that
holds another model's or another source's scores is refused; one of the same model and source is continued, from
its part files (``training/inference/batch_scoring.py``), and one already complete (its manifest written) is
returned as it is. Then OUTPUT/.score gets what the ranks read (the plan, the model copied to
OUTPUT/.score/model.pt, and last the job with the ranges still to score, which each rank waits for), and the ranks
run where ``score.launcher`` says (default: ``train.launcher``'s value, where training runs):

  * local: ``supervisor.launch`` runs torchrun here, owning its tree (timeouts, signals, cancellation, the
    OUTPUT/.score lock: two scorings never share an output);
  * slurm: one batch job of ``score.nnodes`` nodes, through the Slurm code training uses
    (``run_slurm_job``, ddpflow/launch/slurm/launcher.py): preflight naming score.*, the job followed to its end,
    scancel on cancellation, signals and ``score.timeout_s``; its files in OUTPUT/.score/slurm/. A launch that
    finds its output's job still running follows it instead of submitting a second one.

A new output (none yet, empty, or a launch stopped before its plan) is scored locally with torchrun started first:
its agent and ranks import torch while this process reads the model and makes the plan, instead of after (on 2
cores, about 2 s of a scoring's start; docs/benchmarks.md). So this module imports torch only once torchrun runs:
what the ranks and the plan need is imported where it is used. A failure before the job is written (the model, the
plan, score.output_kind) stops the waiting ranks and removes what the launch created: nothing is left of it. An
output that holds a plan (resumed, complete, or another scoring's) is checked before anything runs or is written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddpflow.launch.command import launch_env, rank_program, torchrun_command
from ddpflow.launch.failure import RankFailed
from ddpflow.launch.supervisor import DEFAULT_GRACE_S, OutputLine, launch
from training.core.config import ConfigError, PipelineConfig
from training.core.errors import DataError
from training.core.fileio import atomic_write, atomic_write_json
from training.core.layout import MANIFEST, SCORE_DIR, SCORE_JOB, SCORE_PLAN
from training.core.topology import RankLayout, resolve_ranks, visible_gpus

if TYPE_CHECKING:
    from training.inference.batch_scoring import Plan, ScoreJob
    from training.inference.model_file import ModelFile

SCORING_ENTRYPOINT = "training.inference.batch_scoring"
MODEL_FILE = "model.pt"  # OUTPUT/.score/model.pt: the model every rank (on every node) loads
KINDS = {
    "classification": ("label", "probabilities"),
    "multilabel": ("label", "probabilities"),
    "regression": ("value",),
}


class ScoringModel(Protocol):
    """A model to score with, read once: a local model.pt (``ddpflow/tracking/scoring.py: ScoringModel``)."""

    path: Path | str
    file: ModelFile  # its bytes and entries

    def identity(self) -> dict[str, str]: ...  # {"name", "version", "uri"}: in the manifest and the part files


@dataclass(frozen=True)
class ScoreRequest:
    config: PipelineConfig  # its score section (source and output resolved), train.backend / timeouts, slurm
    read_model: Callable[[], ScoringModel]  # called once, when the model is needed (after torchrun starts, if it can)
    on_line: Callable[[OutputLine], None] = print
    should_cancel: Callable[[], str | None] | None = None  # a non-empty reason stops the ranks (scancels the job)
    cancel_check_s: float = 2.0  # how often should_cancel is asked
    grace_s: float = DEFAULT_GRACE_S
    # Called once the output is known to need scoring, just before the job is written (never for an output already
    # complete, nor for a refused one): what the caller does while the ranks score (the MLflow run: ddpflow/scoring.py).
    on_ranks_start: Callable[[ScoringModel, ScoreJob, Plan], None] | None = None


@dataclass(frozen=True)
class Scoring:
    """What one scoring's ranks read: the model, the job (its settings resolved for this model) and the plan."""

    model: ScoringModel
    job: ScoreJob
    plan: Plan

    @classmethod
    def make(cls, request: ScoreRequest, layout: RankLayout) -> Scoring:
        """The model read, the job resolved for it, the plan made: a DataError naming the file and column of a
        missing or mistyped input, a ConfigError for score.output_kind. Large row groups are cut one piece per rank."""
        from training.inference.batch_scoring import make_plan
        from training.inference.model_file import checkpoint_inputs

        model = request.read_model()
        job = scoring_job(request.config, model, layout)
        return cls(model, job, make_plan(job, checkpoint_inputs(model.file.meta), layout.world_size))

    def begin(self, request: ScoreRequest) -> Path:
        """The output's OUTPUT/.score written for the ranks (``prepare_output``), after ``on_ranks_start``."""
        (Path(self.job.output) / SCORE_DIR).mkdir(parents=True, exist_ok=True)
        if request.on_ranks_start is not None:
            request.on_ranks_start(self.model, self.job, self.plan)
        return prepare_output(self.job, self.plan, self.model.file)


def run_scoring(request: ScoreRequest) -> dict[str, Any]:
    """Score as ``request`` says; returns the output's manifest (``resumed_parts``: part files an earlier run left;
    ``already_complete``: the same scoring was complete)."""
    config = request.config
    layout = scoring_layout(config)
    on_slurm = config.score_launcher == "slurm"
    if on_slurm:
        from ddpflow.launch.slurm.commands import check_cluster

        check_cluster(config, "score")  # SlurmSetupError naming score.nnodes or slurm.*; nothing written
    output = scoring_output(config)
    resumed = sorted(path.name for path in output.glob("part-*.parquet"))
    try:
        if on_slurm or (output / SCORE_DIR / SCORE_PLAN).is_file():  # checked before anything runs or is written
            scoring = Scoring.make(request, layout)
            done = check_output(output, scoring.plan, scoring.job)
            if done is not None:
                return {**done, "already_complete": True}
            run_ranks = _on_slurm if on_slurm else _on_this_machine
            run_ranks(request, layout, lambda: scoring.begin(request))
        else:
            _while_torchrun_starts(request, layout, output)
    except RankFailed as failure:
        cause = failure.root_cause or ""
        if cause.startswith("DataError: "):  # the user's data, named by the rank: said once, no traceback
            raise DataError(cause.removeprefix("DataError: ")) from None
        raise
    manifest = json.loads((output / MANIFEST).read_text())
    return {**manifest, "resumed_parts": len(resumed)}


def _while_torchrun_starts(request: ScoreRequest, layout: RankLayout, output: Path) -> None:
    """A new output, scored here with torchrun started first: its ranks import while this process reads the model
    and makes the plan, then wait for the job. A failure before the job is written stops them and removes what the
    launch created (the output, or its OUTPUT/.score)."""
    created = output if not output.exists() else output / SCORE_DIR if not (output / SCORE_DIR).exists() else None
    (output / SCORE_DIR / SCORE_JOB).unlink(missing_ok=True)  # a stopped launch's: the ranks must wait for this one's
    written = False

    def get_ready() -> Path:
        nonlocal written
        job = Scoring.make(request, layout).begin(request)
        written = True
        return job

    try:
        _on_this_machine(request, layout, get_ready, ranks_first=True)
    except BaseException:
        if not written and created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def prepare_output(job: ScoreJob, plan: Plan, model: ModelFile) -> Path:
    """What the ranks read, in OUTPUT/.score: the plan (a resumed scoring keeps its own), the model (a copy: a node
    may not see the launching machine's temporary files), then the job with the ranges still to score (what each
    rank waits for); a stopped rank's unfinished part is removed (its range is scored again). Returns the job's
    path."""
    from training.inference.batch_scoring import Plan

    output = Path(job.output)
    state = output / SCORE_DIR
    if not any(output.glob("part-*.parquet")) or not (state / SCORE_PLAN).is_file():  # a new scoring: this plan
        atomic_write_json(state / SCORE_PLAN, plan.to_dict())
    copied = state / MODEL_FILE
    if Path(model.path).resolve() != copied.resolve():
        # The bytes the command read (the file is read once); a copy for this scoring's ranks: not fsynced.
        atomic_write(copied, lambda handle: handle.write(model.data), durable=False)
    job = replace(job, model_path=str(copied), pending=Plan.read(state / SCORE_PLAN).pending(output))
    for stale in output.glob(".part-*.tmp"):
        stale.unlink()
    return job.write(state / SCORE_JOB)


def _on_this_machine(
    request: ScoreRequest, layout: RankLayout, prepare: Callable[[], Path], ranks_first: bool = False
) -> None:
    """The ranks as torchrun here, its tree owned by supervisor.launch. ``ranks_first``: ``prepare`` (which writes
    the job the ranks wait for) runs once torchrun has started; otherwise before."""
    state = Path(request.config.score.output).resolve() / SCORE_DIR
    if not ranks_first:
        prepare()
    rank_config = _rank_config(request.config)
    argv = torchrun_command(rank_config, state / SCORE_JOB, gpus=layout.gpus, entrypoint=SCORING_ENTRYPOINT)
    env = launch_env(rank_config, state, gpus=layout.gpus, grace_s=request.grace_s)
    launch(
        argv,
        state,
        env=env,
        on_line=request.on_line,
        timeout_s=request.config.score.timeout_s,
        grace_s=request.grace_s,
        should_cancel=request.should_cancel,
        cancel_check_s=request.cancel_check_s,
        meanwhile=prepare if ranks_first else None,
    )


def _on_slurm(request: ScoreRequest, layout: RankLayout, prepare: Callable[[], Path]) -> None:
    """The ranks as one Slurm job of score.nnodes nodes (ddpflow/launch/slurm/launcher.py: ``run_slurm_job``)."""
    from ddpflow.launch.slurm.launcher import SlurmStage, run_slurm_job
    from ddpflow.launch.slurm.script import JobPaths, RankJob

    config = request.config
    output = Path(config.score.output).resolve()
    state = output / SCORE_DIR
    rank_config = _rank_config(config)
    job = RankJob(
        rank_config,
        JobPaths(state),
        job_file=state / SCORE_JOB,
        program=tuple(rank_program(rank_config, state / SCORE_JOB, SCORING_ENTRYPOINT)),
        nnodes=config.score.nnodes,
        layout=layout,
        visible=(state / MODEL_FILE, state / SCORE_PLAN),
        name=f"score-{output.name}",
        stage="scoring",
        section="score",
        run_dir_key="score.output",
    )
    # Only the variables ddpflow sets (base={}): the job inherits the rest from sbatch's environment.
    env = launch_env(rank_config, state, gpus=layout.gpus, grace_s=request.grace_s, base={})
    stage = SlurmStage(
        job,
        prepare=prepare,
        finished=(output / MANIFEST).is_file,
        env=env,
        on_line=request.on_line,
        should_cancel=request.should_cancel,
        cancel_check_s=request.cancel_check_s,
        timeout_s=config.score.timeout_s,
    )
    run_slurm_job(stage)


def scoring_layout(config: PipelineConfig) -> RankLayout:
    """Each node's scoring ranks: this machine's GPUs with score.launcher local; slurm.gpus_per_node on a Slurm
    job's nodes (the login node that submits it may have none). ConfigError naming score.nproc_per_node."""
    train = _rank_config(config).train
    if config.score_launcher != "slurm":
        return resolve_ranks(train, visible_gpus())
    gpus = config.slurm.gpus_per_node
    layout = resolve_ranks(train, gpus)
    if gpus and layout.nproc_per_node > gpus:
        raise ConfigError(
            f"score.nproc_per_node: {layout.nproc_per_node} ranks asked for, but slurm.gpus_per_node is {gpus}"
        )
    return layout


def scoring_output(config: PipelineConfig) -> Path:
    """score.output, absolute: a ConfigError without score.source or score.output, a DataError for a file or a
    directory that holds anything but a ddpflow scoring output (which is never written into)."""
    score = config.score
    if not score.source or not score.output:
        raise ConfigError("score.source and score.output are required (or --source and --output)")
    output = Path(score.output).resolve()
    if output.exists() and not output.is_dir():
        raise DataError(f"score.output {output} is a file: name a directory (new, empty, or a scoring output)")
    state = output / SCORE_DIR
    scoring_state = (state / SCORE_PLAN).is_file() or (state / SCORE_JOB).is_file()
    if output.is_dir() and not scoring_state and any(path.name != SCORE_DIR for path in output.iterdir()):
        raise DataError(f"score.output {output} is not empty and is not a ddpflow scoring output: choose another")
    return output


def scoring_job(config: PipelineConfig, model: ScoringModel, layout: RankLayout) -> ScoreJob:
    """The job every rank reads, with score.output_kind and score.keep resolved for this model, and a relative
    score.source made absolute in the caller's directory (the project root, where `ddpflow score`
    and a deployment's flow run both start): the ranks run elsewhere (the package's root), and the manifest names
    the source a reader can find."""
    from training.inference.batch_scoring import ScoreJob

    score = config.score
    meta = model.file.meta
    task = meta["task"]
    kind = score.output_kind
    if kind == "auto":
        kind = "value" if task == "regression" else "probabilities"
    if kind not in KINDS.get(task, ()):
        raise ConfigError(f"score.output_kind {kind!r}: a {task} model gives {' or '.join(KINDS.get(task, ()))}")
    return ScoreJob(
        model_path=str(Path(model.path).resolve()),
        model={key: str(value) for key, value in model.identity().items()},
        source=in_caller_directory(score.source),
        file_format=score.format,
        output=str(Path(score.output).resolve()),
        keep=default_keep(config, meta),
        output_kind=kind,
        batch_size=score.batch_size,
        on_invalid=score.on_invalid,
        backend=layout.backend,
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
    already complete; a DataError when it holds another model's or source's scores, which are never mixed in (a
    directory that holds anything else: ``scoring_output``)."""
    from training.inference.batch_scoring import Plan, ScoreJob

    state = output / SCORE_DIR
    if not (state / SCORE_PLAN).is_file() or not (state / SCORE_JOB).is_file():
        return None  # new, or a launch stopped before its job was written: nothing scored yet
    earlier_plan, earlier = Plan.read(state / SCORE_PLAN), ScoreJob.read(state / SCORE_JOB)
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
    """The config the launch helpers read: score.nproc_per_node ranks on score.nnodes nodes, no torchrun restarts
    (a re-run resumes)."""
    score = config.score
    update = {"nproc_per_node": score.nproc_per_node, "nnodes": score.nnodes, "max_restarts": 0}
    train = config.train.model_copy(update={**update, "launcher": config.score_launcher})
    return config.model_copy(update={"train": train})
