"""The pipeline flow's parameters, resolved into one ``PipelineConfig``.

``train_pipeline`` takes three parameters; a deployment or the UI passes any of them:

    config       PipelineConfig | None  the validated config (the UI renders it as a form)
    config_file  str | None             a YAML file, e.g. "configs/demo.yaml", read where the
                                        flow runs (relative to its working directory)
    overrides    list[str] | None       "section.key=value" strings, exactly like `ddpflow run --set`

They combine in that order of strength: the file (or the defaults) first, then the
fields the caller set in ``config``, then ``overrides``. So a deployment in
prefect.yaml names ``config_file: configs/demo.yaml`` and a one-off run from the UI
adds ``overrides: ["train.epochs=1"]`` without copying the whole config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from training.core.config import PipelineConfig, apply_overrides, read_yaml, validate_config


def resolve_config(
    config: PipelineConfig | dict[str, Any] | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> PipelineConfig:
    raw = read_yaml(config_file) if config_file else {}
    if config is not None:
        # Only the fields the caller set: defaults must not mask the file's values.
        given = (
            config.model_dump(mode="json", exclude_unset=True) if isinstance(config, PipelineConfig) else dict(config)
        )
        raw = _deep_merge(raw, given)
    return validate_config(apply_overrides(raw, list(overrides or [])))


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "model_kwargs":
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def run_label(config: PipelineConfig) -> str:
    """``<model>-<data>``, e.g. ``mlp-synthetic-classification`` or ``tabnet-sales``; with ``train.model: auto``
    (the default, resolved only once the data is prepared) the data alone, e.g. ``synthetic-classification``; a
    training script: its name, and its data's (``train_ddp`` or ``train_ddp-sales``)."""
    if config.train.script:
        script = Path(config.train.script).stem
        return _safe(script if config.data is None else f"{script}-{data_label(config.data.source)}")
    if config.train.model == "auto":
        return _safe(data_label(config.data.source))
    return _safe(f"{model_label(config.train.model)}-{data_label(config.data.source)}")


def model_label(model: str) -> str:
    return model.rpartition(":")[2] or model


def data_label(source: str) -> str:
    parsed = urlparse(source)
    if parsed.scheme == "synthetic":
        return f"synthetic-{parsed.netloc or parsed.path.strip('/')}"
    path = (parsed.path if parsed.scheme else source).rstrip("/")
    parts = [part for part in path.split("/") if part and not any(char in part for char in "*?[")]
    name = parts[-1] if parts else (parsed.netloc or "data")
    return name.split(".")[0] or name


def _safe(text: str) -> str:
    """Usable as a directory name and an MLflow run name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "run"
