"""What the model is told about each input: ``InputInfo``, from the manifest.

Every input kind (numeric, categorical, hashed, vector; images and text come with their own issues)
reaches the model the same way: one entry of the batch dict, a tensor ``[B, *shape]`` of ``dtype``.
A model factory (``training/models/registry.py``) is called with ``inputs: dict[str, InputInfo]`` in the
manifest's order, so it can size embeddings from ``cardinality`` and layers from ``shape``.

    inputs = inputs_from_manifest(manifest)        # {"tenure_days": InputInfo(kind="numeric", ...), ...}
    inputs["country"].cardinality                  # embedding rows: null + unknown + the vocabulary
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from training.core.config import INPUT_KINDS

KINDS = INPUT_KINDS  # the built-in kinds (training/core/config.py), in that order; plugins: kinds/registry.py
NUMERIC = "numeric"  # the one kind whose inputs are the columns of the numeric block (``in_numeric_block``)


@dataclass(frozen=True)
class InputInfo:
    name: str
    kind: str  # one of KINDS, or a plugin's (training/kinds/registry.py: kind_record)
    dtype: str  # the batch tensor's torch dtype name: "float32" | "int64"
    shape: tuple[int, ...] = ()  # per row: () a scalar, (D,) a vector
    cardinality: int | None = None  # categorical / hashed: embedding rows, index 0 null, 1 unknown (categorical)
    options: dict[str, Any] = field(default_factory=dict)
    # A ragged kind's stored values' dtype ("uint8" image bytes, "int32" token ids): its rows are kept in the node
    # cache as values + offsets (training/kinds/ragged.py) and become ``dtype`` tensors only per batch. None: a
    # fixed-shape kind, stored as the batch tensor itself ([rows, *shape] of ``dtype``).
    ragged_dtype: str | None = None
    # A numeric input whose train split held nulls (or NaN): its 0/1 missing indicator is a column of the numeric
    # block too (``block_names``), after the numeric inputs, so the model learns what a missing value means.
    missing_indicator: bool = False
    # A numeric input's bins for the model's numeric embeddings (training/models/numeric_embeddings.py): the train
    # split's quantiles, scaled as the model sees the input, strictly increasing. None: none (before PREPARE_VERSION 6).
    bins: tuple[float, ...] | None = None
    # A dense input's column that ``bins`` are for (the datetime kind's time since the train split's start): the
    # model's numeric embeddings take that column as they take a numeric input. None: a numeric input (its one
    # value), or no bins (a datetime input before PREPARE_VERSION 7).
    bins_column: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))
        if self.bins is not None:
            object.__setattr__(self, "bins", tuple(float(edge) for edge in self.bins))

    def mask_name(self) -> str:
        """The batch dict's entry for this input's mask, where a kind needs one (no tabular kind does)."""
        return f"{self.name}_mask"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "cardinality": self.cardinality,
            "options": dict(self.options),
            **({"ragged_dtype": self.ragged_dtype} if self.ragged_dtype else {}),  # absent when none
            **({"missing_indicator": True} if self.missing_indicator else {}),  # likewise
            **({"bins": list(self.bins)} if self.bins is not None else {}),  # likewise
            **({"bins_column": self.bins_column} if self.bins_column is not None else {}),  # likewise
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> InputInfo:
        return cls(
            name=raw["name"],
            kind=raw["kind"],
            dtype=raw["dtype"],
            shape=tuple(raw.get("shape") or ()),
            cardinality=raw.get("cardinality"),
            options=dict(raw.get("options") or {}),
            ragged_dtype=raw.get("ragged_dtype"),
            missing_indicator=bool(raw.get("missing_indicator", False)),
            bins=raw.get("bins"),
            bins_column=raw.get("bins_column"),
        )


def numeric_input(name: str) -> InputInfo:
    return InputInfo(name=name, kind=NUMERIC, dtype="float32")


def inputs_from_dicts(raw: list[dict[str, Any]]) -> dict[str, InputInfo]:
    return {entry["name"]: InputInfo.from_dict(entry) for entry in raw}


def inputs_from_manifest(manifest) -> dict[str, InputInfo]:
    """The manifest's inputs, in order; a manifest without them (before PREPARE_VERSION 4): its features, all
    numeric."""
    if getattr(manifest, "inputs", None):
        return inputs_from_dicts(manifest.inputs)
    return {name: numeric_input(name) for name in manifest.features}


def describe_inputs(inputs: dict[str, InputInfo]) -> str:
    """The inputs counted by kind, for a log line: "7 numeric, 3 categorical, 1 hashed" (kinds in KINDS order)."""
    order = [*KINDS, *(info.kind for info in inputs.values() if info.kind not in KINDS)]
    counts = {kind: sum(info.kind == kind for info in inputs.values()) for kind in dict.fromkeys(order)}
    return ", ".join(f"{count} {kind}" for kind, count in counts.items() if count) or "no inputs"


def numeric_names(inputs: dict[str, InputInfo]) -> list[str]:
    """The numeric inputs in order: the columns of the numeric block (``Manifest.features``)."""
    return [name for name, info in inputs.items() if in_numeric_block(info.kind)]


def in_numeric_block(kind: str) -> bool:
    """Whether an input of ``kind`` is a column of the one float32 numeric block (normalised together,
    ``Manifest.features``) rather than an entry of its own in the batch dict: the numeric kind only."""
    return kind == NUMERIC


def missing_name(name: str) -> str:
    """The batch dict's name of numeric input ``name``'s missing indicator (a column of the numeric block)."""
    return f"{name}.missing"


def block_names(inputs: dict[str, InputInfo]) -> list[str]:
    """The columns of the numeric block, in order: the numeric inputs (``numeric_names``), then the missing
    indicator of each that has one (``InputInfo.missing_indicator``). What the model's numeric block holds."""
    numeric = numeric_names(inputs)
    return numeric + [missing_name(name) for name in numeric if inputs[name].missing_indicator]
