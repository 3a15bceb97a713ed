"""Build a dataset directory privately, then publish it with one atomic rename.

Prepare writes into ``<root>/.tmp-<fingerprint>-<random>`` and renames it to
``<root>/<fingerprint>`` only once ``manifest.json`` is inside. A crash leaves a
temp directory nobody reads; two processes preparing the same fingerprint both
build, one rename wins, and the loser discards its copy and uses the winner's.
A ``<fingerprint>`` directory without a manifest (not made by this code, or
left by hand) is never taken as complete: it is moved aside and replaced.

To an object store (``data.root`` an fsspec URL), which has no rename of a folder, ``upload`` copies every file
and ``manifest.json`` last: a prefix without a manifest is never taken as complete, and the next prepare uploads
over it (the same fingerprint, the same bytes).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from training.core.layout import MANIFEST
from training.core.location import filesystem

TEMP_PREFIX = ".tmp-"
_OWNER_FILE = ".owner"
# A temp dir whose owner cannot be checked (another host) is stale after this long.
STALE_AFTER_S = 24 * 3600


def is_complete(dataset_dir: Path) -> bool:
    return (dataset_dir / MANIFEST).is_file()


def make_temp_dir(root: Path, fingerprint: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f"{TEMP_PREFIX}{fingerprint}-{secrets.token_hex(4)}"
    temp.mkdir()
    (temp / _OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return temp


def publish(temp: Path, target: Path) -> bool:
    """Rename ``temp`` to ``target``; False (and ``temp`` removed) when another process published first."""
    (temp / _OWNER_FILE).unlink(missing_ok=True)
    for _ in range(3):
        try:
            os.rename(temp, target)  # atomic; fails on a non-empty target
            return True
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if is_complete(target):
            shutil.rmtree(temp, ignore_errors=True)
            return False
        discard(target)
    raise OSError(f"could not publish {temp} as {target}: an incomplete directory keeps reappearing there")


def discard(dataset_dir: Path) -> None:
    """Remove a dataset directory that must not be used: renamed away first (atomic), then deleted."""
    aside = dataset_dir.parent / f"{TEMP_PREFIX}{dataset_dir.name}-discarded-{secrets.token_hex(4)}"
    try:
        os.rename(dataset_dir, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def remove_stale_temp_dirs(root: Path) -> list[Path]:
    """Delete temp dirs whose builder died (same host, dead pid) or that are older than STALE_AFTER_S."""
    removed = []
    for temp in root.glob(f"{TEMP_PREFIX}*"):
        if temp.is_dir() and _is_stale(temp):
            shutil.rmtree(temp, ignore_errors=True)
            removed.append(temp)
    return removed


def _is_stale(temp: Path) -> bool:
    try:
        host, pid = (temp / _OWNER_FILE).read_text().split()
        if host == socket.gethostname():
            return not _pid_alive(int(pid))
    except (OSError, ValueError):
        pass  # no owner file: mid-publish, or an old leftover; fall back to age
    try:
        return time.time() - temp.stat().st_mtime > STALE_AFTER_S
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def upload(built: Path, target: str) -> None:
    """Copy the dataset built in ``built`` to ``target`` (a URL): every file, then ``manifest.json``."""
    fs, prefix = filesystem(target)
    files = [path for path in sorted(built.rglob("*")) if path.is_file() and not path.name.startswith(".")]
    for path in [*(p for p in files if p.name != MANIFEST), built / MANIFEST]:
        fs.put_file(str(path), f"{prefix}/{path.relative_to(built).as_posix()}")


def object_sizes(target: str) -> dict[str, int]:
    """Each object under ``target`` (a URL): its path relative to it -> its size."""
    fs, prefix = filesystem(target)
    fs.invalidate_cache(prefix)
    found = fs.find(prefix, detail=True)
    return {name[len(prefix) :].lstrip("/"): int(info["size"]) for name, info in found.items()}
