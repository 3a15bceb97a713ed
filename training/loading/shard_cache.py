"""The stream's local cache: a node's shard files, on its own disk, never more than ``data.stream_cache_limit`` bytes.

Every local rank of a node shares one directory, ``<cache dir>/<fingerprint>/stream/``, which mirrors the dataset's
layout (``train/part-00003.parquet``). A shard is copied in from where the dataset lives (a local path or an
fsspec URL: training/core/location.py) the first time a rank of the node needs it; the node's other ranks find it
there. Files are evicted least recently used first (the one read longest ago) when a new one needs the room.

- **The limit holds at every instant.** A download first reserves its whole size (the manifest's ``bytes``): under
  the cache's lock (``.cache.lock``, an exclusive ``flock``) it evicts until the files present plus the new one fit,
  then creates the download's temp file at its full size, so what the directory holds (complete files and
  downloads under way) never exceeds the limit. A download that cannot fit yet (every file in use) releases the
  lock and waits for room.
- **A file in use is never evicted.** A reader holds a shared ``flock`` on the shard's lock file
  (``.locks/<name>.lock``) from finding the file until it has read it (``pinned``); eviction takes that lock
  exclusively without waiting, so a pinned file is skipped. The download holds it exclusively, so the node's
  other ranks wait for the one copy instead of fetching their own.
- **Recency** is the file's modification time, set each time a rank pins it.
- **A crash** leaves at most a temp file: one of a dead process (same host) is removed at the next admission,
  and a complete file is always whole (downloaded to the temp name, then renamed).

Two windows of the largest shards must fit (``check_limit``): a rank reads a window's shards together while its
prefetch reads the next, and the node's ranks are never more than a window apart (every step waits for all).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil

from training.core.config import ConfigError
from training.core.location import filesystem, join
from training.core.manifest import ShardInfo

LOCKS = ".locks"
CACHE_LOCK = ".cache.lock"
PART = ".part-"  # a download under way: <file>.part-<host>-<pid>
COPY_BLOCK = 8 << 20
WAIT_S = 0.05  # between two looks for room while every file is in use
WAIT_LIMIT_S = 900.0  # room that never comes: the limit is below what the ranks pin together


class StreamCacheError(RuntimeError):
    """The stream's cache cannot hold what the ranks need (the limit, the disk, a permission)."""


def check_limit(limit: int, largest_shard: int, window: int) -> None:
    """The cache must hold two windows of the largest shards; a ``ConfigError`` naming the numbers."""
    needed = 2 * window * largest_shard
    if limit < needed:
        raise ConfigError(
            f"data.stream_cache_limit {limit} bytes is below two windows of the largest shards (2 x "
            f"data.shuffle_window {window} x {largest_shard} bytes = {needed}): raise it to at least {needed}, "
            "or lower data.shuffle_window"
        )


class ShardCache:
    """The node's cache of one dataset's shard files (module docstring)."""

    def __init__(self, directory: str | os.PathLike, limit: int, dataset: str):
        self.directory, self.limit, self.dataset = Path(directory), int(limit), dataset
        self.peak = 0  # the most this process saw the directory hold, right after it reserved a download
        self.downloaded = 0  # bytes this process copied in
        try:
            (self.directory / LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StreamCacheError(
                f"cannot create the stream cache {self.directory}: {error.strerror}; point data.cache_dir at a "
                f"writable node-local directory with room for data.stream_cache_limit ({self.limit} bytes)"
            ) from None

    def used_bytes(self) -> int:
        """What the directory's shard files take now: complete files and the downloads' reserved sizes."""
        return sum(_size(path) for path in self._files(complete=False))

    @contextmanager
    def pinned(self, shards: Sequence[ShardInfo]) -> Iterator[Path]:
        """The shards present in the cache and held there (none evicted) until the block ends; yields the cache's
        directory, where each is ``directory / shard.file``. Missing ones are copied in together, a thread each:
        a window's reads wait for the slowest request, not for the sum of them."""
        missing = [shard for shard in shards if not (self.directory / shard.file).exists()]
        if len(missing) > 1:
            with ThreadPoolExecutor(len(missing), thread_name_prefix="ddpflow-shard") as pool:
                for done in [pool.submit(self._fetch, shard) for shard in missing]:
                    done.result()
        with ExitStack() as held:
            for shard in shards:
                held.enter_context(self._pin(shard))
            yield self.directory

    def _fetch(self, shard: ShardInfo) -> None:
        with self._pin(shard):
            pass

    # --- one shard -------------------------------------------------------------------------------------------

    @contextmanager
    def _pin(self, shard: ShardInfo) -> Iterator[Path]:
        path = self.directory / shard.file
        with open(self._lock_path(shard.file), "a+b") as lock:
            while True:
                fcntl.flock(lock, fcntl.LOCK_SH)
                if path.exists():
                    os.utime(path)  # the most recently used
                    break
                fcntl.flock(lock, fcntl.LOCK_UN)
                fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node: the others wait here, then find it
                try:
                    if not path.exists():
                        self._download(shard, path)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            try:
                yield path
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _download(self, shard: ShardInfo, path: Path) -> None:
        """Reserve the shard's size (evicting the least recently used files), then copy it in and publish it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{path.name}{PART}{socket.gethostname()}-{os.getpid()}")
        self._reserve(shard, temp)
        source = join(self.dataset, shard.file)
        try:
            copied = self._copy(source, temp, shard.bytes)
            if copied != shard.bytes:
                holds = f"more than {shard.bytes}" if copied > shard.bytes else str(copied)
                raise StreamCacheError(
                    f"{source}: holds {holds} bytes, the manifest says {shard.bytes}: the dataset was altered "
                    "since it was prepared; prepare it again"
                )
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self.downloaded += copied

    def _copy(self, source: str, temp: Path, reserved: int) -> int:
        """Copy ``source`` into ``temp``; the bytes copied. Not one byte past ``reserved``: a source larger than
        the manifest says stops the copy there (the count then exceeds ``reserved``)."""
        fs, remote = filesystem(source)
        copied = 0
        try:
            src = fs.open(remote, "rb")
        except FileNotFoundError:
            raise StreamCacheError(f"{source}: a shard the manifest lists does not exist") from None
        with src, open(temp, "r+b") as dst:
            while block := src.read(COPY_BLOCK):
                if copied + len(block) > reserved:
                    return copied + len(block)
                try:
                    dst.write(block)
                except OSError as error:
                    raise StreamCacheError(f"cannot write the stream cache {temp}: {error.strerror}") from None
                copied += len(block)
            dst.truncate(copied)
        return copied

    def _reserve(self, shard: ShardInfo, temp: Path) -> None:
        """Under the cache's lock: evict until the shard fits, then hold its room with a temp file of its size."""
        if shard.bytes > self.limit:
            raise StreamCacheError(
                f"{shard.file} takes {shard.bytes} bytes, more than data.stream_cache_limit ({self.limit})"
            )
        waited_since = time.monotonic()
        while True:
            with self._cache_lock():
                self._remove_dead_downloads()
                used = self.used_bytes()
                while used + shard.bytes > self.limit and (freed := self._evict_one()):
                    used -= freed
                if used + shard.bytes <= self.limit:
                    try:
                        with open(temp, "wb") as handle:
                            handle.truncate(shard.bytes)
                    except OSError as error:
                        raise StreamCacheError(f"cannot write the stream cache {temp}: {error.strerror}") from None
                    self.peak = max(self.peak, used + shard.bytes)
                    return
            if time.monotonic() - waited_since > WAIT_LIMIT_S:
                raise StreamCacheError(
                    f"the stream cache {self.directory} stayed full of shards in use for {WAIT_LIMIT_S:.0f} s "
                    f"({used} of data.stream_cache_limit {self.limit} bytes): raise the limit"
                )
            time.sleep(WAIT_S)

    def _evict_one(self) -> int:
        """Remove the least recently used complete file that no rank holds; its size (0: none could go)."""
        for path in sorted(self._files(complete=True), key=lambda p: p.stat().st_mtime_ns):
            with open(self._lock_path(str(path.relative_to(self.directory))), "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # pinned, or being downloaded
                try:
                    size = path.stat().st_size
                    path.unlink()
                    return size
                except FileNotFoundError:
                    continue
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        return 0

    def _lock_path(self, relative: str) -> Path:
        return self.directory / LOCKS / (relative.replace("/", "__") + ".lock")

    def _files(self, complete: bool) -> list[Path]:
        found = []
        for folder, names, files in os.walk(self.directory):
            names[:] = [name for name in names if name != LOCKS]
            for name in files:
                if name == CACHE_LOCK or (complete and PART in name):
                    continue
                found.append(Path(folder) / name)
        return found

    def _remove_dead_downloads(self) -> None:
        """Temp files whose downloader died on this host: their reserved room is free again."""
        host = socket.gethostname()
        for path in self._files(complete=False):
            owner = path.name.rpartition(PART)[2] if PART in path.name else ""
            owner_host, _, pid = owner.rpartition("-")
            if owner_host == host and pid.isdigit() and not psutil.pid_exists(int(pid)):
                path.unlink(missing_ok=True)

    @contextmanager
    def _cache_lock(self) -> Iterator[None]:
        with open(self.directory / CACHE_LOCK, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _size(path: Path) -> int:
    """A file's size; a download renamed to its final name since it was listed (which the listing may lack) by
    that name."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        if PART not in path.name:
            raise  # complete files go only under the cache's lock, which the caller holds
        return path.with_name(path.name.rpartition(PART)[0]).stat().st_size
