"""A toy input kind of a user's own, registered from outside the package (docs/models.md, "Adding an input
kind"): one module, one ``register_kind`` line, and ``DDPFLOW_PLUGINS=tests.training.toy_kind`` in the
environment, so prepare, every rank, evaluation and serving import it.

``digits``: a string of decimal digits per row ("0413"), encoded as each digit's share of the row minus the
train split's mean share, times ``scale`` (a float32 vector [10]). A row holding anything but digits is
invalid (``data.on_invalid``). It feeds the built-in MLP as a vector (``model_block = DENSE``), drifts as
digit frequencies and shows its wrong rows in the confidently-wrong table. tests/training/test_toy_kind.py
trains it through the real Trainer and checks that every hook below was used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.kinds.arrow_types import is_text
from training.kinds.base import DENSE, TABLE, Codec, plain
from training.kinds.registry import register_kind

DIGITS = 10


@register_kind
class DigitsCodec(Codec):
    kind = "digits"
    option_names = ("scale",)
    model_block = DENSE  # float32 [B, 10]: the built-in models concatenate it beside the numeric block
    drift_measure = "frequencies"  # PSI (ddpflow/drift/kinds.py) over the train split's digit counts
    shown_as = TABLE  # a column of the confidently-wrong table
    takes = staticmethod(is_text)
    takes_what = "strings of decimal digits"

    @classmethod
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        given = super().options_from(given)
        scale = float(given.get("scale", 1.0))
        if not scale > 0:
            raise ValueError(f"kind 'digits' needs scale > 0, not {scale}")
        return {"scale": scale}

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        super().__init__(name, {"scale": 1.0, **(options or {})})
        self.counts = np.zeros(DIGITS, dtype=np.int64)
        self.mean: np.ndarray | None = None

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.string()

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        strings = pc.cast(plain(array), pa.string())
        digits = pc.fill_null(pc.match_substring_regex(strings, r"^[0-9]+$"), False)
        return digits.to_numpy(zero_copy_only=False)

    def _shares(self, array: pa.Array) -> np.ndarray:
        """Each digit's share of each row, [rows, 10]."""
        rows = pc.cast(plain(array), pa.string()).to_pylist()
        counts = np.array([np.bincount([ord(c) - 48 for c in row], minlength=DIGITS) for row in rows], np.float64)
        return counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)

    def observe(self, array: pa.Array) -> None:
        rows = pc.cast(plain(array), pa.string()).to_pylist()
        self.counts += np.bincount([ord(c) - 48 for row in rows for c in row], minlength=DIGITS)

    def fit(self) -> dict[str, Any]:
        if self.mean is None:
            self.mean = self.counts / max(1, int(self.counts.sum()))
        return {"mean": self.mean.tolist(), "counts": self.counts.tolist()}

    def load(self, state: dict[str, Any]) -> None:
        self.mean, self.counts = np.asarray(state["mean"]), np.asarray(state["counts"], dtype=np.int64)

    def shape(self) -> tuple[int, ...]:
        return (DIGITS,)

    def encode(self, array: pa.Array) -> np.ndarray:
        shares = (self._shares(array) - self.mean) * float(self.options["scale"])
        return shares.astype(np.float32)

    def drift_stats(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "counts": {str(d): int(n) for d, n in enumerate(self.counts)}, "other": 0}
