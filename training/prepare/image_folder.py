"""An image folder as a source: ``root/<class name>/<file>``, the usual layout (torchvision's ImageFolder).

    data.source: path/to/root      # data.format auto finds it (image files under subfolders, no table files)

Rows, in sorted path order: ``image`` (a {bytes, path} struct: the file's bytes as they are, and its path, so
prepare's errors name the file), ``label`` (the subfolder's name) and ``path`` (relative to the root: lineage,
error messages, and the default ``data.key``, so an image keeps its split when files are added). The shards
keep the bytes only (training/kinds/image.py). The identity is the listing (names, sizes, modification times),
as for table files: nothing is opened to know whether the folder changed. Batch scoring reads it as it reads
Parquet files (``fragments``, ``scan``): each class folder a file, its images in row groups of GROUP_ROWS.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from training.core.errors import DataError

FORMAT = "images"
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif"})
TABLE_SUFFIXES = frozenset({".parquet", ".pq", ".parq", ".csv"})
BATCH_BYTES = 64 << 20  # a read batch holds at most about this many bytes of images (or data.read_batch_rows)
GROUP_ROWS = 256  # batch scoring reads a class folder in groups of this many images (its ranges gather them)
IMAGE, LABEL, PATH = "image", "label", "path"
SCHEMA = pa.schema(
    [
        pa.field(IMAGE, pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])),
        pa.field(LABEL, pa.string()),
        pa.field(PATH, pa.string()),
    ]
)


def is_image_folder(source: str, file_format: str, exclude: Path | None = None) -> bool:
    """``data.format: images``, or auto on a local directory with image files below it and no table files
    (``exclude``: prepare's own output root, which may sit inside it)."""
    path = Path(source.removeprefix("file://")).expanduser()
    if file_format == FORMAT:
        return True
    if file_format != "auto" or "://" in source.removeprefix("file://") or not path.is_dir():
        return False
    suffixes = {name.suffix.lower() for name in _files(path) if not _inside(name, exclude)}
    return bool(suffixes & IMAGE_SUFFIXES) and not suffixes & TABLE_SUFFIXES


def with_image_folder_defaults(data, identity: dict[str, Any]):
    """An image folder's defaults: ``data.key`` its path, ``data.inputs`` its image (``{image: image}``)."""
    if identity.get("format") != FORMAT:
        return data
    update = {}
    if data.key is None:
        update["key"] = PATH
    if data.inputs is None and data.features is None:
        update["inputs"] = {IMAGE: {"kind": "image"}}
    return data.model_validate({**data.model_dump(), **update}) if update else data


class ImageFolderSource:
    def __init__(self, source: str, exclude: Path | None = None):
        self.root = Path(source.removeprefix("file://")).expanduser().resolve()
        self.description = str(self.root)
        self.schema = SCHEMA
        self.files = list_images(self.root, exclude)

    def identity(self) -> dict[str, Any]:
        return folder_identity(self.root, self.files)

    def changed_files(self) -> list[str]:
        changed = []
        for relative, size, version in self.files:
            try:
                stat = os.stat(self.root / relative)
            except OSError:
                changed.append(str(self.root / relative))
                continue
            if (stat.st_size, str(stat.st_mtime_ns)) != (size, version):
                changed.append(str(self.root / relative))
        return changed

    def iter_batches(self, columns: list[str], batch_rows: int) -> Iterator[tuple[str, pa.RecordBatch]]:
        """Batches of at most ``batch_rows`` images and about BATCH_BYTES; the file named is the root."""
        for batch in self._batches([(relative, size) for relative, size, _ in self.files], columns, batch_rows):
            yield self.description, batch

    def fragments(self) -> list[tuple[ClassFolder, ImageFragment]]:
        """Each class folder as batch scoring's "file", its images in row groups of GROUP_ROWS (the ranges a
        scoring cuts, as a Parquet file's: training/inference/batch_scoring.py), in path order."""
        folders: dict[str, list[tuple[str, int]]] = {}
        for relative, size, _version in self.files:
            folders.setdefault(relative.split("/", 1)[0], []).append((relative, size))
        return [(ClassFolder(str(self.root / name)), ImageFragment(rows)) for name, rows in folders.items()]

    def scan(self, file, fragment: ImageFragment, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """A fragment's images, ``batch_rows`` (and about BATCH_BYTES) at a time."""
        return self._batches(fragment.selected(), columns, batch_rows)

    def _batches(self, files: list[tuple[str, int]], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        rows: list[tuple[str, int]] = []
        held = 0
        for relative, size in files:
            rows.append((relative, size))
            held += size
            if len(rows) >= batch_rows or held >= BATCH_BYTES:
                yield self._batch(rows, columns)
                rows, held = [], 0
        if rows:
            yield self._batch(rows, columns)

    def _batch(self, rows: list[tuple[str, int]], columns: list[str]) -> pa.RecordBatch:
        arrays = {
            LABEL: pa.array([relative.split("/", 1)[0] for relative, _ in rows], pa.string()),
            PATH: pa.array([relative for relative, _ in rows], pa.string()),
        }
        if IMAGE in columns:
            arrays[IMAGE] = pa.StructArray.from_arrays(
                [pa.array([self._read(relative) for relative, _ in rows], pa.binary()), arrays[PATH]],
                fields=list(SCHEMA.field(IMAGE).type),
            )
        return pa.RecordBatch.from_arrays([arrays[name] for name in columns], schema=_schema_of(columns))

    def _read(self, relative: str) -> bytes:
        try:
            return (self.root / relative).read_bytes()
        except OSError as error:
            raise DataError(f"{self.root / relative}: cannot be read: {error}") from None


@dataclass(frozen=True)
class ClassFolder:
    display: str  # what the plan and error messages name


@dataclass(frozen=True)
class ImageGroup:
    id: int
    num_rows: int


class ImageFragment:
    """A class folder's images, (relative path, size) in order, seen as row groups of GROUP_ROWS images: what
    batch scoring's plan cuts into ranges and reads back (``row_groups``, ``subset``), as for a Parquet file."""

    def __init__(self, rows: list[tuple[str, int]], group_ids: list[int] | None = None):
        self.rows = rows
        self.group_ids = list(range(-(-len(rows) // GROUP_ROWS))) if group_ids is None else group_ids

    @property
    def row_groups(self) -> list[ImageGroup]:
        return [ImageGroup(i, len(self.rows[i * GROUP_ROWS : (i + 1) * GROUP_ROWS])) for i in self.group_ids]

    def ensure_complete_metadata(self) -> None:
        """Nothing to read: the listing is the metadata."""

    def subset(self, row_group_ids: list[int]) -> ImageFragment:
        return ImageFragment(self.rows, row_group_ids)

    def selected(self) -> list[tuple[str, int]]:
        return [row for i in self.group_ids for row in self.rows[i * GROUP_ROWS : (i + 1) * GROUP_ROWS]]


def _schema_of(columns: list[str]) -> pa.Schema:
    return pa.schema([SCHEMA.field(name) for name in columns])


def list_images(root: Path, exclude: Path | None = None) -> list[tuple[str, int, str]]:
    """(path relative to the root with / separators, size, mtime_ns) of every image in a class subfolder,
    sorted; hidden and _-prefixed entries are skipped, as for table sources."""
    found = []
    for path in _files(root):
        relative = path.relative_to(root)
        if _inside(path, exclude):
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if len(relative.parts) != 2:
            raise DataError(
                f"{path}: an image folder holds <class>/<file>; this image is "
                + ("directly in the root" if len(relative.parts) == 1 else "nested deeper")
            )
        stat = path.stat()
        found.append((relative.as_posix(), stat.st_size, str(stat.st_mtime_ns)))
    if not found:
        raise DataError(f"data.source {str(root)!r}: holds no images (png, jpeg, webp, bmp, gif) in class folders")
    return sorted(found)


def folder_identity(root: Path, files: list[tuple[str, int, str]]) -> dict[str, Any]:
    """The listing as the fingerprint sees it (training/prepare/sources.py: files_identity's shape)."""
    return {"format": FORMAT, "files": [[str(root / relative), size, version] for relative, size, version in files]}


def folder_listing_identity(source: str, exclude: Path | None = None) -> dict[str, Any]:
    root = Path(source.removeprefix("file://")).expanduser().resolve()
    return folder_identity(root, list_images(root, exclude))


def _inside(path: Path, directory: Path | None) -> bool:
    return directory is not None and path.resolve().is_relative_to(directory)


def _files(root: Path) -> Iterator[Path]:
    for directory, folders, names in os.walk(root):
        folders[:] = sorted(name for name in folders if not name.startswith((".", "_")))
        for name in sorted(names):
            if not name.startswith((".", "_")):
                yield Path(directory) / name
