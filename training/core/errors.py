"""The one error type for bad input data."""

from __future__ import annotations


class DataError(ValueError):
    """The source data cannot be prepared; the message names the file, column and problem."""
