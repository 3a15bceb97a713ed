"""The ``image`` input kind: encoded images (png, jpeg, webp, bmp, gif) kept as their original bytes.

    data.inputs: {photo: {kind: image, size: 224}}     # a binary column, or Hugging Face's {bytes, path} struct

Prepare (``valid``, ``observe``, ``fit``): every image must decode with Pillow (truncated files are errors:
``ImageFile.LOAD_TRUNCATED_IMAGES`` stays off) and be of a mode it can convert (``SUPPORTED_MODES``); the
train split gives the per-channel mean and std (of pixels scaled to [0, 1]) and, when every train image
shares one size and ``size`` is not given, that size. The shards keep the bytes as they came (never
re-encoded); the fitted state goes to encoders.json like every codec's.

On the ranks (``collate``, inside the DataLoader's workers): decode, convert to RGB (or L), then
- train with ``augment: crop_flip`` (the default): a random resized crop (scale 0.08-1 of the area, aspect
  ratio 3/4-4/3, torchvision's RandomResizedCrop rule) resized to ``size``, and a horizontal flip with p 0.5.
  The draws come from a generator seeded by (train.seed, epoch, row) alone (training/core/rng.py: ``row_seed``),
  so a row gets the same view at any world size, with any number of workers, and after a resume;
- evaluation, serving, and train with ``augment: none``: resize so the image covers ``size`` keeping its
  aspect ratio, then a centre crop of ``size`` (one resize of the centre box: the same pixels);
then ``(x / 255 - mean) / std`` into float32 ``[B, C, H, W]`` (the layout torchvision models take).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from training.core.errors import DataError
from training.kinds.base import PICTURES, PIXELS, Codec
from training.kinds.stats import RunningHistogram, merge_histograms

# Pillow modes an image may have: each converts to RGB and L without losing its meaning. 16/32-bit integer
# and float modes (I, I;16, F) do not: their range is not 0-255, so a conversion would clip them.
SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"})
CROP_SCALE = (0.08, 1.0)  # torchvision's RandomResizedCrop defaults
CROP_RATIO = (3 / 4, 4 / 3)
CROP_ATTEMPTS = 10
DRIFT_MEASURES = ("width", "height", "brightness")  # an image's histograms in its drift statistics


class ImageOptions(BaseModel):
    """An image input's options in ``data.inputs`` (``ImageCodec.options_from`` checks them; None: not given,
    the codec fills the default, some learnt from the train split)."""

    model_config = ConfigDict(extra="forbid")

    size: int | tuple[int, int] | None = Field(None, description="image: [h, w] (or one number) the model sees.")
    channels: Literal[1, 3] | None = Field(None, description="image: 3 (RGB, default) or 1 (grey).")
    mean: list[float] | None = Field(None, description="image: per channel; default: the train split's.")
    std: list[float] | None = Field(None, description="image: per channel; default: the train split's.")
    augment: Literal["crop_flip", "none"] | None = Field(
        None, description="image: crop_flip (default: random resized crop + horizontal flip) or none."
    )


IMAGE_OPTIONS = tuple(ImageOptions.model_fields)


class ImageCodec(Codec):
    kind = "image"
    option_names = IMAGE_OPTIONS
    model_block = PIXELS
    drift_measure = "histograms"  # width, height, mean brightness (``drift_stats``)
    shown_as = PICTURES
    dtype = "float32"
    ragged_dtype = "uint8"  # the node cache keeps the encoded bytes: one ragged section
    default_model, default_model_rank = "image_cnn", 0  # a small residual CNN, the tabular inputs beside it
    decodes_in_workers = True  # JPEG/PNG decoding, resizing and augmenting per batch
    takes_what = "encoded image bytes (binary, or a {bytes, path} struct)"

    @staticmethod
    def takes(kind: pa.DataType) -> bool:
        return is_image_column(kind)

    def __init__(self, name: str, options: dict[str, Any] | None = None):
        options = dict(options or {})
        options.setdefault("channels", 3)
        options.setdefault("augment", "crop_flip")
        if options.get("size") is not None:
            options["size"] = _size(options["size"], name)
        super().__init__(name, options)
        self._sums = np.zeros(self.channels, dtype=np.float64)  # per channel, of pixels in [0, 1]
        self._squares = np.zeros(self.channels, dtype=np.float64)
        self._pixels = 0
        self._sizes: set[tuple[int, int]] = set()  # the train images' (h, w)
        self.drift = RunningHistogram(3)  # width, height, mean brightness of the train images
        self.state: dict[str, Any] = {}
        self.problems: dict[int, str] = {}  # the last read batch's rows that do not decode, and why
        self._rows_before: dict[str, int] = {}  # per source file: rows validated so far

    @classmethod
    def options_from(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The options given, checked (``ImageOptions``: pydantic's ValidationError), in IMAGE_OPTIONS' order: the
        codec fills the defaults it learns from train."""
        typed = ImageOptions.model_validate(super().options_from(given))
        return {name: getattr(typed, name) for name in IMAGE_OPTIONS if getattr(typed, name) is not None}

    @classmethod
    def shown_values(cls, array: pa.Array, name: str) -> list[Any]:
        return image_bytes(array, name).to_pylist()

    @property
    def channels(self) -> int:
        return int(self.options["channels"])

    @property
    def mode(self) -> str:
        return "RGB" if self.channels == 3 else "L"

    # ------------------------------------------------------------------ prepare

    def stored_type(self, source_type: pa.DataType) -> pa.DataType:
        return pa.large_binary()

    def stored_values(self, array: pa.Array) -> pa.Array:
        """The encoded bytes: a binary column as it is, a {bytes, path} struct's bytes."""
        return image_bytes(array, self.name)

    def valid(self, array: pa.Array, where: str) -> np.ndarray:
        """Prepare calls this on every read batch in order: ``_rows_before`` makes a row number the file's."""
        first_row = self._rows_before.get(where, 0)
        self._rows_before[where] = first_row + len(array)
        self.problems = _problems(array, where, self.name, first_row)
        ok = np.ones(len(array), dtype=bool)
        ok[list(self.problems)] = False
        return ok

    def invalid_error(self, where: str, array: pa.Array, ok: np.ndarray) -> DataError | None:
        if ok.all():
            return None
        first = min(self.problems)
        return DataError(
            f"{self.problems[first]}; {int((~ok).sum())} image(s) of column {self.name!r} in this read batch do "
            "not decode: fix or remove them, or set data.on_invalid=drop to drop them"
        )

    def observe(self, array: pa.Array) -> None:
        measures = []
        for image, stat in self._stats(array):
            self._sums += np.asarray(stat.sum, dtype=np.float64) / 255
            self._squares += np.asarray(stat.sum2, dtype=np.float64) / 255**2
            self._pixels += image.width * image.height
            self._sizes.add((image.height, image.width))
            measures.append(_drift_measures(image, stat))
        if measures:
            self.drift.update(np.array(measures, dtype=np.float32).T)

    def _stats(self, array: pa.Array):
        """(image converted to the input's mode, its ImageStat) per row."""
        from PIL import ImageStat

        for data in image_bytes(array, self.name).to_pylist():
            with _open(data) as image:
                image = image.convert(self.mode)
                yield image, ImageStat.Stat(image)

    def fit(self) -> dict[str, Any]:
        if self.state:
            return self.state
        size = self.options.get("size")
        if size is None:
            if len(self._sizes) != 1:
                raise DataError(
                    f"image input {self.name!r}: the train images have {len(self._sizes)} sizes "
                    f"(e.g. {sorted(self._sizes)[:3]} as [h, w]); set data.inputs.{self.name}.size"
                )
            size = list(next(iter(self._sizes)))
        mean = self.options.get("mean") or (self._sums / max(self._pixels, 1)).tolist()
        if self.options.get("std"):
            std = self.options["std"]
        else:
            variance = self._squares / max(self._pixels, 1) - np.square(self._sums / max(self._pixels, 1))
            std = [float(s) if s > 1e-6 else 1.0 for s in np.sqrt(np.maximum(variance, 0.0))]
        for what, values in (("mean", mean), ("std", std)):
            if len(values) != self.channels:
                raise DataError(
                    f"data.inputs.{self.name}.{what} has {len(values)} values; the image has {self.channels} channels"
                )
        if any(s <= 0 for s in std):
            raise DataError(f"data.inputs.{self.name}.std must be positive, not {std}")
        self.state = {
            "size": [int(size[0]), int(size[1])],
            "channels": self.channels,
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
            "augment": self.options["augment"],
        }
        return self.state

    def load(self, state: dict[str, Any]) -> None:
        self.state = dict(state)
        self.options["channels"] = int(state["channels"])

    def shape(self) -> tuple[int, ...]:
        height, width = self.state["size"]
        return (self.channels, int(height), int(width))

    def drift_stats(self) -> dict[str, Any]:
        """What drift compares (ddpflow/drift/kinds.py): train histograms of width, height and mean brightness."""
        width, height, brightness = self.drift.to_list()
        return {"kind": "image", "width": width, "height": height, "brightness": brightness}

    def scored_drift_stats(self, array: pa.Array) -> dict[str, Any]:
        """The rows' width, height and mean brightness histograms, as ``drift_stats`` holds the train split's
        (each image decoded once more: the scoring's own decode is inside the model's batch)."""
        histograms = RunningHistogram(3)
        measures = [_drift_measures(image, stat) for image, stat in self._stats(array)]
        if measures:
            histograms.update(np.array(measures, dtype=np.float32).T)
        width, height, brightness = histograms.to_list()
        return {"kind": self.kind, "width": width, "height": height, "brightness": brightness}

    @classmethod
    def merge_drift_stats(cls, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        return {"kind": cls.kind, **{name: merge_histograms(first[name], second[name]) for name in DRIFT_MEASURES}}

    # ------------------------------------------------------------------ ranks, evaluation, serving

    def encode_ragged(self, array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(the bytes of every row, flat uint8; each row's length, int64): the images as they were stored."""
        array = pc.cast(image_bytes(array, self.name), pa.large_binary())
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        if array.null_count:
            row = int(np.flatnonzero(pc.is_null(array).to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"image input {self.name!r}: row {row} is null")
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset : array.offset + len(array) + 1]
        data = array.buffers()[2]
        values = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
        return values[offsets[0] : offsets[-1]].copy(), np.diff(offsets).astype(np.int64)

    def collate(self, values, offsets, context) -> dict[str, Any]:
        """The rows' images as float32 [B, C, H, W]: decoded, augmented (train) or centre-cropped, normalised."""
        import torch

        from training.core.rng import row_seed

        height, width = self.state["size"]
        augment = context.train and self.state["augment"] == "crop_flip"
        out = torch.empty((len(offsets) - 1, self.channels, height, width), dtype=torch.float32)
        data, bounds = values.numpy(), offsets.tolist()
        for i in range(len(bounds) - 1):
            image = self._decoded(data[bounds[i] : bounds[i + 1]].tobytes(), context, i)
            if augment:
                generator = torch.Generator().manual_seed(row_seed(context.seed, context.epoch, int(context.rows[i])))
                box, flip = random_view(image.width, image.height, generator)
            else:
                box, flip = centre_box(image.width, image.height, width / height), False
            view = image.resize((width, height), _bilinear(), box=box)
            pixels = torch.frombuffer(bytearray(view.tobytes()), dtype=torch.uint8)
            pixels = pixels.view(height, width, self.channels).permute(2, 0, 1)
            out[i] = pixels.flip(-1) if flip else pixels
        mean = torch.tensor(self.state["mean"], dtype=torch.float32).view(1, -1, 1, 1) * 255
        std = torch.tensor(self.state["std"], dtype=torch.float32).view(1, -1, 1, 1) * 255
        return {self.name: out.sub_(mean).div_(std)}

    def _decoded(self, data: bytes, context, i: int):
        """One row's image in the codec's mode; a ValueError naming the row when it does not decode (a
        served request's bad image: prepare checked every stored one)."""
        try:
            with _open(data) as image:
                return image.convert(self.mode)
        except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError... for a bad file
            row = int(context.rows[i])
            raise ValueError(f"image input {self.name!r}: row {row} does not decode ({type(error).__name__})") from None


def _drift_measures(image, stat) -> tuple[int, int, float]:
    """An image's drift measures (``DRIFT_MEASURES``): width, height, mean brightness in [0, 1]."""
    return image.width, image.height, float(np.mean(stat.mean)) / 255


def random_view(width: int, height: int, generator) -> tuple[tuple[float, float, float, float], bool]:
    """(the crop box (left, upper, right, lower), flip) of a random resized crop, torchvision's rule:
    up to 10 tries of an area share in CROP_SCALE and a log-uniform aspect ratio in CROP_RATIO, else the
    centre crop of the nearest allowed ratio. Every draw comes from ``generator``."""
    import torch

    area = width * height
    log_low, log_high = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    draws = torch.rand(CROP_ATTEMPTS * 4 + 1, generator=generator, dtype=torch.float64).tolist()
    flip = draws[-1] < 0.5
    for attempt in range(CROP_ATTEMPTS):
        share, log_ratio, across, down = draws[attempt * 4 : attempt * 4 + 4]
        target = area * (CROP_SCALE[0] + share * (CROP_SCALE[1] - CROP_SCALE[0]))
        ratio = math.exp(log_low + log_ratio * (log_high - log_low))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = math.floor(across * (width - w + 1)), math.floor(down * (height - h + 1))
            return (left, top, left + w, top + h), flip
    ratio = min(max(width / height, CROP_RATIO[0]), CROP_RATIO[1])
    return centre_box(width, height, ratio), flip


def centre_box(width: int, height: int, ratio: float) -> tuple[float, float, float, float]:
    """The largest centred box of aspect ratio ``ratio`` (w / h): resizing it is resize-then-centre-crop."""
    if width / height > ratio:
        w, h = height * ratio, float(height)
    else:
        w, h = float(width), width / ratio
    left, top = (width - w) / 2, (height - h) / 2
    return (left, top, left + w, top + h)


def image_bytes(array: pa.Array, name: str) -> pa.Array:
    """A column of encoded images as binary: binary as it is, a {bytes, path} struct's ``bytes`` field,
    strings as base64 (what JSON over HTTP carries to a served model)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    kind = array.type
    if pa.types.is_struct(kind):
        if kind.get_field_index("bytes") < 0:
            raise ValueError(f"image input {name!r}: a struct column needs a 'bytes' field, like {{bytes, path}}")
        return pc.struct_field(array, "bytes")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return array
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return pa.array([_from_base64(text, name, row) for row, text in enumerate(array.to_pylist())], pa.binary())
    raise ValueError(f"image input {name!r} has type {kind}; an image is binary, {{bytes, path}} or base64 text")


def is_image_column(kind: pa.DataType) -> bool:
    """The column types the image kind takes (``ImageCodec.takes``)."""
    if pa.types.is_struct(kind):
        return kind.get_field_index("bytes") >= 0 and pa.types.is_binary(kind.field("bytes").type)
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _from_base64(text: str | None, name: str, row: int) -> bytes | None:
    if text is None:
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"image input {name!r}: row {row} is a string but not base64") from None


def _open(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _bilinear():
    from PIL import Image

    return Image.Resampling.BILINEAR


def _problems(array: pa.Array, where: str, name: str, first_row: int) -> dict[int, str]:
    """Row -> why it cannot be used (null, does not decode, unsupported mode); the message names the file
    when the column says it (a {bytes, path} struct, an image folder), else the row of ``where``."""
    import warnings

    from PIL import Image

    paths = _paths(array)
    problems = {}
    for row, data in enumerate(image_bytes(array, name).to_pylist()):
        place = f"{paths[row]}" if paths and paths[row] else f"{where}: column {name!r} row {first_row + row}"
        if data is None:
            problems[row] = f"{place}: no image (null)"
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with _open(data) as image:
                    image.load()  # a full decode: a truncated file raises here
                    mode = image.mode
        except Exception as error:  # Pillow raises many types for a bad file (OSError, SyntaxError, ...)
            problems[row] = f"{place}: does not decode as an image ({type(error).__name__}: {error})"
            continue
        if mode not in SUPPORTED_MODES:
            problems[row] = f"{place}: image mode {mode!r} is not supported (supported: {sorted(SUPPORTED_MODES)})"
    return problems


def _paths(array: pa.Array) -> list[str | None] | None:
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if pa.types.is_struct(array.type) and array.type.get_field_index("path") >= 0:
        return pc.struct_field(array, "path").to_pylist()
    return None


def _size(value: Any, name: str) -> list[int]:
    size = [int(value), int(value)] if isinstance(value, int | float) else [int(v) for v in value]
    if len(size) != 2 or min(size) < 1:
        raise DataError(f"data.inputs.{name}.size must be one positive number or [h, w], not {value!r}")
    return size
