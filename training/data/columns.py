"""Which source columns are the label, key and features, and which task the label means.

Task inference (when ``data.task`` is not set): an integer, string, boolean or
categorical (dictionary) label means classification; a floating-point or
decimal label means regression. Set ``data.task`` to override, e.g.
``classification`` for a float column holding 0.0/1.0.

Default features: every numeric column (integer, float, decimal, boolean) of
the source except the label and the key, in source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from training.config import DataConfig
from training.data.errors import DataError


@dataclass(frozen=True)
class ColumnPlan:
    label: str
    key: str | None
    features: list[str]
    task: str

    @property
    def columns(self) -> list[str]:
        """The columns prepare reads, in the order it reads them."""
        return self.features + [self.label] + ([self.key] if self.key else [])


def is_numeric(kind: pa.DataType) -> bool:
    return (
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_decimal(kind)
        or pa.types.is_boolean(kind)
    )


def is_text(kind: pa.DataType) -> bool:
    kind = value_type(kind)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def value_type(kind: pa.DataType) -> pa.DataType:
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def plan_columns(schema: pa.Schema, data: DataConfig, where: str) -> ColumnPlan:
    """Check the configured columns against the source schema; ``where`` names the source in errors."""
    names = schema.names
    for role, name in (("label", data.label), ("key", data.key)):
        if name is not None and name not in names:
            raise DataError(f"{where}: {role} column {name!r} (data.{role}) not found; the columns are {names}")
    if pa.types.is_null(schema.field(data.label).type):  # e.g. a CSV with a header and no rows
        raise DataError(
            f"{where}: label column {data.label!r} holds no values: the source has no rows or the column is blank"
        )
    task = data.task or infer_task(schema.field(data.label).type, data.label, where)
    _check_label_type(schema.field(data.label).type, data.label, task, where)
    features = _features(schema, data, where)
    return ColumnPlan(label=data.label, key=data.key, features=features, task=task)


def infer_task(kind: pa.DataType, label: str, where: str) -> str:
    kind = value_type(kind)
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind) or is_text(kind):
        return "classification"
    if pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return "regression"
    raise DataError(
        f"{where}: label column {label!r} has type {kind}, which is neither a class (integer, string, bool) "
        "nor a number"
    )


def _check_label_type(kind: pa.DataType, label: str, task: str, where: str) -> None:
    kind = value_type(kind)
    if task == "regression" and not is_numeric(kind):
        raise DataError(f"{where}: label column {label!r} has type {kind}; regression needs a numeric label")
    if task == "classification" and not (is_numeric(kind) or is_text(kind)):
        raise DataError(
            f"{where}: label column {label!r} has type {kind}; classification needs integer, string or bool labels"
        )


def _features(schema: pa.Schema, data: DataConfig, where: str) -> list[str]:
    reserved = {data.label, data.key} - {None}
    if data.features is None:
        features = [field.name for field in schema if field.name not in reserved and is_numeric(field.type)]
        if not features:
            raise DataError(
                f"{where}: no numeric feature columns besides the label/key; the columns are {schema.names}"
            )
        return features
    duplicates = sorted({name for name in data.features if data.features.count(name) > 1})
    if duplicates:
        raise DataError(f"data.features lists {duplicates} more than once")
    for name in data.features:
        if name in reserved:
            raise DataError(f"data.features: {name!r} is the label or key column and cannot also be a feature")
        if name not in schema.names:
            raise DataError(
                f"{where}: feature column {name!r} (data.features) not found; the columns are {schema.names}"
            )
        kind = schema.field(name).type
        if not is_numeric(kind):
            raise DataError(f"{where}: feature column {name!r} has type {kind}; features must be numeric")
    return list(data.features)
