"""Which Arrow column types are which: numbers, strings, lists of numbers, and a dictionary column's values.
The kinds say with these which source columns they take (``Codec.takes``); prepare's column checks use them too."""

from __future__ import annotations

import pyarrow as pa


def value_type(kind: pa.DataType) -> pa.DataType:
    return kind.value_type if pa.types.is_dictionary(kind) else kind


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


def is_vector(kind: pa.DataType) -> bool:
    list_kind = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return list_kind and (is_numeric(kind.value_type) or pa.types.is_null(kind.value_type))


def is_category(kind: pa.DataType) -> bool:
    kind = value_type(kind)
    return is_text(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind)


def is_hashable(kind: pa.DataType) -> bool:
    kind = value_type(kind)
    return is_text(kind) or pa.types.is_integer(kind) or pa.types.is_binary(kind)


def is_number(kind: pa.DataType) -> bool:
    """A number column, dictionary-encoded or not."""
    return is_numeric(value_type(kind))
