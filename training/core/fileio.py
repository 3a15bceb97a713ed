"""How a rank writes, in one place: the one atomic write (a reader sees the old file or the new one, never half of
either), the one durable append of a JSON line (``append_line``, read back whole by ``read_metrics_lines``: a torn
last line is skipped), and its log lines (``log_main``, ``log_rank``: stdout, which torchrun's ``--tee`` keeps as
the rank's file under RUN_DIR/logs) with their prefixes.

A temp file in the target's directory (same filesystem, so the rename is
atomic), written, fsynced, made 0644, then ``os.replace``d over the target;
the directory is fsynced so the rename itself survives a crash. On any error
the temp file is removed and the previous file is untouched.

    atomic_write(path, lambda handle: torch.save(obj, handle))
    atomic_write_text(path, text)
    atomic_write_json(path, payload)
    with atomic_path(path, durable=False) as temp:   # for a writer that takes a path (pyarrow, torch's
        pq.write_table(table, temp)                   # error file): temp replaces path when the block ends
    append_line(path, record)                         # metrics.jsonl, steps.jsonl: one line, fsynced
    read_metrics_lines(path)                          # their lines (and a script's reports.jsonl)
    log_main(ctx.is_main, "data: ...")                # [train] data: ...  (rank 0 only)
    log_rank(f"rank {rank}: ...", DATA)               # [data] rank 1: ...  (whichever rank)

Everything in the project that publishes a file others read (checkpoints,
manifest.json, eval/metrics.json, stack.json, pid files, bench results, a
scoring's parts and model copy, a rank's error file) goes through here, and
rank code prints through ``log_main``/``log_rank``: tests and bench/ match
lines by ``TRAIN`` and ``DATA``, never by literals. It lives in ``training/``
because that is the lowest layer: ranks use it, and so can everything above
them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], *, durable: bool = True) -> Path:
    """Publish ``path`` whole: ``write(handle)`` fills a temp file that then replaces it.

    ``durable=False`` skips the fsyncs, for files that matter only while this
    process runs (a pid file): atomic, but not crash-durable.
    """
    with atomic_path(path, durable=durable) as temp, open(temp, "r+b") as handle:  # read-write: a writer may map it
        write(handle)
    return Path(path)


@contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """A temp file beside ``path`` (``.NAME-XXXX.tmp``, mode 0644) for the block to fill by its path; when the
    block ends it replaces ``path`` (fsynced first unless ``durable=False``); on an error it is removed and
    ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    temp = Path(name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600; published files are ordinary, readable files
        os.close(fd)
        yield temp
        if durable:
            with open(temp, "rb") as written:
                os.fsync(written.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(path.parent)


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


def append_line(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, flushed and fsynced: a crash leaves at most a torn last line (``read_metrics_lines``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics_lines(path: str | Path) -> list[dict[str, Any]]:
    """The epochs in a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


TRAIN = "[train]"  # what the training program says (rank 0, or the rank a fault hit)
DATA = "[data]"  # how each rank got its splits (the node cache)


def log_rank(message: str, prefix: str = TRAIN) -> None:
    """A line from this rank, whichever rank it is."""
    print(f"{prefix} {message}", flush=True)


def log_main(is_main: bool, message: str, prefix: str = TRAIN) -> None:
    """A line from rank 0 only: what every rank would say alike."""
    if is_main:
        log_rank(message, prefix)


def byte_size(count: int) -> str:
    """A size in bytes as a log line writes it: kB below 1e6, MB below 1e9, else GB."""
    if count < 1e6:
        return f"{count / 1e3:,.1f} kB"
    return f"{count / 1e6:,.1f} MB" if count < 1e9 else f"{count / 1e9:,.2f} GB"
