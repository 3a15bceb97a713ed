"""The image workload: PNGs (or JPEGs) drawn with Pillow, shapes on noise, one shape per class, in a Parquet
source prepared by ddpflow as an image input ``photo``. Nothing is downloaded. Used by the images family (the
loader, the worker core rule) and the memory family (a rank's anonymous memory with an image column)."""

from __future__ import annotations

import io
from pathlib import Path

from bench import ddpflow_api
from bench.harness.context import Context

SIZE, CLASSES = 64, 4
ROWS = {"quick": 256, "full": 4096}


def drawn_image(seed: int, label: int, size: int = SIZE, format: str = "PNG") -> bytes:
    """A ``size`` x ``size`` PNG (or ``format``: JPEG): a bright shape (one per class) at a random place on dark
    noise."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 90, size=(size, size, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    left, top = (int(v) for v in rng.integers(0, size // 2, size=2))
    box = [left, top, left + size // 3, top + size // 3]
    colour = tuple(int(v) for v in rng.integers(150, 256, size=3))
    if label == 0:
        draw.ellipse(box, fill=colour)
    elif label == 1:
        draw.rectangle(box, fill=colour)
    elif label == 2:
        draw.pieslice(box, 0, 200, fill=colour)
    else:
        draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=colour)
    out = io.BytesIO()
    image.save(out, format=format, **({"quality": 90} if format == "JPEG" else {}))
    return out.getvalue()


def prepared(
    ctx: Context, rows: int | None = None, size: int = SIZE, distinct: int | None = None, drawn_px: int | None = None,
    format: str = "PNG",
) -> Path:  # fmt: skip
    """A prepared dataset of ``rows`` PNGs of ``size`` x ``size`` (default: ROWS for the run's mode, SIZE), in an
    image input ``photo``; with ``distinct``, row i holds the i % distinct-th of that many drawn images (a split
    of many rows without drawing each); with ``drawn_px``, the images are drawn that large (in ``format``) and the
    codec resizes them to ``size``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = rows or ROWS["quick" if ctx.quick else "full"]
    drawn_px = drawn_px or size
    name = f"photos-{rows}-{size}-{distinct}" + ("" if (drawn_px, format) == (size, "PNG") else f"-{drawn_px}-{format}")
    source = ctx.workdir / "images" / f"{name}.parquet"
    source.parent.mkdir(parents=True, exist_ok=True)
    labels = [i % CLASSES for i in range(rows)]
    # distinct is a multiple of CLASSES
    drawn = [drawn_image(i, i % CLASSES, drawn_px, format) for i in range(distinct or rows)]
    pq.write_table(
        pa.table(
            {
                "id": list(range(rows)),
                "photo": pa.array([drawn[i % len(drawn)] for i in range(rows)], pa.binary()),
                "label": labels,
            }
        ),
        source,
    )
    overrides = [
        f"data.source={source}",
        f"data.root={ctx.workdir / 'images' / name}",
        "data.key=id",
        f'data.inputs={{"photo": {{"kind": "image", "size": {size}}}}}',
        "data.val_fraction=0.05",
        "data.test_fraction=0.05",
    ]
    return ddpflow_api.prepare(ddpflow_api.data_config_from_overrides(overrides))
