"""Register a run's model behind the champion gate, in an order no failure can bend (no Prefect here).

    decision = register_candidate(config, run_id, model_path, dataset_dir, metrics, uri, gate_lock=lock)
    decision = register_run(run_id, overrides=["registry.min_delta=0.01"])  # `ddpflow register --run-id`

What the step guarantees (docs/registry.md says the same to users):
- A rejected candidate (NaN metric, misses ``min_metric``, no better than the trivial baseline by
  ``min_lift``, or trailing the reference with ``require_reference``) is never registered. The trivial
  baseline is the evaluation's (``baseline_trivial/<metric>``), or scored here when a run lacks it.
- Otherwise the model is registered once per MLflow run (found again by its
  ``ddpflow.run_id`` tag), then, holding ``gate_lock(model_name)``, @champion is
  read, the champion is re-scored on the same test shards, and the decision is
  RECORDED (version tags ``gate.*``, run tags ``registry.*``, gate metrics)
  BEFORE any alias moves. Moving @champion is the last write that can fail the
  step, so a run whose registration failed never moved it.
- A champion that exists but whose files cannot be downloaded or loaded is
  never treated as "no champion": the candidate gets @challenger, @champion
  stays, the record is written, and ``ChampionUnreadableError`` says how to
  recover (unless ``registry.replace_unreadable_champion`` is set).
- A retry finishes what an attempt left: a decision only recorded is gated
  again under the lock; one whose @champion move landed is completed as it was.
- With ``registry.max_drift_psi`` set, the candidate's drift from the champion's
  training data is measured under the lock, against the champion just read, and
  a drifted candidate waits as @challenger (``gate.drift_hold_reason``).
- A training script's model without a data section (``dataset_dir`` None) goes through the same steps,
  judged on the metric the script reported (``script_models.gate_metric``) against the value the champion's
  own run reported; with no trivial baseline, the rule against guessing cannot apply, and the decision says so.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from ddpflow.drift.psi import FeatureDrift
from ddpflow.tracking.drift import drift_from_version
from ddpflow.tracking.gate import (
    APPLIED,
    DECISION_TAG,
    PROMOTED,
    RECORDED,
    STATE_TAG,
    ChampionReading,
    ChampionUnreadableError,
    GateDecision,
    GateRules,
    recorded_complete,
    reference_warning,
    rejection_reason,
    unreadable_champion_message,
)
from ddpflow.tracking.registry import (
    CHAMPION,
    RegistrationError,
    RegistryUnavailable,
    download_version_checkpoint,
    find_alias,
    find_version_for_run,
    first_line,
    is_transient,
    mark_challenger,
    promote,
    register_program_version,
    register_version,
    set_version_tags,
    version_download_uri,
)
from ddpflow.tracking.runs import (
    DATASET_DIR_TAG,
    MODEL_PATH_TAG,
    configure_mlflow,
    read_run_config,
    use_tracking_uri,
)
from ddpflow.tracking.script_models import gate_metric
from ddpflow.tracking.tracking_uri import resolve_tracking_uri
from training.core.config import PipelineConfig, apply_overrides, validate_config
from training.core.manifest import Manifest, read_manifest
from training.inference.baselines import (
    TRIVIAL,
    baseline_metric,
    checkpoint_reading,
    is_baseline_metric,
    trivial_baseline,
)
from training.inference.evaluate import evaluate_split
from training.inference.model_file import IncompatibleModelError, load_model_checkpoint
from training.objectives.registry import evaluation_of

GateLock = Callable[[str], AbstractContextManager]

_logger = logging.getLogger("ddpflow.register")


# ---------------------------------------------------------------- serialising the gate


_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


@contextmanager
def process_gate_lock(model_name: str) -> Iterator[None]:
    """The default ``gate_lock``: serialises registrations of one model within this process only.

    The Prefect task passes a lock that holds across processes and machines
    (tasks/register.py: a global concurrency limit named after the model).
    """
    with _process_locks_guard:
        lock = _process_locks.setdefault(model_name, threading.Lock())
    with lock:
        yield


def _nothing(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class GateHooks:
    """Seams at the gate's two critical moments, for tests that force a race or a crash; production passes none.

    ``champion_read(version or None)`` runs under the lock right after @champion is read;
    ``before_aliases(decision)`` runs after the record is written and before any alias moves.
    """

    champion_read: Callable[[str | None], None] = _nothing
    before_aliases: Callable[[GateDecision], None] = _nothing


# ---------------------------------------------------------------- the whole step


def gate_rules(config: PipelineConfig, task: str, n_classes: int | None = None) -> GateRules:
    """``task`` and ``n_classes``: the dataset's (``Manifest.n_classes``); the metric is ``registry.metric``, else
    the objective's (test_roc_auc for a label of two classes; a language model is judged on its own: test_loss,
    lower is better; training/objectives/base.py ``Evaluation.gate_metric``, ``for_classes``)."""
    evaluation = evaluation_of(config.train, task, n_classes)
    registry, judged = config.registry, evaluation.gate_metric
    alternatives = (evaluation.two_class_gate_metric if n_classes == 2 else None, evaluation.signal_metric)
    return GateRules(
        metric=registry.gate_metric(judged),
        greater_is_better=registry.higher_is_better(judged),
        min_delta=registry.min_delta,
        min_metric=registry.min_metric,
        replace_unreadable_champion=registry.replace_unreadable_champion,
        max_drift_psi=registry.max_drift_psi,
        min_lift=registry.min_lift,
        require_reference=registry.require_reference,
        reference_margin=registry.reference_margin,
        signal_metric=evaluation.signal_metric,
        alternatives=tuple(name for name in alternatives if name is not None),
    )


def register_candidate(
    config: PipelineConfig,
    run_id: str,
    model_path: str,
    dataset_dir: str | None,
    metrics: dict[str, float],
    tracking_uri: str,
    *,
    logger: Any = None,
    gate_lock: GateLock | None = None,
    hooks: GateHooks | None = None,
) -> GateDecision:
    """Register the run's model and apply the champion gate (see the module docstring). ``dataset_dir`` None: a
    training script's exported model without a data section, judged on the metric it reported (``metrics``).

    Raises ``RegistrationError`` (will not succeed as asked), ``RegistryUnavailable``
    (the store is away: worth retrying) or ``ChampionUnreadableError``.
    """
    # The registry resolves a version's source (models:/<id>) through MLflow's
    # process-wide tracking URI, so point it at this store for the whole step.
    with use_tracking_uri(tracking_uri):
        try:
            kind = _Registration if dataset_dir is not None else _ReportedRegistration
            step = kind(config, run_id, tracking_uri, logger or _logger, gate_lock, hooks or GateHooks())
            decision = step.run(model_path, dataset_dir, metrics)
        except Exception as error:
            if isinstance(error, (RegistryUnavailable, ChampionUnreadableError)) or not is_transient(error):
                raise
            # MLflow's own text names an endpoint URL deep in a connection-pool message; say what it
            # means for this run, and that nothing is lost: the step is idempotent and can be re-run.
            raise RegistryUnavailable(
                f"registering MLflow run {run_id} failed: the tracking store {tracking_uri} is unavailable "
                f"({first_line(error)}). {model_path} and its eval/metrics.json are kept; once the store is back, "
                f"finish with: MLFLOW_TRACKING_URI={tracking_uri} ddpflow register --run-id {run_id}"
            ) from error
    if decision.champion_unreadable and decision.decision != PROMOTED:
        raise ChampionUnreadableError(unreadable_champion_message(decision, tracking_uri))
    return decision


class _Registration:
    """One attempt for one run: the steps in their guaranteed order."""

    def __init__(
        self,
        config: PipelineConfig,
        run_id: str,
        tracking_uri: str,
        logger: Any,
        gate_lock: GateLock | None,
        hooks: GateHooks,
    ):
        self.config, self.run_id, self.logger, self.hooks = config, run_id, logger, hooks
        self.name = config.registry.model_name
        self.gate_lock = gate_lock or process_gate_lock
        self.client, self.experiment_id = configure_mlflow(config, tracking_uri)

    def run(self, model_path: str, dataset_dir: str | None, metrics: dict[str, float]) -> GateDecision:
        manifest = read_manifest(dataset_dir) if dataset_dir is not None else None
        rules = self._rules(manifest, metrics)
        if rules.metric not in metrics:
            raise RegistrationError(
                f"registry.metric {rules.metric!r} is not among the evaluated metrics {sorted(metrics)}"
            )
        version = find_version_for_run(self.client, self.name, self.run_id)
        if version is not None and recorded_complete(version.tags):
            decision = GateDecision.from_version_tags(version.tags, self.name, str(version.version), self.run_id)
            self.logger.info(
                "MLflow run %s is already registered as %s v%s (%s); nothing to do",
                self.run_id,
                self.name,
                version.version,
                decision.decision,
            )
            return decision
        candidate = float(metrics[rules.metric])
        metrics = self._with_trivial_baseline(metrics, rules, model_path, dataset_dir)
        rejection = rejection_reason(metrics, rules)
        if rejection:
            decision = GateDecision.rejected(rules, self.name, self.run_id, candidate, rejection)
            self._record_on_run(decision)
            self.logger.warning("Not registering run %s: %s", self.run_id, rejection)
            return decision
        if version is None:
            version = self._register_version(model_path, manifest, dataset_dir)
        warning = self._warning(metrics, rules)
        with self.gate_lock(self.name):
            decision = self._gate(version, rules, candidate, dataset_dir, manifest, warning)
        log = self.logger.info if decision.decision == PROMOTED else self.logger.warning
        log("%s v%s: %s (%s)", self.name, decision.version, decision.decision, decision.reason)
        return decision

    def _rules(self, manifest: Manifest, metrics: dict[str, float]) -> GateRules:
        return gate_rules(self.config, manifest.task, manifest.n_classes)

    def _register_version(self, model_path: str, manifest: Manifest, dataset_dir: str) -> ModelVersion:
        """The pyfunc model of model.pt (raw rows in) and its registry version."""
        scored_as = evaluation_of(self.config.train, manifest.task).scored_as
        return register_version(
            self.client, self.config, self.experiment_id, self.run_id, model_path, manifest, dataset_dir, scored_as
        )

    def _warning(self, metrics: dict[str, float], rules: GateRules) -> str | None:
        """The decision's warning: the candidate trails the reference model."""
        warning = reference_warning(metrics, rules)
        if warning:
            self.logger.warning("Run %s: %s", self.run_id, warning)
        return warning

    def _with_trivial_baseline(
        self, metrics: dict[str, float], rules: GateRules, model_path: str, dataset_dir: str
    ) -> dict[str, float]:
        """``metrics`` with the trivial baseline's gate metric, signal metric and alternatives (``GateRules``): the
        evaluation's, else scored now (a run evaluated before baselines existed); unchanged when the model's
        objective has none (a language model, a user objective) or its model.pt cannot be read here."""
        judged = [name for name in dict.fromkeys((rules.metric, rules.signal_metric, *rules.alternatives)) if name]
        if all(baseline_metric(TRIVIAL, name) in metrics for name in judged) or not Path(model_path).is_file():
            return metrics
        objective, normaliser = checkpoint_reading(model_path)
        if not objective.has_baselines:
            return metrics
        manifest = read_manifest(dataset_dir)
        trivial = trivial_baseline(objective, normaliser, manifest, dataset_dir, "test")
        return {**{baseline_metric(TRIVIAL, name): trivial[name] for name in judged if name in trivial}, **metrics}

    def _gate(
        self,
        version: ModelVersion,
        rules: GateRules,
        candidate: float,
        dataset_dir: str,
        manifest: Manifest,
        warning: str | None = None,
    ) -> GateDecision:
        """Under the lock: read @champion (it may have moved while we waited), decide, record, then move aliases."""
        champion = find_alias(self.client, self.name, CHAMPION)
        self.hooks.champion_read(None if champion is None else str(champion.version))
        if champion is not None and str(champion.version) == str(version.version):
            decision = self._promoted_earlier(version)
        else:
            reading = self._champion_reading(champion, rules, dataset_dir, manifest)
            drift = self._worst_drift(champion, rules, manifest)
            decision = GateDecision.judge(
                rules, self.name, self.run_id, str(version.version), candidate, reading, drift, warning
            )
        self._record(decision)
        self.hooks.before_aliases(decision)
        if decision.decision == PROMOTED:
            promote(self.client, self.name, decision.version, decision.champion_version)
        else:
            mark_challenger(self.client, self.name, decision.version)
        self._mark_applied(decision)
        return decision

    def _champion_reading(
        self, champion: ModelVersion | None, rules: GateRules, dataset_dir: str, manifest: Manifest
    ) -> ChampionReading:
        """The champion re-scored on the candidate's test shards."""
        scored_as = evaluation_of(self.config.train, manifest.task).scored_as
        return read_champion(self.client, champion, dataset_dir, rules.metric, self.config.eval.batch_size, scored_as)

    def _worst_drift(self, champion: ModelVersion | None, rules: GateRules, manifest: Manifest) -> FeatureDrift | None:
        """With ``registry.max_drift_psi`` set: the candidate's most drifted feature against THIS champion's data.

        Measured here, under the lock, so the rule judges the champion the gate compares with.
        """
        if rules.max_drift_psi is None or champion is None:
            return None
        outcome = drift_from_version(self.client, champion, manifest)
        if outcome.report is None:
            self.logger.warning("registry.max_drift_psi is set, but %s; the drift rule is not applied", outcome.message)
            return None
        return outcome.report.worst

    def _promoted_earlier(self, version: ModelVersion) -> GateDecision:
        """An earlier attempt recorded its promotion and moved @champion, then died: keep what it measured."""
        tags = {"gate.reason": "promoted by an earlier attempt", **version.tags, DECISION_TAG: PROMOTED}
        return GateDecision.from_version_tags(tags, self.name, str(version.version), self.run_id, False)

    def _record(self, decision: GateDecision) -> None:
        """The decision on the version and on the run, before any alias moves.

        ``gate.state=recorded`` goes first: a record cut short is never mistaken for a finished one.
        """
        set_version_tags(self.client, self.name, decision.version, {STATE_TAG: RECORDED})
        set_version_tags(self.client, self.name, decision.version, decision.version_tags())
        self._record_on_run(decision)

    def _record_on_run(self, decision: GateDecision) -> None:
        now = _now_ms()
        tags = [RunTag(key, value) for key, value in decision.run_tags().items()]
        metrics = [Metric(key, value, now, 0) for key, value in decision.run_metrics().items()]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def _mark_applied(self, decision: GateDecision) -> None:
        # Best effort: @champion has already moved, and a failure here must not fail a run whose
        # champion moved. A version left "recorded" is completed by the next registration of the run.
        try:
            set_version_tags(self.client, self.name, decision.version, {STATE_TAG: APPLIED})
        except Exception as error:
            self.logger.warning(
                "%s v%s: aliases are set but gate.state could not be marked %s (%s); "
                "the next `ddpflow register --run-id %s` completes it",
                self.name,
                decision.version,
                APPLIED,
                first_line(error),
                self.run_id,
            )


class _ReportedRegistration(_Registration):
    """A training script's model without a data section: judged on the metric the script reported (``gate_metric``),
    its champion on the value its own run reported. No trivial baseline stands for it (nothing to score one on), so
    the guessing rule (``registry.min_lift``) cannot apply, and the decision's warning says so."""

    def _rules(self, manifest: None, metrics: dict[str, float]) -> GateRules:
        metric, why_not = gate_metric(self.config, metrics)
        if metric is None:
            raise RegistrationError(why_not)
        registry = self.config.registry
        return GateRules(
            metric=metric,
            greater_is_better=registry.higher_is_better(metric),
            min_delta=registry.min_delta,
            min_metric=registry.min_metric,
            replace_unreadable_champion=registry.replace_unreadable_champion,
        )

    def _with_trivial_baseline(self, metrics: dict[str, float], rules: GateRules, *_: Any) -> dict[str, float]:
        """The metric it is judged on alone: the script's other reports are its own business (a NaN train loss)."""
        return {rules.metric: metrics[rules.metric]}

    def _register_version(self, model_path: str, *_: Any) -> ModelVersion:
        """The exported program's pyfunc model (the script's example in) and its registry version."""
        return register_program_version(self.client, self.config, self.experiment_id, self.run_id, model_path)

    def _warning(self, *_: Any) -> str:
        return NO_GUESSING_RULE

    def _champion_reading(self, champion: ModelVersion | None, rules: GateRules, *_: Any) -> ChampionReading:
        """The champion's own run's last value of the metric (nothing here could score it again)."""
        if champion is None:
            return ChampionReading.none()
        version = str(champion.version)
        value = self.client.get_run(champion.run_id).data.metrics.get(rules.metric) if champion.run_id else None
        if value is None:
            return ChampionReading.incompatible(version, f"its run reported no {rules.metric}")
        return ChampionReading.scored(version, value)

    def _worst_drift(self, *_: Any) -> None:
        return None


# A script's model judged on what it reported: why registry.min_lift did not apply, on the decision.
NO_GUESSING_RULE = (
    "no data section, so no trivial baseline: the rule against guessing (registry.min_lift) could not apply"
)


def _now_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------- scoring the champion


def read_champion(
    client: MlflowClient,
    champion: ModelVersion | None,
    dataset_dir: str,
    metric: str,
    batch_size: int,
    scored_as: str | None = None,
) -> ChampionReading:
    """The champion's gate metric on these test shards, or why there is none.

    Unreadable (download or load fails) is told apart from incompatible (loads,
    but cannot score this data, or is scored as another kind of model than the
    candidate's ``scored_as``: a classifier's test_loss per row is not a language
    model's per token); a transient store error is raised, to be retried.
    """
    if champion is None:
        return ChampionReading.none()
    version = str(champion.version)
    with tempfile.TemporaryDirectory(prefix="ddpflow-champion-") as scratch:
        try:
            where = version_download_uri(client, champion)
            path = download_version_checkpoint(client, champion, scratch)
        except Exception as error:
            if is_transient(error):
                raise
            return ChampionReading.unreadable(version, f"its model.pt could not be downloaded: {_compact(error)}")
        try:
            load_model_checkpoint(path)
        except Exception as error:
            return ChampionReading.unreadable(version, f"its model.pt at {where} does not load: {_compact(error)}")
        try:
            result = evaluate_split(path, dataset_dir, "test", batch_size)
        except IncompatibleModelError as error:
            return ChampionReading.incompatible(version, str(error).replace(str(path), "its model.pt"))
    if scored_as is not None and result.task != scored_as:
        return ChampionReading.incompatible(version, f"it is a {result.task} model; the candidate is {scored_as}")
    if metric not in result.metrics:
        return ChampionReading.incompatible(version, f"its evaluation on this data has no {metric}")
    return ChampionReading.scored(version, result.metrics[metric])


def _compact(error: BaseException, limit: int = 400) -> str:
    """The whole message on one line (MLflow puts the useful part of a download error on its later lines)."""
    text = " ".join(str(error).replace("#####", "").split())  # MLflow frames each failed file in #####
    return f"{type(error).__name__}: {text}"[:limit]


# ---------------------------------------------------------------- re-running for a finished run


def register_run(
    run_id: str,
    config: PipelineConfig | None = None,
    overrides: list[str] | None = None,
    tracking_uri: str | None = None,
    *,
    logger: Any = None,
    gate_lock: GateLock | None = None,
) -> GateDecision:
    """``ddpflow register --run-id``: the gate for a run that was already evaluated.

    The model path, dataset and test metrics come from the run (tags
    ``ddpflow.model_path`` / ``ddpflow.dataset_dir`` set with the evaluation);
    the config is the run's own unless one is given, with ``overrides``
    (``section.key=value``) applied on top, e.g.
    ``registry.replace_unreadable_champion=true``.
    """
    uri = tracking_uri or resolve_tracking_uri(config or PipelineConfig())
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
            raise RegistrationError(f"MLflow run {run_id!r} does not exist in {uri}") from None
        raise
    tags = run.data.tags
    if MODEL_PATH_TAG not in tags or DATASET_DIR_TAG not in tags:
        raise RegistrationError(
            f"MLflow run {run_id} was never evaluated (no {MODEL_PATH_TAG} / {DATASET_DIR_TAG} tags); "
            "run the pipeline first"
        )
    config = config or read_run_config(client, run_id)
    if overrides:
        config = validate_config(apply_overrides(config.model_dump(mode="json"), list(overrides)))
    metrics = {
        name: value for name, value in run.data.metrics.items() if name.startswith("test_") or is_baseline_metric(name)
    }
    model_path, dataset_dir = tags[MODEL_PATH_TAG], tags[DATASET_DIR_TAG]
    if "://" not in dataset_dir and not Path(dataset_dir).is_dir():
        raise RegistrationError(f"MLflow run {run_id}: its dataset {dataset_dir} is gone; the gate scores on it")
    return register_candidate(config, run_id, model_path, dataset_dir, metrics, uri, logger=logger, gate_lock=gate_lock)
