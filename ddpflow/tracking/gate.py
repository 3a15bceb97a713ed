"""The champion gate's rules and its decision, as plain values: no MLflow, no Prefect, no I/O.

    reading = ChampionReading.scored("3", 0.91)        # or .none(), .incompatible(...), .unreadable(...)
    verdict = decide(candidate_value, reading, rules)  # (decision, reason)

Decisions:
- ``rejected``: a metric is NaN/inf; the gate metric misses ``registry.min_metric``; it does not beat the
  trivial baseline (``baseline_trivial/<metric>``: the train prior or mean on the same test rows) by more
  than ``registry.min_lift`` (so guessing is never crowned, not even as the first model); a two-class ROC AUC
  that beats 0.5 by no more than chance would while the log loss does not beat the prior's either
  (``ranking_noise_reason``); or, with
  ``registry.require_reference``, it trails the reference model (``baseline_reference/<metric>``) by more
  than ``registry.reference_margin`` (without it: ``reference_warning``, a warning). A candidate that does not
  beat the trivial baseline on the gate metric but does on its signal metric (the test log loss, the RMSE:
  ``GateRules.signal_metric``) is not called "no better than guessing": the reason says what it fails and which
  ``registry.metric`` would judge what it learnt (``no_lift_reason``).
- ``promoted``: no champion yet; the candidate beats the champion (both scored on the
  same test shards) by more than ``min_delta``; the champion loads but cannot score
  this data (``incompatible``); or the champion is unreadable and the user opted in
  with ``registry.replace_unreadable_champion``.
- ``challenger``: everything else, including an unreadable champion without the
  opt-in: the registration step then fails the run (``ChampionUnreadableError``);
  and any candidate that would be promoted over a readable champion while one of
  its features drifted from the champion's training data by more than
  ``registry.max_drift_psi`` (PSI, ``ddpflow/drift/``): it waits as challenger
  whatever its metric, for someone to look at the data first.

A metric's direction, when ``registry.greater_is_better`` is not given, is inferred from its kind
(``metric_higher_is_better``: training/core/directions.py): losses and errors (``test_log_loss``,
``test_rmse``) lower is better; accuracy, F1, ROC AUC, R², precision, recall higher.

``GateDecision`` is the one place the decision's fields, its tags (on the model
version and on the MLflow run) and its dict form are defined.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ddpflow.drift.psi import FeatureDrift
from training.core.directions import higher_is_better as metric_higher_is_better  # the gate's rule
from training.inference.baselines import REFERENCE, TRIVIAL, baseline_metric, model_metrics
from training.loop.selection import is_better

PROMOTED, CHALLENGER, REJECTED = "promoted", "challenger", "rejected"
# champion_status is "<kind>" or "<kind>: <detail>"
NO_CHAMPION, SCORED, INCOMPATIBLE, UNREADABLE = "none", "scored", "incompatible", "unreadable"

DECISION_TAG = "gate.decision"
# gate.state: "recorded" once the decision is written (before any alias moves), "applied" after.
# A version with a decision that is only "recorded" is finished by the next attempt.
STATE_TAG = "gate.state"
RECORDED, APPLIED = "recorded", "applied"
TAG_LIMIT = 5000  # MLflow's longest tag value


class ChampionUnreadableError(RuntimeError):
    """The champion's files are missing or unreadable: the candidate waits as @challenger, the run fails."""


@dataclass(frozen=True)
class GateRules:
    metric: str
    greater_is_better: bool
    min_delta: float = 0.0
    min_metric: float | None = None
    replace_unreadable_champion: bool = False
    max_drift_psi: float | None = None
    min_lift: float = 0.0
    require_reference: bool = False
    reference_margin: float = 0.02
    # The proper score that tells a model that learnt something from a guess whatever the gate metric (the test log
    # loss, the RMSE: training/objectives/base.py ``Evaluation.signal_metric``); None: none (a language model).
    signal_metric: str | None = None
    # What a rejection may suggest gating on instead, in order (the two-class ranking metric, the signal metric).
    alternatives: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChampionReading:
    """What the gate learnt about the current @champion: its version, and its score or why there is none."""

    version: str | None
    kind: str  # NO_CHAMPION, SCORED, INCOMPATIBLE or UNREADABLE
    value: float | None = None
    detail: str = ""

    @classmethod
    def none(cls) -> ChampionReading:
        return cls(None, NO_CHAMPION)

    @classmethod
    def scored(cls, version: str, value: float) -> ChampionReading:
        return cls(str(version), SCORED, float(value))

    @classmethod
    def incompatible(cls, version: str, why: str) -> ChampionReading:
        return cls(str(version), INCOMPATIBLE, None, why)

    @classmethod
    def unreadable(cls, version: str, what: str) -> ChampionReading:
        return cls(str(version), UNREADABLE, None, what)

    @property
    def status(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


def rejection_reason(metrics: dict[str, float], rules: GateRules) -> str | None:
    """Why the candidate may not be registered at all, or None.

    ``metrics``: the candidate's, and its baselines' under ``baseline_trivial/`` and ``baseline_reference/``
    (a baseline's NaN, e.g. a ROC AUC of one class, is not the candidate's fault: only its own are checked).
    """
    own = model_metrics(metrics)
    invalid = sorted(name for name, value in own.items() if not math.isfinite(float(value)))
    if invalid:
        return f"metrics {invalid} are NaN or infinite"
    value = own[rules.metric]
    if rules.min_metric is not None:
        floor = rules.min_metric
        if (value < floor) if rules.greater_is_better else (value > floor):
            better = "higher" if rules.greater_is_better else "lower"
            return f"{rules.metric}={value:.6g} misses registry.min_metric={floor:.6g} ({better} is better)"
    trivial = metrics.get(baseline_metric(TRIVIAL, rules.metric))
    if (
        trivial is not None
        and math.isfinite(trivial)
        and not is_better(value, trivial, rules.greater_is_better, rules.min_lift)
    ):
        return no_lift_reason(metrics, rules)
    noise = ranking_noise_reason(metrics, rules)
    if noise is not None:
        return noise
    if rules.require_reference:
        return reference_warning(metrics, rules, "registry.require_reference is true")
    return None


def no_lift_reason(metrics: dict[str, float], rules: GateRules) -> str:
    """Why a candidate that does not beat the trivial baseline on the gate metric by more than ``min_lift`` is
    rejected: "no better than guessing" only while its signal metric does not beat the baseline's either; else
    what it fails, and the ``registry.metric`` that would judge what it learnt (``GateRules.alternatives``)."""
    value, trivial = metrics[rules.metric], metrics[baseline_metric(TRIVIAL, rules.metric)]
    text = (
        f"{rules.metric}={value:.6g} does not beat the trivial baseline's {trivial:.6g} (the train split's class "
        f"prior or mean on the same test rows) by more than registry.min_lift={rules.min_lift:g}"
    )
    signal = rules.signal_metric
    if signal is None or signal == rules.metric or not beats_trivial(metrics, signal, rules.min_lift):
        return f"{text}: no better than guessing"
    fails = (
        f"its {rules.metric.partition('_')[2]} equals the majority class's share"
        if rules.metric.endswith("_accuracy") and value == trivial
        else f"it does not show on {rules.metric}"
    )
    better = (
        f"{signal}={metrics[signal]:.6g} beats the trivial baseline's {metrics[baseline_metric(TRIVIAL, signal)]:.6g}"
    )
    instead = next(
        (name for name in rules.alternatives if name != rules.metric and beats_trivial(metrics, name, rules.min_lift)),
        signal,
    )
    return (
        f"{text}; not a guess: its {better}, so it learnt something, but {fails}; set registry.metric: {instead} "
        f"to gate on {GATES_ON.get(instead.partition('_')[2], instead)}"
    )


RANKING_NOISE_Z = 1.645  # one-sided 95 %: a ROC AUC this many standard errors above 0.5 is not chance


def ranking_noise_reason(metrics: dict[str, float], rules: GateRules) -> str | None:
    """A two-class model whose ROC AUC beats the trivial baseline's 0.5 by no more than chance would on its test
    rows (``RANKING_NOISE_Z`` standard errors of a model that cannot rank: sqrt((n0 + n1 + 1) / (12 n0 n1)), from
    the split's class counts) and whose signal metric (the log loss) does not beat the prior's either: no better
    than guessing, what a model trained on shuffled labels scores. None otherwise (a ranking beyond chance, or a
    log loss that shows what it learnt)."""
    if not rules.metric.endswith("_roc_auc"):
        return None
    split = rules.metric.removesuffix("_roc_auc")
    rows, share = metrics.get(f"{split}_samples"), metrics.get(f"{split}_majority_share")
    if not rows or share is None or not 0 < share < 1:
        return None
    major = round(rows * share)
    minor = round(rows) - major
    if minor <= 0:
        return None
    noise = RANKING_NOISE_Z * math.sqrt((major + minor + 1) / (12 * major * minor))
    value = float(metrics[rules.metric])
    if value - 0.5 > noise + rules.min_lift:
        return None
    signal = rules.signal_metric
    if signal is not None and beats_trivial(metrics, signal, rules.min_lift):
        return None
    return (
        f"{rules.metric}={value:.6g} is within chance of guessing's 0.5 on these test rows (a model that cannot rank "
        f"scores up to {0.5 + noise:.3g} one time in 20 with {minor} and {major} rows of the two classes), and "
        f"its {signal} does not beat the trivial baseline's: no better than guessing"
    )


GATES_ON = {"roc_auc": "ranking", "log_loss": "the probabilities", "loss": "the loss", "rmse": "the errors"}


def beats_trivial(metrics: dict[str, float], metric: str, min_lift: float) -> bool:
    """Whether the candidate's ``metric`` beats the trivial baseline's by more than ``min_lift`` (its direction:
    ``metric_higher_is_better``); False when either is missing or not finite."""
    value, trivial = metrics.get(metric), metrics.get(baseline_metric(TRIVIAL, metric))
    if value is None or trivial is None or not math.isfinite(trivial):
        return False
    return is_better(float(value), float(trivial), metric_higher_is_better(metric), min_lift)


TRAILING_HELP = "docs/models.md, 'When the mlp trails the reference'"


def reference_warning(metrics: dict[str, float], rules: GateRules, consequence: str = "") -> str | None:
    """The candidate trails the reference model (baseline_reference) on the gate metric by more than
    ``registry.reference_margin``: what to say, or None (also when no reference was scored)."""
    value, reference = metrics.get(rules.metric), metrics.get(baseline_metric(REFERENCE, rules.metric))
    if value is None or reference is None or not math.isfinite(reference) or not math.isfinite(value):
        return None
    margin = rules.reference_margin
    trails = value < reference - margin if rules.greater_is_better else value > reference + margin
    if not trails:
        return None
    text = (
        f"{rules.metric}={value:.6g} trails the reference model (HistGradientBoosting on the same split) at "
        f"{reference:.6g} by more than registry.reference_margin={margin:g} (what to try: {TRAILING_HELP})"
    )
    return f"{text}; {consequence}" if consequence else text


def decide(
    candidate: float, champion: ChampionReading, rules: GateRules, drift: FeatureDrift | None = None
) -> tuple[str, str]:
    """(decision, reason) for a candidate that passed ``rejection_reason``.

    ``drift``: the candidate's most drifted feature against the champion's training data, when measured.
    """
    decision, reason = _decide_on_metric(candidate, champion, rules)
    held = drift_hold_reason(drift, champion, rules)
    if held is None:
        return decision, reason
    return CHALLENGER, f"{held}; held as challenger whatever its metric ({reason})"


def drift_hold_reason(drift: FeatureDrift | None, champion: ChampionReading, rules: GateRules) -> str | None:
    """Why a drifted candidate waits for people, or None: a feature's PSI above ``registry.max_drift_psi``.

    Only against a champion that was read (scored or incompatible): an unreadable one has its own rule.
    """
    limit = rules.max_drift_psi
    if limit is None or drift is None or champion.kind not in (SCORED, INCOMPATIBLE) or not drift.psi > limit:
        return None
    return (
        f"feature {drift.feature!r} drifted from champion v{champion.version}'s training data: "
        f"PSI {drift.psi:.3g} > registry.max_drift_psi {limit:g}"
    )


def _decide_on_metric(candidate: float, champion: ChampionReading, rules: GateRules) -> tuple[str, str]:
    metric, delta = rules.metric, rules.min_delta
    if champion.kind == NO_CHAMPION:
        return PROMOTED, f"first model: no champion yet ({metric}={candidate:.6g})"
    name = f"champion v{champion.version}"
    if champion.kind == UNREADABLE:
        if rules.replace_unreadable_champion:
            return PROMOTED, (
                f"{name} was unreadable ({champion.detail}); replaced because "
                "registry.replace_unreadable_champion is true"
            )
        return CHALLENGER, f"{name} is unreadable ({champion.detail}); the candidate waits as challenger"
    if champion.kind == INCOMPATIBLE:
        return PROMOTED, f"{name} cannot score this data ({champion.detail}); the candidate replaces it"
    value = champion.value
    if not math.isfinite(value):
        return PROMOTED, f"{name} scores {metric}={value} on this data"
    if is_better(candidate, value, rules.greater_is_better, delta):
        return PROMOTED, f"{metric} {candidate:.6g} beats {name}'s {value:.6g} by more than {delta:g}"
    return CHALLENGER, f"{metric} {candidate:.6g} does not beat {name}'s {value:.6g} by more than {delta:g}"


@dataclass(frozen=True)
class GateDecision:
    """The gate's outcome for one MLflow run; ``to_dict()`` is what the flow and the CLI report."""

    decision: str
    reason: str
    model_name: str
    run_id: str
    metric: str
    greater_is_better: bool
    candidate_value: float
    version: str | None = None
    champion_value: float | None = None
    champion_version: str | None = None
    champion_status: str | None = None
    already_registered: bool = False
    drift_feature: str | None = None  # the most drifted feature against the champion's training data
    drift_psi: float | None = None
    warning: str | None = None  # trails the reference model (registry.reference_margin), when not a rejection

    @classmethod
    def judge(
        cls,
        rules: GateRules,
        model_name: str,
        run_id: str,
        version: str,
        candidate: float,
        champion: ChampionReading,
        drift: FeatureDrift | None = None,
        warning: str | None = None,
    ) -> GateDecision:
        decision, reason = decide(candidate, champion, rules, drift)
        return cls(
            decision, reason, model_name, run_id, rules.metric, rules.greater_is_better, float(candidate),
            version=str(version), champion_value=champion.value, champion_version=champion.version,
            champion_status=champion.status, drift_feature=drift.feature if drift else None,
            drift_psi=drift.psi if drift else None, warning=warning,
        )  # fmt: skip

    @classmethod
    def rejected(cls, rules: GateRules, model_name: str, run_id: str, candidate: float, reason: str) -> GateDecision:
        return cls(REJECTED, reason, model_name, run_id, rules.metric, rules.greater_is_better, float(candidate))

    @classmethod
    def from_version_tags(
        cls, tags: dict[str, str], model_name: str, version: str, run_id: str, already_registered: bool = True
    ) -> GateDecision:
        """The decision an earlier attempt recorded on the model version (``version_tags``)."""

        def number(key: str) -> float | None:
            return float(tags[key]) if tags.get(key) else None

        return cls(
            decision=tags[DECISION_TAG],
            reason=tags.get("gate.reason", ""),
            model_name=model_name,
            run_id=run_id,
            metric=tags.get("gate.metric", ""),
            greater_is_better=tags.get("gate.greater_is_better") == "True",
            candidate_value=number("gate.candidate_value"),
            version=str(version),
            champion_value=number("gate.champion_value"),
            champion_version=tags.get("gate.champion_version") or None,
            champion_status=tags.get("gate.champion_status"),
            already_registered=already_registered,
            drift_feature=tags.get("gate.drift_feature") or None,
            drift_psi=number("gate.drift_psi"),
            warning=tags.get("gate.warning") or None,
        )

    @property
    def model_uri(self) -> str | None:
        return f"models:/{self.model_name}/{self.version}" if self.version is not None else None

    @property
    def champion_unreadable(self) -> bool:
        return (self.champion_status or "").startswith(UNREADABLE)

    def again(self) -> GateDecision:
        """The same decision, reported as one an earlier attempt made."""
        return replace(self, already_registered=True)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_uri": self.model_uri}

    def version_tags(self) -> dict[str, str]:
        """The gate's record on the model version; ``DECISION_TAG`` last (see ``recorded_complete``)."""
        return _tag_values(
            {
                "gate.metric": self.metric,
                "gate.greater_is_better": self.greater_is_better,
                "gate.candidate_value": self.candidate_value,
                "gate.champion_value": self.champion_value,
                "gate.champion_version": self.champion_version,
                "gate.champion_status": self.champion_status,
                "gate.drift_feature": self.drift_feature,
                "gate.drift_psi": self.drift_psi,
                "gate.warning": self.warning,
                "gate.reason": self.reason,
                DECISION_TAG: self.decision,
            }
        )

    def run_tags(self) -> dict[str, str]:
        """The gate's record on the MLflow run (``registry.*``)."""
        fields = ("decision", "reason", "model_name", "version", "metric", "candidate_value")
        fields += ("champion_value", "champion_version", "champion_status", "warning")
        return _tag_values({f"registry.{name}": getattr(self, name) for name in fields})

    def run_metrics(self) -> dict[str, float]:
        """``gate_candidate_<metric>`` and ``gate_champion_<metric>``, where they are finite numbers."""
        values = {
            f"gate_candidate_{self.metric}": self.candidate_value,
            f"gate_champion_{self.metric}": self.champion_value,
        }
        return {name: value for name, value in values.items() if _finite(value)}


def recorded_complete(tags: dict[str, str]) -> bool:
    """True when a version's gate record is final: a retry returns it instead of gating again.

    Not final: no decision yet; a decision only ``recorded`` (an attempt died before its
    aliases moved); a challenger held back by a champion that could not be read
    (gated again once its files are restored, or with the opt-in). Versions gated
    before ``gate.state`` existed wrote their decision last, so a decision without
    a state is final.
    """
    decision = tags.get(DECISION_TAG)
    if not decision or tags.get(STATE_TAG, APPLIED) != APPLIED:
        return False
    return decision == PROMOTED or not tags.get("gate.champion_status", "").startswith(UNREADABLE)


def unreadable_champion_message(decision: GateDecision, tracking_uri: str) -> str:
    """What the user sees when the gate stopped at an unreadable champion: which version, what, how to recover."""
    run = decision.run_id
    what = decision.champion_status.partition(": ")[2] or "its model files"
    return (
        f"the champion gate stopped: {decision.model_name} champion v{decision.champion_version} could not be read "
        f"({what}). MLflow run {run} was registered as v{decision.version} with alias @challenger; @champion stays "
        f"on v{decision.champion_version}. To recover, restore the champion's files and re-run the gate: "
        f"MLFLOW_TRACKING_URI={tracking_uri} ddpflow register --run-id {run}; or, to replace the unreadable "
        f"champion with this model: MLFLOW_TRACKING_URI={tracking_uri} ddpflow register --run-id {run} "
        "--set registry.replace_unreadable_champion=true"
    )


def _tag_values(values: dict[str, Any]) -> dict[str, str]:
    def text(value: Any) -> str:
        return "" if value is None else (f"{value:.10g}" if isinstance(value, float) else str(value))

    return {key: text(value)[:TAG_LIMIT] for key, value in values.items()}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
