"""Tiny image data sets drawn with Pillow for the image tests: shapes on a noisy background, nothing downloaded.

write_image_folder(tmp_path / "shapes")          # root/<circle|square|triangle>/<n>.png, 16x16
image_table(rows=60)                             # a Parquet-ready table: photo (binary png), shape, colour
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")


def draw_shape(shape: str, seed: int, size: int = 16, fmt: str = "PNG") -> bytes:
    """One ``size`` x ``size`` image of ``shape`` in a random colour and place, encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    background = tuple(int(v) for v in rng.integers(0, 80, size=3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    colour = tuple(int(v) for v in rng.integers(150, 256, size=3))
    half = int(rng.integers(size // 4, size // 2 - 1))
    cx, cy = (int(v) for v in rng.integers(half, size - half, size=2))
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=colour)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def write_image_folder(root: Path, per_class: int = 20, size: int = 16, fmt: str = "PNG") -> Path:
    """root/<shape>/<n>.<fmt>: ``per_class`` images of each of SHAPES."""
    suffix = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "BMP": "bmp", "GIF": "gif"}[fmt]
    for k, shape in enumerate(SHAPES):
        folder = root / shape
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            (folder / f"{n:03d}.{suffix}").write_bytes(draw_shape(shape, 1000 * k + n, size, fmt))
    return root


def image_table(rows: int = 60, size: int = 16, struct: bool = False) -> pa.Table:
    """``photo`` (png bytes, or Hugging Face's {bytes, path} struct), ``colour`` (a categorical that says
    nothing), ``id`` and the label ``shape``."""
    shapes = [SHAPES[i % len(SHAPES)] for i in range(rows)]
    images = [draw_shape(shape, i, size) for i, shape in enumerate(shapes)]
    photo = pa.array(images, pa.binary())
    if struct:
        paths = pa.array([f"img/{i}.png" for i in range(rows)], pa.string())
        photo = pa.StructArray.from_arrays([photo, paths], names=["bytes", "path"])
    return pa.table(
        {
            "id": np.arange(rows),
            "photo": photo,
            "colour": pa.array(["red", "blue"] * (rows // 2) + ["red"] * (rows % 2)),
            "shape": shapes,
        }
    )
