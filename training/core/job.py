"""The training job: what the launcher writes to ``RUN_DIR/train_config.json``
and what every rank reads (ddpflow's trainer from ``--config``, a user's script through ``$DDPFLOW_JOB``).
Plain JSON, so a person can run a rank by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.core.config import PipelineConfig


@dataclass(frozen=True)
class TrainJob:
    config: PipelineConfig
    dataset_dir: str | None  # <data.root>/<fingerprint>, holding manifest.json; None: a script without data
    run_dir: str
    init_weights: str | None = None  # a model.pt to warm-start from (resolved by the launcher)

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["config"] = self.config.model_dump(mode="json")
        return raw

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def read(cls, path: str | Path) -> TrainJob:
        raw = json.loads(Path(path).read_text())
        raw["config"] = PipelineConfig.model_validate(raw["config"])
        return cls(**raw)
