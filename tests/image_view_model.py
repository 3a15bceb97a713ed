"""The built-in image CNN that also records the views it trains on, for tests/training/test_images.py.

Named as a user would name theirs: ``train.model=tests.image_view_model:recording_cnn``. With
``IMAGE_VIEWS_DIR`` set, every training forward appends one JSON line to
``<dir>/rank<r>-restart<k>.jsonl``: each row's image summed in float64 (a fingerprint of the view), in batch
order. With ``DDPFLOW_RECORD_INDICES`` (the rows each rank trained, in order) the lines say which view each
row got in each epoch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from training.models.image import ImageClassifier

VIEWS_ENV = "IMAGE_VIEWS_DIR"


class RecordingCNN(ImageClassifier):
    def forward(self, batch):
        folder = os.environ.get(VIEWS_ENV)
        if folder and self.training:
            name = f"rank{os.environ.get('RANK', '0')}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            sums = batch[self.images[0]].double().sum(dim=(1, 2, 3)).tolist()
            with (Path(folder) / f"{name}.jsonl").open("a") as out:
                out.write(json.dumps(sums) + "\n")
        return super().forward(batch)


def recording_cnn(inputs, n_outputs: int, **kwargs) -> RecordingCNN:
    return RecordingCNN(inputs, n_outputs, **kwargs)
