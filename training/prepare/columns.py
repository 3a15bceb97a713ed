"""Which source columns are the label, key and features, and which task the label means.

Task inference (when ``data.task`` is not set): a string, boolean or
categorical (dictionary) label means classification; a floating-point or
decimal label means regression; an integer label means classification when it
holds at most ``INTEGER_CLASSES_MAX`` distinct values and regression when it
holds more (a count, a price in cents: ``integer_label_task``, decided on the
values by prepare before the fingerprint). Set ``data.task`` to override, e.g.
``classification`` for a float column holding 0.0/1.0; it always wins.

Default inputs: every numeric column (integer, float, decimal, boolean) of
the source except the label, the key and the weight, in source order; the
other columns are left out, each named with the ``data.inputs`` entry that
would include it (``left_out_columns``). ``data.inputs`` lists the inputs and
their kinds; each kind must fit its column's type (``Codec.takes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from training.core.config import DataConfig
from training.core.errors import DataError
from training.kinds.arrow_types import is_hashable, is_numeric, is_text, is_vector, value_type
from training.kinds.image import is_image_column
from training.kinds.inputs import NUMERIC, in_numeric_block
from training.kinds.registry import CODECS, input_options, kind_record
from training.kinds.times import is_time, looks_like_times


@dataclass(frozen=True)
class ColumnPlan:
    label: str
    key: str | None
    features: list[str]  # the numeric inputs, in input order: the numeric block
    task: str
    inputs: dict[str, tuple[str, dict]] = field(default_factory=dict)  # name -> (kind, options), in order
    weight: str | None = None

    @property
    def others(self) -> list[str]:
        """The non-numeric inputs, in input order."""
        return [name for name, (kind, _options) in self.inputs.items() if not in_numeric_block(kind)]

    @property
    def columns(self) -> list[str]:
        """The columns prepare reads, in the order it reads them."""
        return (
            self.features
            + self.others
            + [self.label]
            + ([self.key] if self.key else [])
            + ([self.weight] if self.weight else [])
        )


def plan_columns(schema: pa.Schema, data: DataConfig, where: str) -> ColumnPlan:
    """Check the configured columns against the source schema; ``where`` names the source in errors."""
    names = schema.names
    for role, name in (("label", data.label), ("key", data.key), ("weight", data.weight)):
        if name is not None and name not in names:
            raise DataError(f"{where}: {role} column {name!r} (data.{role}) not found; the columns are {names}")
    if pa.types.is_null(schema.field(data.label).type):  # e.g. a CSV with a header and no rows
        raise DataError(
            f"{where}: label column {data.label!r} holds no values: the source has no rows or the column is blank"
        )
    task = data.task or infer_task(schema.field(data.label).type, data.label, where)
    _check_label_type(schema.field(data.label).type, data.label, task, where)
    if data.weight is not None and not is_numeric(value_type(schema.field(data.weight).type)):
        raise DataError(
            f"{where}: weight column {data.weight!r} (data.weight) has type {schema.field(data.weight).type}; "
            "row weights must be numbers"
        )
    if data.inputs is not None:
        inputs = _typed_inputs(schema, data, where)
    else:
        inputs = {name: (NUMERIC, {}) for name in _features(schema, data, where)}
    features = [name for name, (kind, _options) in inputs.items() if in_numeric_block(kind)]
    return ColumnPlan(label=data.label, key=data.key, features=features, task=task, inputs=inputs, weight=data.weight)


def _typed_inputs(schema: pa.Schema, data: DataConfig, where: str) -> dict[str, tuple[str, dict]]:
    inputs = {}
    for name, spec in data.inputs.items():
        if name not in schema.names:
            raise DataError(
                f"{where}: input column {name!r} (data.inputs.{name}) not found; the columns are {schema.names}"
            )
        options = input_options(name, spec)  # ConfigError naming the input: an unknown kind, a wrong option
        kind = schema.field(name).type
        codec = kind_record(spec.kind)
        if not codec.takes(kind):
            raise DataError(
                f"{where}: input column {name!r} has type {kind}; data.inputs.{name} is {spec.kind}, "
                f"which takes {codec.takes_what}{_kind_hint(kind)}"
            )
        inputs[name] = (spec.kind, options)
    return inputs


def _kind_hint(kind: pa.DataType) -> str:
    fitting = [name for name, codec in CODECS.items() if codec.takes(kind)]
    return f" (a {kind} column fits: {', '.join(fitting)})" if fitting else ""


def is_label_list(kind: pa.DataType) -> bool:
    """A multilabel label: a list of strings or integers (the classes a row has)."""
    list_kind = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return list_kind and (is_text(kind.value_type) or pa.types.is_integer(kind.value_type))


# An integer label with more distinct values than this is a quantity to predict (regression), not classes.
INTEGER_CLASSES_MAX = 50


def is_integer_label(kind: pa.DataType) -> bool:
    """An integer label (not bool): its task depends on how many distinct values it holds."""
    return pa.types.is_integer(value_type(kind))


def integer_label_task(distinct: int) -> str:
    """The task of an integer label with ``distinct`` values (or more): classes up to INTEGER_CLASSES_MAX."""
    return "classification" if distinct <= INTEGER_CLASSES_MAX else "regression"


def describe_task(task: str, kind: pa.DataType, label: str, distinct: int | None, given: bool) -> str:
    """One line for the prepare log: the task, how it was decided, and how to choose the other."""
    if given:
        return f"task {task} (data.task)"
    other = "regression" if task == "classification" else "classification"
    if distinct is not None:
        count = f"{distinct}" if distinct <= INTEGER_CLASSES_MAX else f"more than {INTEGER_CLASSES_MAX}"
        why = f"integer label {label!r} holds {count} distinct values"
        rule = f"(integers with at most {INTEGER_CLASSES_MAX} distinct values are classes)"
        return f"task {task}, inferred: {why} {rule}; set data.task: {other} to override"
    if task == "multilabel":
        return f"task multilabel, inferred: label {label!r} is a list ({kind})"
    return f"task {task}, inferred from label {label!r}'s type {value_type(kind)}; set data.task: {other} to override"


def infer_task(kind: pa.DataType, label: str, where: str) -> str:
    kind = value_type(kind)
    if is_label_list(kind):
        return "multilabel"
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
    if task == "multilabel" and not is_label_list(kind):
        raise DataError(
            f"{where}: label column {label!r} has type {kind}; multilabel needs a list of strings or integers"
        )
    if task == "classification" and not (is_numeric(kind) or is_text(kind)):
        raise DataError(
            f"{where}: label column {label!r} has type {kind}; classification needs integer, string or bool labels"
        )


def _features(schema: pa.Schema, data: DataConfig, where: str) -> list[str]:
    reserved = {data.label, data.key, data.weight} - {None}
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
            raise DataError(f"data.features: {name!r} is the label, key or weight column and cannot also be a feature")
        if name not in schema.names:
            raise DataError(
                f"{where}: feature column {name!r} (data.features) not found; the columns are {schema.names}"
            )
        kind = schema.field(name).type
        if not is_numeric(kind):
            raise DataError(f"{where}: feature column {name!r} has type {kind}; features must be numeric")
    return list(data.features)


# ---------------------------------------------------------------- what the default left out

TEXT_MEAN_CHARS = 40  # strings this long on average read as text, not categories
ID_SHARE = 0.5  # a string column with more distinct values than this share of its rows reads as an id


def left_out_columns(schema: pa.Schema, plan: ColumnPlan, sample: pa.RecordBatch | None) -> list[dict[str, str]]:
    """The columns the default inputs leave out, each with the ``data.inputs`` entry that would include it.

    ``sample``: the source's first record batch of those columns, what the suggestion looks at."""
    used = set(plan.columns)
    left = []
    for field_ in schema:
        if field_.name in used:
            continue
        column = sample.column(field_.name) if sample is not None else None
        kind, reason = suggest_kind(field_.type, column)
        left.append({"column": field_.name, "type": str(field_.type), "suggest": kind, "why": reason})
    return left


def suggest_kind(kind: pa.DataType, column: pa.Array | None) -> tuple[str, str]:
    """(the data.inputs entry for a column, why): categorical, hashed, vector, datetime, text or none."""
    if is_vector(kind):
        return "vector", "a list of numbers"
    if is_time(kind):
        return "datetime", f"{kind} values"
    if is_image_column(kind):
        return "{kind: image, size: N}", "binary: encoded images, if it holds png, jpeg, webp, bmp or gif files"
    if not is_text(kind):
        if is_hashable(kind):
            return "categorical", f"{kind} values"
        return "none", f"no input kind takes {kind} yet: convert it to a number or a string"
    if column is None or len(column) - column.null_count == 0:
        return "categorical", "a string column (no values to look at)"
    import pyarrow.compute as pc

    values = column.drop_null()
    if pa.types.is_dictionary(values.type):
        values = pc.cast(values, values.type.value_type)
    if looks_like_times(values):
        return "datetime", "ISO-8601 dates or times"
    mean_chars = pc.mean(pc.utf8_length(pc.cast(values, pa.string()))).as_py()
    distinct = len(pc.unique(values))
    if mean_chars > TEXT_MEAN_CHARS:
        return "text", f"long strings ({mean_chars:.0f} characters on average)"
    if distinct > ID_SHARE * len(values):
        return (
            f"{{kind: hashed, buckets: {max(1024, 4 * distinct)}}}",
            f"an id: {distinct} distinct of {len(values)} values looked at",
        )
    return "categorical", f"{distinct} distinct of {len(values)} values looked at"
