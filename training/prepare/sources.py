"""Resolve ``data.source`` to something that streams record batches, plus its identity.

A source is one of:
- a local file, directory (searched recursively) or glob of Parquet or CSV files;
- an fsspec URL (``s3://bucket/prefix/``, ``gs://...``, ``file://...``): file, prefix or glob;
- ``synthetic://...`` (see ``training.prepare.synthetic``);
- an image folder, ``root/<class>/<image>`` (see ``training.prepare.image_folder``).

Every file's schema is read up front, so a corrupt file or files whose
columns disagree fail before anything is written, naming the files. Numeric
columns whose types differ only in width or int/float (CSV type inference
differs per file) are widened to one type; anything else is an error.

The identity (paths, sizes, modification times or ETags, or the synthetic
spec) is what the fingerprint hashes: change a file and the fingerprint changes.
``source_identity`` gives the same identity from a listing alone (no file is
opened), for watching a source for new data.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from training.core.errors import DataError
from training.kinds.arrow_types import is_text
from training.prepare import image_folder, synthetic

FORMAT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".parq": "parquet", ".csv": "csv"}
_GLOB_CHARS = ("*", "?", "[")

PARQUET_BUFFER_BYTES = 1 << 20  # a Parquet file is read through a buffered stream of this size


@dataclass
class SourceFile:
    path: str  # as the filesystem knows it (no protocol for fsspec)
    display: str  # what error messages print: the full URL or local path
    size: int
    version: str  # mtime_ns, ETag or whatever the store offers


class FileSource:
    """Parquet or CSV files on a local or fsspec filesystem."""

    def __init__(
        self,
        description: str,
        files: list[SourceFile],
        file_format: str,
        describe: Callable[[str], SourceFile],
        filesystem: Any = None,
    ):
        self.description = description
        self.files = files
        self._describe = describe  # path -> a fresh SourceFile, to notice files changed mid-prepare
        self.file_format = file_format
        self._filesystem = filesystem
        self.schema = _unify_schemas({file.display: self._file_schema(file) for file in files})
        self._dataset = ds.dataset(
            [file.path for file in files], schema=self.schema, format=_file_format(file_format), filesystem=filesystem
        )

    def identity(self) -> dict[str, Any]:
        return files_identity(self.file_format, self.files)

    def changed_files(self) -> list[str]:
        """Files whose size or version differs from when the source was opened (or that are gone)."""
        changed = []
        for file in self.files:
            try:
                now = self._describe(file.path)
            except (OSError, ValueError):
                changed.append(file.display)
                continue
            if (now.size, now.version) != (file.size, file.version):
                changed.append(file.display)
        return changed

    def iter_batches(self, columns: list[str], batch_rows: int) -> Iterator[tuple[str, pa.RecordBatch]]:
        """(file, batch) pairs in file order; a read error names the file."""
        for file, fragment in self.fragments():
            for batch in self.scan(file, fragment, columns, batch_rows):
                yield file.display, batch

    def fragments(self) -> list[tuple[SourceFile, ds.Fragment]]:
        """Each file with its pyarrow.dataset fragment, in file order (batch scoring splits them into row ranges)."""
        return list(zip(self.files, self._dataset.get_fragments(), strict=True))

    def scan(
        self, file: SourceFile, fragment: ds.Fragment, columns: list[str], batch_rows: int
    ) -> Iterator[pa.RecordBatch]:
        """A fragment's (or a subset of its row groups') record batches, memory flat; a read error names the file."""
        try:
            if isinstance(fragment, ds.ParquetFileFragment):
                yield from self._parquet_batches(fragment, columns, batch_rows)
                return
            # No readahead and no scan threads: otherwise the scanner decodes ahead of a slower
            # consumer without bound (measured: 156 MB held on a 3M-row file, growing with it;
            # this way 30 MB). The per-batch numpy work, not decoding, is the bottleneck anyway.
            scanner = ds.Scanner.from_fragment(
                fragment,
                schema=self.schema,
                columns=columns,
                batch_size=batch_rows,
                batch_readahead=0,
                fragment_readahead=0,
                use_threads=False,
            )
            yield from scanner.to_batches()
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{file.display}: cannot be read as {self.file_format}: {error}") from None

    def _parquet_batches(
        self, fragment: ds.ParquetFileFragment, columns: list[str], batch_rows: int
    ) -> Iterator[pa.RecordBatch]:
        """A Parquet fragment's row groups ``batch_rows`` rows at a time, cast to the source's unified schema.
        Not the dataset scanner: it decodes a whole row group before the first batch (measured: 277 MB held
        for a 3M-row file of one row group, 60 MB on disk, as pyarrow writes any file under 1M rows); this
        reader, through a buffered stream, holds about a batch whatever the row group (36 MB for 1M or 3M rows)."""
        target = pa.schema([self.schema.field(name) for name in columns])
        with fragment.filesystem.open_input_file(fragment.path) as handle:
            reader = pq.ParquetFile(handle, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
            groups = [group.id for group in fragment.row_groups]
            for batch in reader.iter_batches(batch_rows, row_groups=groups, columns=columns, use_threads=False):
                yield batch if batch.schema.equals(target) else batch.cast(target)

    def _file_schema(self, file: SourceFile) -> pa.Schema:
        try:
            return ds.dataset([file.path], format=_file_format(self.file_format), filesystem=self._filesystem).schema
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{file.display}: cannot be read as {self.file_format}: {error}") from None


def _file_format(file_format: str) -> ds.FileFormat | str:
    if file_format == "parquet":
        # pre_buffer reads ahead whole column chunks of many row groups: memory grew with the
        # file (200 MB for a 3M-row file) instead of staying at a few batches (36 MB).
        return ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
    return file_format


class SyntheticSource:
    """A ``synthetic://`` spec, generated chunk by chunk."""

    def __init__(self, url: str):
        try:
            self.spec = synthetic.parse_spec(url)
        except synthetic.SyntheticSpecError as error:
            raise DataError(f"data.source: {error}") from None
        self.description = self.spec.url
        self.schema = self.spec.schema()

    def identity(self) -> dict[str, Any]:
        return {"synthetic": self.spec.to_dict(), "generator_version": synthetic.GENERATOR_VERSION}

    def changed_files(self) -> list[str]:
        return []

    def iter_batches(self, columns: list[str], batch_rows: int) -> Iterator[tuple[str, pa.RecordBatch]]:
        for batch in synthetic.iter_batches(self.spec, batch_rows):
            yield self.description, batch.select(columns)


Source = FileSource | SyntheticSource | image_folder.ImageFolderSource


def files_identity(file_format: str, files: list[SourceFile]) -> dict[str, Any]:
    """A file source's identity: its format and each file's name, size and version (mtime or ETag)."""
    return {"format": file_format, "files": [[file.display, file.size, file.version] for file in files]}


def open_source(source: str, file_format: str = "auto", exclude: Path | None = None) -> Source:
    """``exclude``: a local directory whose files are never data (prepare's own output root)."""
    if synthetic.is_synthetic(source):
        return SyntheticSource(source)
    if image_folder.is_image_folder(source, file_format, exclude):
        return image_folder.ImageFolderSource(source, exclude)
    if source.startswith("file://"):
        source = source.removeprefix("file://")
    if "://" in source:
        return _open_fsspec(source, file_format)
    return _open_local(source, file_format, exclude)


def source_identity(source: str, file_format: str = "auto", exclude: Path | None = None) -> dict[str, Any]:
    """``open_source(...).identity()`` from a listing alone: no file is opened, so watching a source is cheap.

    The same files, in the same order, described the same way, so the fingerprint of
    this identity is the one prepare will give the data (flows/watch_data.py relies on it).
    """
    if synthetic.is_synthetic(source):
        return SyntheticSource(source).identity()
    if image_folder.is_image_folder(source, file_format, exclude):
        return image_folder.folder_listing_identity(source, exclude)
    if source.startswith("file://"):
        source = source.removeprefix("file://")
    if "://" in source:
        files, resolved_format = _list_fsspec(source, file_format)[:2]
    else:
        files, resolved_format = _list_local(source, file_format, exclude)
    return files_identity(resolved_format, files)


def _open_local(source: str, file_format: str, exclude: Path | None = None) -> FileSource:
    files, resolved_format = _list_local(source, file_format, exclude)
    return FileSource(source, files, resolved_format, describe=_local_file)


def _list_local(source: str, file_format: str, exclude: Path | None = None) -> tuple[list[SourceFile], str]:
    path = Path(source).expanduser()
    if any(char in source for char in _GLOB_CHARS):
        candidates = [Path(match) for match in glob.glob(str(path), recursive=True)]
        candidates = [match for match in candidates if match.is_file() and not _inside(match, exclude)]
        if not candidates:
            raise DataError(f"data.source {source!r}: the glob matches no files")
    elif path.is_dir():
        # Hidden and _-prefixed directories (.tmp-*, _temporary/) hold no data of the source.
        candidates = [
            match
            for match in path.rglob("*")
            if match.is_file()
            and not _inside(match, exclude)
            and not any(part.startswith((".", "_")) for part in match.relative_to(path).parts[:-1])
        ]
    elif path.is_file():
        candidates = [path]
    else:
        raise DataError(f"data.source {source!r}: no such file or directory")
    explicit = path.is_file() and not any(char in source for char in _GLOB_CHARS)
    chosen, resolved_format = _choose_files([str(match) for match in candidates], file_format, source, explicit)
    return [_local_file(str(Path(name).resolve())) for name in chosen], resolved_format


def _local_file(path: str) -> SourceFile:
    stat = os.stat(path)
    return SourceFile(path=path, display=path, size=stat.st_size, version=str(stat.st_mtime_ns))


def _open_fsspec(source: str, file_format: str) -> FileSource:
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    files, resolved_format, fs, protocol = _list_fsspec(source, file_format)

    def describe(name: str) -> SourceFile:
        fs.invalidate_cache(name)
        return _fsspec_file(fs, protocol, name)

    return FileSource(source, files, resolved_format, describe=describe, filesystem=PyFileSystem(FSSpecHandler(fs)))


def _list_fsspec(source: str, file_format: str) -> tuple[list[SourceFile], str, Any, str]:
    """(files, format, the filesystem, its protocol)."""
    import fsspec

    try:
        # A fresh instance: a cached one would keep credentials and endpoints from an earlier environment.
        fs, path = fsspec.core.url_to_fs(source, skip_instance_cache=True)
    except ImportError as error:
        raise DataError(
            f"data.source {source!r}: its filesystem needs a package that is not installed ({error})"
        ) from None
    except ValueError as error:
        raise DataError(f"data.source {source!r}: {error}") from None
    protocol = source.split("://", 1)[0]
    # fsspec caches listings per filesystem instance: a changed object must show its new ETag.
    fs.invalidate_cache()
    try:
        if any(char in path for char in _GLOB_CHARS):
            candidates = [match for match in fs.glob(path) if fs.isfile(match)]
            explicit = False
        elif fs.isdir(path):
            candidates, explicit = fs.find(path), False
        elif fs.isfile(path):
            candidates, explicit = [path], True
        else:
            raise DataError(f"data.source {source!r}: no such file, prefix or bucket")
        chosen, resolved_format = _choose_files(candidates, file_format, source, explicit)
        files = [_fsspec_file(fs, protocol, name) for name in chosen]
    except DataError:
        raise
    except Exception as error:
        raise DataError(f"data.source {source!r}: cannot be listed: {type(error).__name__}: {error}") from None
    return files, resolved_format, fs, protocol


def _inside(path: Path, directory: Path | None) -> bool:
    return directory is not None and path.resolve().is_relative_to(directory)


def _fsspec_file(fs: Any, protocol: str, name: str) -> SourceFile:
    info = fs.info(name)
    version = (
        info.get("ETag")
        or info.get("etag")
        or info.get("md5Hash")
        or info.get("LastModified")
        or info.get("mtime")
        or info.get("last_modified")
        or ""
    )
    return SourceFile(path=name, display=f"{protocol}://{name}", size=int(info.get("size") or 0), version=str(version))


def _choose_files(candidates: list[str], file_format: str, source: str, explicit: bool) -> tuple[list[str], str]:
    """Sorted data files of one format; hidden and ``_SUCCESS``-style files are skipped."""
    candidates = sorted(name for name in candidates if explicit or not os.path.basename(name).startswith((".", "_")))
    if file_format != "auto":
        if not explicit:
            wanted = {suffix for suffix, kind in FORMAT_SUFFIXES.items() if kind == file_format}
            typed = [name for name in candidates if _suffix(name) in wanted]
            candidates = typed or candidates
        if not candidates:
            raise DataError(f"data.source {source!r}: holds no {file_format} files")
        return candidates, file_format
    kinds = {name: FORMAT_SUFFIXES.get(_suffix(name)) for name in candidates}
    if explicit and kinds[candidates[0]] is None:
        raise DataError(
            f"data.source {source!r}: cannot tell the format from the file name; set data.format to parquet or csv"
        )
    chosen = [name for name in candidates if kinds[name]]
    if not chosen:
        raise DataError(f"data.source {source!r}: holds no .parquet or .csv files")
    found = sorted({kinds[name] for name in chosen})
    if len(found) > 1:
        raise DataError(
            f"data.source {source!r}: mixes {' and '.join(found)} files; point it at one format or set data.format"
        )
    return chosen, found[0]


def _suffix(name: str) -> str:
    return os.path.splitext(name)[1].lower()


def _unify_schemas(schemas: dict[str, pa.Schema]) -> pa.Schema:
    """One schema for all files, or a DataError naming the files and columns that disagree."""
    (first_file, first), *others = schemas.items()
    for other_file, other in others:
        missing = [name for name in first.names if name not in other.names]
        extra = [name for name in other.names if name not in first.names]
        if missing or extra:
            raise DataError(
                f"schemas disagree: {other_file} "
                + (f"lacks columns {missing} " if missing else "")
                + (f"has extra columns {extra} " if extra else "")
                + f"compared with {first_file}"
            )
    fields = []
    for name in first.names:
        types = {file: schema.field(name).type for file, schema in schemas.items()}
        fields.append(pa.field(name, _common_type(name, types)))
    return pa.schema(fields)


def _common_type(column: str, types: dict[str, pa.DataType]) -> pa.DataType:
    known = {file: kind for file, kind in types.items() if not pa.types.is_null(kind)}
    distinct = set(known.values())
    if len(distinct) <= 1:
        return distinct.pop() if distinct else pa.null()
    if all(pa.types.is_integer(kind) for kind in distinct):
        return pa.int64()
    if all(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind) for kind in distinct):
        return pa.float64()
    if all(is_text(kind) for kind in distinct):
        return pa.string()
    (file_a, type_a), (file_b, type_b) = next((a, b) for a in known.items() for b in known.items() if a[1] != b[1])
    raise DataError(f"schemas disagree: column {column!r} is {type_a} in {file_a} but {type_b} in {file_b}")
