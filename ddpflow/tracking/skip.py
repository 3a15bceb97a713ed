"""``train.skip_if_unchanged``: a run that would only repeat the champion is skipped (no Prefect here).

    unchanged = check_unchanged(config, fingerprint, tracking_uri)    # reads @champion's tags
    if unchanged.skip: record_skipped_run(tracking_uri, run_id, unchanged)

The rule, one place: skip when ``@champion``'s model version carries the same dataset
fingerprint (``data.fingerprint``) and the same training identity
(``ddpflow.training_identity``: ``runs.py: training_identity_tag``, a hash of
``training/checkpoint/identity.py: training_identity``, the resume rule's fields that change
the trained weights). Anything else trains: another fingerprint (an appended row, an
edited file, another data setting), another weight-changing setting (lr, epochs,
model, ...), no champion, or a champion registered before versions carried the
identity. Settings that do not change the weights (timeouts, paths, restarts,
``train.init_from``) do not make a run train again.

A skipped run still leaves an MLflow run, FINISHED and tagged ``ddpflow.skipped=true``,
``registry.decision=skipped`` and the reason, so the history shows the schedule ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities import RunTag
from mlflow.entities.model_registry import ModelVersion

from ddpflow.tracking.registry import CHAMPION, find_alias
from ddpflow.tracking.runs import TRAINING_IDENTITY_TAG, training_identity_tag
from training.core.config import PipelineConfig

SKIPPED = "skipped"  # the flow's decision, beside the gate's promoted / challenger / rejected
SKIPPED_TAG = "ddpflow.skipped"
FINGERPRINT_TAG = "data.fingerprint"


@dataclass(frozen=True)
class SkipCheck:
    """Whether to skip, and why (or why not): names the champion version, the fingerprint and the identity."""

    skip: bool
    reason: str
    model_name: str
    fingerprint: str
    training_identity: str
    champion_version: str | None = None

    def run_tags(self) -> dict[str, str]:
        """The skipped run's record, in the gate's ``registry.*`` words so one query finds every night."""
        return {
            SKIPPED_TAG: "true",
            "registry.decision": SKIPPED,
            "registry.reason": self.reason,
            "registry.model_name": self.model_name,
            "registry.version": self.champion_version or "",
            "registry.champion_version": self.champion_version or "",
        }


def decide_skip(config: PipelineConfig, fingerprint: str, champion: ModelVersion | None) -> SkipCheck:
    """The rule (see the module docstring), on the champion's version tags; no I/O."""
    name = config.registry.model_name
    identity = training_identity_tag(config, fingerprint)

    def train(reason: str) -> SkipCheck:
        version = None if champion is None else str(champion.version)
        return SkipCheck(False, reason, name, fingerprint, identity, version)

    if champion is None:
        return train(f"{name} has no champion yet")
    tags, version = champion.tags or {}, f"champion v{champion.version}"
    if TRAINING_IDENTITY_TAG not in tags:
        return train(f"{version} carries no {TRAINING_IDENTITY_TAG} tag (registered before ddpflow recorded it)")
    if tags.get(FINGERPRINT_TAG) != fingerprint:
        return train(
            f"the data changed: {version} was trained on {tags.get(FINGERPRINT_TAG)}, the data is {fingerprint}"
        )
    if tags[TRAINING_IDENTITY_TAG] != identity:
        return train(
            f"a setting that changes the weights differs from {version}'s "
            f"(training identity {tags[TRAINING_IDENTITY_TAG]} != {identity})"
        )
    return SkipCheck(
        True,
        f"{version} was trained on the same data (fingerprint {fingerprint}) with the same training settings "
        f"(training identity {identity}): training again would only repeat it",
        name,
        fingerprint,
        identity,
        str(champion.version),
    )


def check_unchanged(config: PipelineConfig, fingerprint: str, tracking_uri: str) -> SkipCheck:
    """``decide_skip`` against the registry's current @champion."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    return decide_skip(config, fingerprint, find_alias(client, config.registry.model_name, CHAMPION))


def record_skipped_run(tracking_uri: str, run_id: str, check: SkipCheck) -> None:
    """Tag the night's MLflow run as skipped, with the reason (the caller ends it FINISHED)."""
    tags = [RunTag(key, value) for key, value in check.run_tags().items()]
    MlflowClient(tracking_uri=tracking_uri).log_batch(run_id, tags=tags)
