"""One read-only copy of each split per node: the loaded tensors in a file that every local rank maps.

Without it each rank reads the Parquet shards into tensors of its own, and N
ranks on a node hold N copies. With it the first process on the node that
needs a split builds it ONCE, by calling ``training.loading.batches.load_split`` (so
reading and normalising stay in exactly one place), and writes the tensors
out in the layout the loader gathers from::

    <cache dir>/<split>-f<format>n<normalisation>-<key>.bin
        4096-byte header | features float32 [rows, n_features] | input.<name> [rows, *shape] ... |
        input.<ragged>.offsets int64 [rows + 1] ... | labels [rows] | weights float32 [rows] (with data.weight) |
        input.<ragged>.values [total] ...; each section 64-byte aligned

A ragged input (text token ids, image bytes) has as many values as its encoding makes, known only once the
split is encoded: its values go last, streamed to an unlinked side file during the build and copied in
after, and the header, written last, gives their size (checked against the file's size and the offsets).

The cache dir is ``<data.cache_dir>/<fingerprint>/``, or ``<dataset dir>/cache/``
beside the shards when ``data.cache_dir`` is not set. ``key`` hashes the whole
manifest (statistics included). Every rank then maps the file read-only
(``numpy.memmap``, ``MAP_SHARED``): the page cache holds the data once for the
whole node and each rank's tensors are views of those pages.

- One builder: an exclusive ``fcntl.flock`` on ``<file>.lock``. The first
  process to take it builds into a temp name (``training.core.fileio.atomic_write``:
  fsynced, then renamed into place); the others block on the lock, then find
  the file valid and map it. Two runs on one node share the lock too. A
  builder that dies releases the lock and leaves no ``.bin`` behind.
- The build sizes the file up front, maps it and fills every section record
  batch by record batch (``training.loading.batches.fill_split``, the one loading
  rule): its memory beyond the file's pages is one record batch. A large
  build (over ``BUILD_IN_RANK_MAX_BYTES``, or with a ragged input) runs in a
  short-lived child process (``python -m training.loading.node_cache``, the
  manifest on stdin), so that the decode buffers the allocators keep leave
  with the child and the building rank then holds what every other rank
  holds: the mapping. A small one runs in the rank: the child's interpreter
  and imports would cost more time and memory than the build.
- Validated on every open, from the open file itself: magic, header checksum,
  format and normalisation versions, manifest key, fingerprint, split, rows,
  features, every section's name, dtype, shape and offset, and the file's size. A file that fails is rebuilt
  and the reason is returned for the log line.
- A cache dir that cannot be written (read-only, full disk, no permission)
  raises ``NodeCacheError`` naming the path and ``data.cache_dir``; the temp
  file is removed, so nothing half-written stays.

The payload is not checksummed on open (that would read every page on every
rank); the header, the size and the atomic rename are what guard it.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from training.core.digest import json_digest
from training.core.fileio import atomic_write
from training.core.location import is_url, local_path
from training.core.manifest import Manifest
from training.kinds.inputs import inputs_from_manifest
from training.kinds.normalisation import NORMALISATION_VERSION
from training.loading.batches import (
    ShardError,
    SplitArrays,
    fill_split,
    load_split,
    manifest_codecs,
    split_from_sections,
    split_layout,
)

# Bump when the file layout or the header changes: old files then fail validation (and their name).
# What load_split returns is versioned where that rule lives (NORMALISATION_VERSION); new manifest
# statistics need no bump at all: the key hashes the whole manifest.
# 2: sections (the numeric block, one per other input, labels, weights), listed in the header.
# (Ragged sections came without a bump: a manifest with a ragged input is new, so no old file can match it.)
FORMAT_VERSION = 2
MAGIC = b"DDPFSPLT"
HEADER_BYTES = 4096  # the payload starts page-aligned
ALIGN = 64  # every section starts on a cache line
_PREFIX = struct.Struct("<8sII")  # magic, JSON length, CRC-32 of the JSON


class NodeCacheError(RuntimeError):
    """The node cache cannot be built where ``data.cache_dir`` points (read-only, full, no permission)."""


@dataclass(frozen=True)
class CachedSplit:
    """A split mapped from its node cache file, and how this process got it."""

    name: str
    tensors: SplitArrays
    path: Path
    inode: int
    how: str  # "ready" (valid on open), "waited" (another process built it), "built", "rebuilt", "empty"
    detail: str  # why it was rebuilt, or whose build this process waited for
    seconds: float  # until this process held all the splits it asked for together

    def describe(self) -> str:
        """One log line: where the split came from, so every rank's line can be compared."""
        if self.how == "empty":
            return f"{self.name}: 0 rows, nothing to map"
        detail = f" ({self.detail})" if self.detail else ""
        return (
            f"{self.name}: {len(self.tensors)} rows mapped from {self.path} (inode {self.inode}); "
            f"{self.how}{detail} in {self.seconds:.2f} s"
        )


def cache_directory(dataset_dir: str | Path, manifest: Manifest, cache_dir: str | None) -> Path:
    """``<data.cache_dir>/<fingerprint>`` when set, else ``<dataset dir>/cache`` beside the shards; a dataset at
    a URL (s3://...) without ``data.cache_dir``: ``<the temp dir>/ddpflow-cache/<fingerprint>``, node-local. The
    stream's cache is its ``stream/`` folder (training/loading/stream.py)."""
    if cache_dir:
        return Path(cache_dir).expanduser() / manifest.fingerprint
    if is_url(dataset_dir):
        return Path(tempfile.gettempdir()) / "ddpflow-cache" / manifest.fingerprint
    return local_path(dataset_dir) / "cache"


def manifest_key(manifest: Manifest) -> str:
    """Hash of the whole manifest: new statistics, rows or shards give a new file."""
    return json_digest(manifest.to_dict())


def cache_path(dataset_dir: str | Path, manifest: Manifest, split: str, cache_dir: str | None) -> Path:
    versions = f"f{FORMAT_VERSION}n{NORMALISATION_VERSION}"
    return cache_directory(dataset_dir, manifest, cache_dir) / f"{split}-{versions}-{manifest_key(manifest)}.bin"


def bytes_to_build(dataset_dir: str | Path, manifest: Manifest, splits: Sequence[str], cache_dir: str | None) -> int:
    """What building the splits' files that are not there yet would write (a ragged input's values counted as
    its shards' bytes: their encoded size is known only once encoded)."""
    total = 0
    for split in splits:
        if cache_path(dataset_dir, manifest, split, cache_dir).exists():
            continue
        expected = _expected_header(manifest, split)
        ragged = sum(shard.bytes for shard in manifest.splits[split].shards) if expected["file_bytes"] is None else 0
        total += (expected["file_bytes"] or expected["fixed_bytes"]) + ragged
    return total


def open_split(dataset_dir: str | Path, manifest: Manifest, split: str, cache_dir: str | None = None) -> CachedSplit:
    """One split's tensors, mapped read-only from the node cache; built first if no valid file exists."""
    return open_splits(dataset_dir, manifest, [split], cache_dir)[split]


def open_splits(
    dataset_dir: str | Path, manifest: Manifest, splits: Sequence[str], cache_dir: str | None = None
) -> dict[str, CachedSplit]:
    """Each split's tensors, mapped read-only from the node cache. Splits without a valid file are built
    first, together (in this process or in the builder child: ``builds_in_rank``); ``seconds`` is the time
    until this process held every split."""
    started = time.monotonic()
    got: dict[str, tuple[SplitArrays, int, str, str]] = {}  # split -> tensors, inode, how, detail
    missing: dict[str, str] = {}  # split -> why its file is not usable
    for split in splits:
        expected = _expected_header(manifest, split)
        if expected["rows"] == 0:  # nothing to map (mmap refuses empty ranges); an empty split costs nothing
            got[split] = (load_split(dataset_dir, manifest, split), 0, "empty", "")
            continue
        mapped, problem = _try_map(cache_path(dataset_dir, manifest, split, cache_dir), expected, manifest)
        if mapped is None:
            missing[split] = problem
        else:
            got[split] = (*mapped, "ready", "")
    if missing:
        got |= _build_missing(dataset_dir, manifest, sorted(missing), cache_dir)
    seconds = time.monotonic() - started
    if any(info.ragged_dtype for info in inputs_from_manifest(manifest).values()):  # their codecs collate batches
        codecs = manifest_codecs(dataset_dir, manifest)
        got = {split: (tensors.with_codecs(codecs), *rest) for split, (tensors, *rest) in got.items()}
    return {
        split: CachedSplit(
            split, got[split][0], cache_path(dataset_dir, manifest, split, cache_dir), *got[split][1:], seconds
        )
        for split in splits
    }


def _build_missing(
    dataset_dir: str | Path, manifest: Manifest, splits: list[str], cache_dir: str | None
) -> dict[str, tuple[SplitArrays, int, str, str]]:
    """Under each split's lock (taken in sorted order, the same in every process: no deadlock), build the
    splits still invalid once the lock is ours; the others were built by whoever held it."""
    got, to_build = {}, {}
    with ExitStack() as locks:
        for split in splits:
            path, expected = cache_path(dataset_dir, manifest, split, cache_dir), _expected_header(manifest, split)
            holder = locks.enter_context(_build_lock(path, cache_dir, expected))
            mapped, problem = _try_map(path, expected, manifest)  # built by the process we waited for?
            if mapped is not None:
                got[split] = (*mapped, "waited", f"built by {holder}") if holder else (*mapped, "ready", "")
            else:
                to_build[split] = problem
                _remove_leftovers(path, split, expected["key"])
        if to_build:
            build = _build_splits if builds_in_rank(manifest, list(to_build)) else _build_in_child
            build(dataset_dir, manifest, list(to_build), cache_dir)
        for split, problem in to_build.items():
            path, expected = cache_path(dataset_dir, manifest, split, cache_dir), _expected_header(manifest, split)
            mapped, after = _try_map(path, expected, manifest)
            if mapped is None:
                raise NodeCacheError(f"{path}: the node cache file just built does not validate: {after}")
            got[split] = (*mapped, *(("built", "") if problem == "missing" else ("rebuilt", problem)))
    return got


# --------------------------------------------------------------------------- header and validation


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN  # each section starts on a cache line


def _expected_header(manifest: Manifest, split: str) -> dict[str, Any]:
    """The header a valid file of ``split`` has: the manifest's key, the rows and every section's place.

    A ragged input's values section has ``shape`` and ``offset`` None here, and so has ``file_bytes``: the file's
    own header gives them (``_sized``); ``fixed_bytes`` is where they start."""
    rows = manifest.rows(split)
    sections, offset = [], HEADER_BYTES
    for section in split_layout(manifest):
        dtype = str(section.dtype).removeprefix("torch.")
        if section.extent == "values":  # last in the layout: the fixed sections' places do not depend on them
            sections.append({"name": section.name, "dtype": dtype, "shape": None, "offset": None})
            continue
        shape = section.full_shape(rows)
        sections.append({"name": section.name, "dtype": dtype, "shape": list(shape), "offset": offset})
        offset = _aligned(offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    ragged = any(section["shape"] is None for section in sections)
    return {
        "format_version": FORMAT_VERSION,
        "normalisation_version": NORMALISATION_VERSION,
        "key": manifest_key(manifest),
        "fingerprint": manifest.fingerprint,
        "split": split,
        "rows": rows,
        "n_features": manifest.n_features,
        "sections": sections,
        "file_bytes": None if ragged else offset,
        **({"fixed_bytes": offset} if ragged else {}),
    }


def _sized(expected: dict[str, Any], totals: dict[str, int]) -> dict[str, Any]:
    """``expected`` with each ragged values section placed after the fixed ones, holding ``totals[name]`` values."""
    if expected["file_bytes"] is not None:
        return expected
    sections, offset = [], expected["fixed_bytes"]
    for section in expected["sections"]:
        if section["shape"] is None:
            count = totals[section["name"]]
            section = {**section, "shape": [count], "offset": offset}
            offset = _aligned(offset + count * np.dtype(section["dtype"]).itemsize)
        sections.append(section)
    return {**expected, "sections": sections, "file_bytes": offset}


def _ragged_totals(header: dict[str, Any], expected: dict[str, Any]) -> dict[str, int] | None:
    """The values count of each ragged section as the file's header gives it; None if it gives none."""
    wanted = [section["name"] for section in expected["sections"] if section["shape"] is None]
    found = {s.get("name"): s.get("shape") for s in header.get("sections") or [] if isinstance(s, dict)}
    totals = {name: found.get(name) for name in wanted}
    if not all(isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) for shape in totals.values()):
        return None  # an older or damaged header
    return {name: shape[0] for name, shape in totals.items()}


def _encode_header(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, sort_keys=True).encode()
    encoded = _PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body
    if len(encoded) > HEADER_BYTES:
        raise ValueError(f"node cache header of {len(encoded)} bytes exceeds {HEADER_BYTES}")
    return encoded.ljust(HEADER_BYTES, b"\0")


def _header_problem(handle: IO[bytes], expected: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(Why the open file is not the expected cache or None, the expected header sized by the file's ragged
    sections). Checks the header, then the size."""
    raw = handle.read(HEADER_BYTES)
    if len(raw) < _PREFIX.size:
        return f"truncated: {os.fstat(handle.fileno()).st_size} bytes, shorter than a header", expected
    magic, length, crc = _PREFIX.unpack_from(raw)
    body = raw[_PREFIX.size : _PREFIX.size + length]
    if magic != MAGIC:
        return f"corrupt header: magic {magic!r}, expected {MAGIC!r}", expected
    if len(body) != length or zlib.crc32(body) != crc:
        return "corrupt header: its checksum does not match", expected
    try:
        header = json.loads(body)
    except ValueError:
        return "corrupt header: not JSON", expected
    totals = _ragged_totals(header, expected)
    if totals is None:
        return "stale: the header does not size the ragged sections", expected
    expected = _sized(expected, totals)
    differing = [name for name, value in expected.items() if header.get(name) != value]
    if differing:
        stale = ", ".join(f"{name} {header.get(name)!r} (expected {expected[name]!r})" for name in differing)
        return "stale: " + stale, expected
    size = os.fstat(handle.fileno()).st_size
    if size != expected["file_bytes"]:
        return f"truncated: {size} bytes, the header says {expected['file_bytes']}", expected
    return None, expected


def _section_views(buffer: np.ndarray, expected: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each section of the header as a numpy view of ``buffer`` (the whole file)."""
    views = {}
    for section in expected["sections"]:
        dtype, shape = np.dtype(section["dtype"]), tuple(section["shape"])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        views[section["name"]] = buffer[section["offset"] : section["offset"] + size].view(dtype).reshape(shape)
    return views


def _try_map(path: Path, expected: dict[str, Any], manifest: Manifest) -> tuple[tuple[SplitArrays, int] | None, str]:
    """(sections, inode) of a valid file, else (None, why not). Validates and maps the SAME open file."""
    try:
        with open(path, "rb") as handle:
            problem, expected = _header_problem(handle, expected)
            if problem is not None:
                return None, problem
            buffer = np.memmap(handle, dtype=np.uint8, mode="r", shape=(expected["file_bytes"],))
            inode = os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return None, "missing"
    with warnings.catch_warnings():
        # The mapping is read-only on purpose (one copy for the node); torch warns that it cannot mark
        # a tensor read-only. Nothing writes to these tensors: batches are gathered into new ones.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        sections = {name: torch.from_numpy(view) for name, view in _section_views(buffer, expected).items()}
    try:
        split = split_from_sections(manifest, sections)
    except ValueError as error:  # a ragged input's offsets that do not span its values
        return None, f"corrupt: {error}"
    return (split, inode), ""


# --------------------------------------------------------------------------- building


def _unwritable(path: Path, cache_dir: str | None, error: OSError, expected: dict[str, Any]) -> NodeCacheError:
    where = (
        f"data.cache_dir={cache_dir!r}"
        if cache_dir
        else "data.cache_dir is not set, so the cache goes beside the prepared shards"
    )
    return NodeCacheError(
        f"cannot write the node data cache {path}: {error.strerror or error} ({where}); "
        f"point data.cache_dir at a writable directory with room for the {expected['split']} split "
        f"({(expected['file_bytes'] or expected['fixed_bytes']) / 1e6:.2f} MB"
        f"{'' if expected['file_bytes'] else ' and its ragged inputs'})"
    )


@contextmanager
def _build_lock(path: Path, cache_dir: str | None, expected: dict[str, Any]) -> Iterator[str]:
    """Hold ``<file>.lock`` exclusively; yields who held it before us ('' if nobody did)."""
    lock = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise _unwritable(lock, cache_dir, error, expected) from error
    try:
        holder = ""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield holder
    finally:
        os.close(fd)


def _build(
    dataset_dir: str | Path,
    manifest: Manifest,
    split: str,
    path: Path,
    expected: dict[str, Any],
    cache_dir: str | None,
) -> None:
    """Fill a file sized up front, mapped, record batch by record batch (``fill_split``, the one loading
    rule), then publish it atomically: its memory beyond the mapping's pages is
    one record batch, never the split. Ragged values stream to unlinked side files and are copied in after."""
    built = {"built_by": f"pid {os.getpid()} on {socket.gethostname()}", "built_at": time.time()}
    fixed = {**expected, "sections": [s for s in expected["sections"] if s["shape"] is not None]}
    fixed_bytes = expected["file_bytes"] if expected["file_bytes"] is not None else expected["fixed_bytes"]

    def write(handle: IO[bytes]) -> None:
        handle.write(b"\0" * HEADER_BYTES)  # the header goes in last, once the ragged sections are sized
        handle.flush()
        os.ftruncate(handle.fileno(), fixed_bytes)  # the fixed sections, zero-filled (sparse)
        mapping = mmap.mmap(handle.fileno(), fixed_bytes)  # mkstemp's descriptor is read-write
        with ExitStack() as side:
            values = {
                s["name"]: side.enter_context(tempfile.TemporaryFile(dir=path.parent))
                for s in expected["sections"]
                if s["shape"] is None
            }
            try:
                buffer = np.frombuffer(mapping, dtype=np.uint8)
                sections = {name: torch.from_numpy(view) for name, view in _section_views(buffer, fixed).items()}
                sinks = {name: side_file.write for name, side_file in values.items()}
                fill_split(dataset_dir, manifest, split, sections, ragged_values=sinks)
                del sections, buffer
                mapping.flush()
            finally:
                mapping.close()
            itemsize = {s["name"]: np.dtype(s["dtype"]).itemsize for s in expected["sections"]}
            header = _sized(expected, {name: f.tell() // itemsize[name] for name, f in values.items()})
            _append_ragged(handle, header, values)
        handle.seek(0)
        handle.write(_encode_header({**header, **built}))
        handle.seek(0, os.SEEK_END)

    try:
        atomic_write(path, write)
    except OSError as error:
        raise _unwritable(path, cache_dir, error, expected) from error


def _append_ragged(handle: IO[bytes], header: dict[str, Any], values: dict[str, IO[bytes]]) -> None:
    """Copy each ragged section's side file to its place in the header's layout, then pad to ``file_bytes``."""
    for section in header["sections"]:
        if section["name"] in values:
            side = values[section["name"]]
            side.seek(0)
            handle.seek(section["offset"])
            shutil.copyfileobj(side, handle, 1 << 20)
    handle.flush()
    os.ftruncate(handle.fileno(), header["file_bytes"])


def _remove_leftovers(path: Path, split: str, key: str) -> None:
    """Under the lock: temp files of builders of this file that died, and this split's files of older
    format or normalisation versions of the same manifest (files of other manifests may be in use)."""
    for stale in path.parent.glob(f".{path.name}-*.tmp"):
        stale.unlink(missing_ok=True)
    for other in path.parent.glob(f"{split}-*-{key}.bin"):
        if other != path:
            other.unlink(missing_ok=True)  # a process still mapping it keeps its pages until it unmaps


# --------------------------------------------------------------------------- where the build runs

# A build of at most this many bytes runs in the rank itself; a larger one, or one with a ragged input (its size
# is known only once encoded), in the builder child. Why: the child keeps a large build's decode buffers, which
# the allocators hold on to, out of the rank's heap for the whole run. But it is a fresh interpreter that
# imports torch: 3.2-4.6 s (3.5 CPU s) on 2 cores before it is done, where the rank builds 0.2 MB of splits in
# 0.2 s and 59 MB in 0.8 s, keeping 7 and 14-17 MB of anonymous memory (docs/benchmarks.md, "Node cache
# start-up"). Start-up is most of a small run; 64 MiB keeps what the rank keeps well below its own imports.
BUILD_IN_RANK_MAX_BYTES = 64 << 20


def builds_in_rank(manifest: Manifest, splits: Sequence[str]) -> bool:
    """Whether building ``splits`` together stays in this process (see ``BUILD_IN_RANK_MAX_BYTES``)."""
    sizes = [_expected_header(manifest, split)["file_bytes"] for split in splits]
    return None not in sizes and sum(sizes) <= BUILD_IN_RANK_MAX_BYTES


def _build_splits(dataset_dir: str | Path, manifest: Manifest, splits: Sequence[str], cache_dir: str | None) -> None:
    """Build each split's file here, one after another (the caller holds their locks)."""
    for split in splits:
        path = cache_path(dataset_dir, manifest, split, cache_dir)
        _build(dataset_dir, manifest, split, path, _expected_header(manifest, split), cache_dir)


# --------------------------------------------------------------------------- the builder process

# Errors the builder child reports that keep their type in the rank (bad shards, an unwritable cache dir).
_ERRORS = {"NodeCacheError": NodeCacheError, "ShardError": ShardError}


def _build_in_child(dataset_dir: str | Path, manifest: Manifest, splits: list[str], cache_dir: str | None) -> None:
    """Run ``_build`` for ``splits`` in a fresh interpreter; its error, if any, is raised here with its message."""
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding ``training``
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "training.loading.node_cache", str(dataset_dir), cache_dir or "", *splits]
    done = subprocess.run(argv, input=json.dumps(manifest.to_dict()), env=env, capture_output=True, text=True)
    if done.returncode == 0:
        return
    reported = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if reported:
        error = json.loads(reported[-1])
        raise _ERRORS.get(error["type"], RuntimeError)(
            error["message"] if error["type"] in _ERRORS else f"{error['type']}: {error['message']}"
        )
    raise RuntimeError(
        f"the node cache builder ({', '.join(splits)}) exited with status {done.returncode}: "
        f"{done.stderr.strip()[-2000:] or 'no output (killed?)'}"
    )


def _builder_main(argv: list[str]) -> int:
    """``python -m training.loading.node_cache DATASET_DIR CACHE_DIR SPLIT...``, the manifest's JSON on stdin;
    an empty CACHE_DIR means the default (beside the shards)."""
    from training.distributed.process import die_with_parent

    die_with_parent()  # a rank that dies takes its builder with it (the locks are already released)
    dataset_dir, cache_dir, splits = argv[0], argv[1] or None, argv[2:]
    manifest = Manifest.from_dict(json.loads(sys.stdin.read()))
    try:
        _build_splits(dataset_dir, manifest, splits, cache_dir)
    except Exception as error:  # reported to the rank, which raises it with the same message
        print(json.dumps({"type": type(error).__name__, "message": str(error)}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_builder_main(sys.argv[1:]))
