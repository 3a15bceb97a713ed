"""The most confidently wrong rows of an evaluated split: a table artifact for a text classifier.

    wrong = ConfidentlyWrong(text_columns=["snippet"], labels=manifest.label_mapping)
    wrong.add(first_row, raw_batch, target, predicted, probabilities)   # per record batch, in split order
    wrong.rows()   # [{"row", "label", "predicted", "confidence", "snippet"}, ...], most confident first
    wrong.table()  # {"columns": [...], "data": [[...], ...]}: the table artifact (eval/confidently_wrong.json)

Only ``count`` rows are kept at any time (the top by the predicted class's probability among the wrong ones;
ties: the earlier row), so any split size costs the same memory. Text is cut to ``max_chars`` characters for
display (an ellipsis marks the cut); the model saw at most its ``max_len`` tokens of it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import torch

DEFAULT_COUNT = 25
DISPLAY_CHARS = 200


class ConfidentlyWrong:
    def __init__(self, text_columns: list[str], labels: list[Any], count: int = DEFAULT_COUNT, max_chars=DISPLAY_CHARS):
        self.text_columns, self.labels = list(text_columns), list(labels)
        self.count, self.max_chars = count, max_chars
        self._kept: list[tuple[float, int, dict[str, Any]]] = []  # (-confidence, row, entry)

    def add(
        self,
        first_row: int,
        batch: pa.RecordBatch,
        target: torch.Tensor,
        predicted: torch.Tensor,
        probabilities: torch.Tensor,
    ) -> None:
        confidence = probabilities.float().gather(1, predicted.long().unsqueeze(1)).squeeze(1)
        wrong = torch.nonzero(predicted.long() != target.long()).flatten()
        if len(wrong) == 0:
            return
        best = wrong[torch.argsort(-confidence[wrong], stable=True)[: self.count]].tolist()
        for i in best:
            entry = {
                "row": first_row + i,
                "label": str(self.labels[int(target[i])]),
                "predicted": str(self.labels[int(predicted[i])]),
                "confidence": float(confidence[i]),
            }
            for name in self.text_columns:
                entry[name] = self._display(batch.column(name)[i].as_py())
            self._kept.append((-entry["confidence"], entry["row"], entry))
        self._kept = sorted(self._kept, key=lambda kept: kept[:2])[: self.count]

    def rows(self) -> list[dict[str, Any]]:
        return [entry for _, _, entry in self._kept]

    def table(self) -> dict[str, list]:
        """``{"columns", "data"}`` (a DataFrame's "split" form, what MLflow's table artifact holds); the
        columns also when no row is wrong."""
        columns = ["row", "label", "predicted", "confidence", *self.text_columns]
        return {"columns": columns, "data": [[entry[name] for name in columns] for entry in self.rows()]}

    def _display(self, text: str | None) -> str:
        if text is None:
            return ""
        return text if len(text) <= self.max_chars else text[: self.max_chars - 1] + "…"
