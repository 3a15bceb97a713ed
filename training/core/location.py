"""Where a prepared dataset lives: a local directory or an fsspec URL (``s3://bucket/shards/<fingerprint>``,
``gs://...``, ``file://...``), and the few reads a rank makes of it.

A location is a string. A local one stays a path (``Path`` operations apply); a URL is joined with ``/`` and read
through fsspec (``s3fs`` for s3://: ``pip install ddpflow[s3]``; credentials and the endpoint from the usual AWS
variables, e.g. ``AWS_ENDPOINT_URL_S3``). ``file://`` is a local path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any


def is_url(location: str | os.PathLike) -> bool:
    """An fsspec URL other than ``file://`` (which is read as the local path it names)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def local_path(location: str | os.PathLike) -> Path:
    """A local location as a path (``file://`` removed)."""
    return Path(str(location).removeprefix("file://")).expanduser()


def join(location: str | os.PathLike, *parts: str) -> str:
    """``location/part/...``: a URL joined with ``/``, a local path as a path."""
    if is_url(location):
        return "/".join([str(location).rstrip("/"), *(part.strip("/") for part in parts)])
    return str(local_path(location).joinpath(*parts))


@functools.lru_cache(maxsize=8)
def _filesystem(protocol: str, endpoint: str | None) -> Any:
    import fsspec

    # One instance per protocol and endpoint in this process (s3fs keeps its connections in it); fsspec's own
    # instance cache would keep an instance made for an earlier endpoint.
    return fsspec.filesystem(protocol, skip_instance_cache=True)


def filesystem(location: str | os.PathLike) -> tuple[Any, str]:
    """(the fsspec filesystem, the path as it knows it) of a location, local or URL."""
    import fsspec

    if not is_url(location):
        return fsspec.filesystem("file"), str(local_path(location))
    protocol = str(location).split("://", 1)[0]
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    try:
        fs = _filesystem(protocol, endpoint)
    except ImportError as error:
        raise ImportError(f"{location}: its filesystem needs a package that is not installed ({error})") from None
    return fs, fs._strip_protocol(str(location))


def read_text(location: str | os.PathLike) -> str:
    """A small file's text (a manifest, encoders.json); ``FileNotFoundError`` naming the location."""
    if not is_url(location):
        return local_path(location).read_text()
    fs, path = filesystem(location)
    try:
        with fs.open(path, "rb") as handle:
            return handle.read().decode()
    except FileNotFoundError:
        raise FileNotFoundError(f"{location}: no such object") from None


def exists(location: str | os.PathLike) -> bool:
    if not is_url(location):
        return local_path(location).exists()
    fs, path = filesystem(location)
    fs.invalidate_cache(path)
    return fs.exists(path)


def open_parquet(location: str | os.PathLike):
    """A Parquet file where it lives, for reading record batch by record batch (``pyarrow.parquet.ParquetFile``):
    a local file by its path, an object through fsspec."""
    import pyarrow.parquet as pq

    if not is_url(location):
        return pq.ParquetFile(local_path(location))
    fs, path = filesystem(location)
    return pq.ParquetFile(fs.open(path, "rb"))
