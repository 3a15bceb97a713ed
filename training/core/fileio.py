"""The one atomic write: a reader sees the old file or the new one, never half of either.

A temp file in the target's directory (same filesystem, so the rename is
atomic), written, fsynced, made 0644, then ``os.replace``d over the target;
the directory is fsynced so the rename itself survives a crash. On any error
the temp file is removed and the previous file is untouched.

    atomic_write(path, lambda handle: torch.save(obj, handle))
    atomic_write_text(path, text)
    atomic_write_json(path, payload)

Everything in the project that publishes a file others read (checkpoints,
manifest.json, eval/metrics.json, stack.json, pid files, bench results) goes
through here. It lives in ``training/`` because that is the lowest layer:
ranks use it, and so can everything above them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], *, durable: bool = True) -> Path:
    """Publish ``path`` whole: ``write(handle)`` fills a temp file that then replaces it.

    ``durable=False`` skips the fsyncs, for files that matter only while this
    process runs (a pid file): atomic, but not crash-durable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600; published files are ordinary, readable files
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = True) -> Path:
    return atomic_write(path, lambda handle: handle.write(text.encode()), durable=durable)


def atomic_write_json(path: str | os.PathLike, payload: Any, *, durable: bool = True, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=indent, default=str), durable=durable)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)
