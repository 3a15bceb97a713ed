"""Images: ddpflow's image loader and step ÷ plain PyTorch over the same encoded bytes.

- **Training images/s**: ``TrainBatches`` (the node-cache bytes, the codec's collate in ``k`` persistent
  workers) feeding the built-in CNN and AdamW, ÷ the reference: a ``Dataset`` over the same PNG bytes,
  decoded with Pillow, the same transforms (the codec's random resized crop and flip, resize, normalise),
  ``DataLoader(num_workers=k, persistent_workers=True, pin_memory=True)``, the same model and optimizer.
- **Decode throughput**: the loader alone (no step) ÷ Pillow decoding the same bytes in ``k`` processes.

The images are drawn here with Pillow (shapes on noise, PNG); nothing is downloaded.
"""

from __future__ import annotations

import io
from pathlib import Path

from bench.harness import Result, Row, Stats, Timer, log, turns
from bench.workload import Context, set_threads

SIZE, CLASSES, BATCH = 64, 4, 64
ROWS = {"quick": 256, "full": 4096}


def _drawn(seed: int, label: int, size: int = SIZE, format: str = "PNG") -> bytes:
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

    from training.config import load_config
    from training.data.prepare import prepare_dataset

    rows = rows or ROWS["quick" if ctx.quick else "full"]
    drawn_px = drawn_px or size
    name = f"photos-{rows}-{size}-{distinct}" + ("" if (drawn_px, format) == (size, "PNG") else f"-{drawn_px}-{format}")
    source = ctx.workdir / "images" / f"{name}.parquet"
    source.parent.mkdir(parents=True, exist_ok=True)
    labels = [i % CLASSES for i in range(rows)]
    # distinct is a multiple of CLASSES
    drawn = [_drawn(i, i % CLASSES, drawn_px, format) for i in range(distinct or rows)]
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
    return prepare_dataset(load_config(None, overrides).data).dataset_dir


class ReferenceDataset:
    """The plain way: one row per item, its PNG bytes decoded with Pillow and transformed by the same codec
    functions (per-row generator, as ddpflow's), stacked by the default collate."""

    def __init__(self, values, offsets, labels, codec, epoch: int = 0):
        self.values, self.offsets, self.labels, self.codec, self.epoch = values, offsets, labels, codec, epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, row: int):
        import torch

        from training.data.ragged import BatchContext

        start, stop = int(self.offsets[row]), int(self.offsets[row + 1])
        offsets = torch.tensor([0, stop - start])
        image = self.codec.collate(
            self.values[start:stop], offsets, BatchContext(torch.tensor([row]), self.epoch, 0, True)
        )
        return image[self.codec.name][0], self.labels[row]


def run(ctx: Context) -> list[Result]:
    import torch
    from torch.utils.data import DataLoader

    from bench import ddpflow_api
    from training.data.manifest import read_manifest
    from training.loading import TrainBatches
    from training.models import ModelSpec, build_model
    from training.spec.inputs import inputs_from_manifest

    set_threads(ctx.threads)
    dataset = prepared(ctx)
    manifest = read_manifest(dataset)
    split = ddpflow_api.load_split(dataset, "train")
    codec = split.collators["photo"].__self__
    ragged = split.inputs["photo"]
    workers = 1 if ctx.quick else 2

    def model_and_optimizer():
        torch.manual_seed(0)
        model = build_model(ModelSpec.for_inputs("auto", inputs_from_manifest(manifest), CLASSES, {"width": 16}))
        return model, torch.optim.AdamW(model.parameters(), 1e-3)

    ours = TrainBatches(split, 0, 1, BATCH, 0, torch.device("cpu"), False, num_workers=workers)
    reference_set = ReferenceDataset(ragged.values, ragged.offsets, split.labels, codec)
    reference = DataLoader(
        reference_set,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,
        pin_memory=torch.cuda.is_available(),
    )

    def train_ddpflow(epoch: int, step: bool) -> int:
        seen = 0
        for batch in ours.epoch(epoch):
            if step:
                loss = torch.nn.functional.cross_entropy(model(batch.inputs), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seen += batch.samples
        return seen

    def train_reference(epoch: int, step: bool) -> int:
        seen = 0
        for images, labels in reference:
            if step:
                loss = torch.nn.functional.cross_entropy(model({"photo": images}), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            seen += len(labels)
        return seen

    rates: dict[str, list[float]] = {
        name: [] for name in ("ddpflow", "reference", "ddpflow_decode", "reference_decode")
    }
    model, optimizer = model_and_optimizer()
    train_ddpflow(0, False), train_reference(0, False)  # start the persistent workers
    for repeat in range(ctx.sizes.repeats):
        for name, feed in turns([("ddpflow", train_ddpflow), ("reference", train_reference)], repeat):
            for step in (True, False):
                with Timer() as timer:
                    seen = feed(repeat + 1, step)
                rates[name if step else f"{name}_decode"].append(seen / timer.seconds)
        log(f"images repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} images/s" for k, v in rates.items()))
    train_ratio = Stats.of(a / b for a, b in zip(rates["ddpflow"], rates["reference"]))
    decode_ratio = Stats.of(a / b for a, b in zip(rates["ddpflow_decode"], rates["reference_decode"]))
    note = (
        f"{len(split):,} train PNGs of {SIZE}x{SIZE}, batch {BATCH}, {workers} persistent worker(s) each side, "
        f"built-in CNN width 16, {ctx.threads} torch thread(s)."
    )
    from bench import image_workers

    return [
        Result(
            name="images_train", title="Images: training", ratio=train_ratio, target=1.0,
            ratio_label="ddpflow images/s (loader + step) ÷ a plain Dataset + DataLoader over the same bytes",
            rows=[Row("ddpflow: TrainBatches + step", Stats.of(rates["ddpflow"]), "images/s", train_ratio),
                  Row("reference: Dataset + DataLoader + step", Stats.of(rates["reference"]), "images/s")],
            notes=[note],
        ),
        Result(
            name="images_decode", title="Images: decode", ratio=decode_ratio, target=0.9,
            ratio_label="ddpflow's loader alone ÷ the reference DataLoader alone (Pillow, as many processes)",
            rows=[Row("ddpflow: TrainBatches", Stats.of(rates["ddpflow_decode"]), "images/s", decode_ratio),
                  Row("reference: Dataset + DataLoader", Stats.of(rates["reference_decode"]), "images/s")],
            notes=[note],
        ),
        *image_workers.run(ctx, dataset),  # the worker core rule, on the same PNGs
    ]  # fmt: skip
