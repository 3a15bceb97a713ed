"""Images at prepare and in the codec: an image folder and a Parquet column as sources, the bytes kept as they
are, the decode check naming the file or row, the fitted state, the train and evaluation views
(training/kinds/image.py, training/prepare/image_folder.py)."""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from image_data import SHAPES, draw_shape, image_table, write_image_folder
from PIL import Image

from training.kinds.inputs import InputInfo
from training.kinds.ragged import BatchContext
from training.kinds.registry import ENCODERS_FILE, codecs_from_states, collate_encoded, make_codec
from training.models.registry import ModelSpec, build_model
from training.prepare.dataset import DataError, fingerprint_from_listing, prepare_dataset


def shard_table(prepared, split: str) -> pa.Table:
    return pa.concat_tables(
        pq.read_table(prepared.dataset_dir / shard.file) for shard in prepared.manifest.splits[split].shards
    )


def Context(rows, epoch=0, seed=0, train=True) -> BatchContext:  # noqa: N802 (reads as the class it builds)
    return BatchContext(torch.as_tensor(list(rows), dtype=torch.int64), epoch, seed, train)


def packed(images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.zeros(len(images) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(image) for image in images]), 0)
    return torch.frombuffer(bytearray(b"".join(images)), dtype=torch.uint8), offsets


def test_an_image_folder_keeps_its_bytes_keys_by_path_and_fingerprints_its_listing(tmp_path, make_config):
    root = write_image_folder(tmp_path / "shapes", per_class=12)
    config = make_config(root)
    prepared = prepare_dataset(config)
    manifest = prepared.manifest
    assert manifest.key == "path" and manifest.label_mapping == sorted(SHAPES)
    assert [entry["kind"] for entry in manifest.inputs] == ["image"]
    assert sum(manifest.rows(split) for split in ("train", "val", "test")) == 36
    table = shard_table(prepared, "train")
    assert table.schema.names == ["image", "label", "path"]
    for row in table.slice(0, 5).to_pylist():  # the original bytes, never re-encoded
        assert row["image"] == (root / row["path"]).read_bytes()
        assert manifest.label_mapping[row["label"]] == row["path"].split("/")[0]
    state = json.loads((prepared.dataset_dir / ENCODERS_FILE).read_text())["image"]["state"]
    assert state["size"] == [16, 16] and len(state["mean"]) == len(state["std"]) == 3
    assert 0.2 < state["mean"][0] < 0.7 and 0.1 < state["std"][0] < 0.5
    drift = manifest.extra["drift_stats"]["inputs"]["image"]
    assert drift["kind"] == "image" and drift["width"]["min"] == drift["width"]["max"] == 16
    # The fingerprint comes from the listing: a watcher's look agrees, and touching one file changes it.
    assert fingerprint_from_listing(config)[1] == prepared.fingerprint
    assert prepare_dataset(config).cache_hit
    os.utime(root / "circle" / "000.png", ns=(1, 1))
    assert fingerprint_from_listing(config)[1] != prepared.fingerprint


def test_a_parquet_binary_or_struct_column_is_an_image_input(tmp_path, table_file, make_config):
    for struct in (False, True):
        table = image_table(60, struct=struct)
        path = table_file(table, name=f"images-{struct}.parquet")
        inputs = {"photo": {"kind": "image", "size": [12, 10], "augment": "none"}, "colour": "categorical"}
        prepared = prepare_dataset(make_config(path, label="shape", key="id", inputs=inputs))
        stored = shard_table(prepared, "train")
        assert stored.schema.field("photo").type == pa.large_binary()
        originals = dict(zip(table["id"].to_pylist(), image_table(60)["photo"].to_pylist(), strict=True))
        assert all(originals[row["id"]] == row["photo"] for row in stored.to_pylist())
        assert prepared.manifest.inputs[0]["shape"] == [3, 12, 10]


def test_a_corrupt_image_is_named_then_dropped_and_counted(tmp_path, table_file, make_config):
    root = write_image_folder(tmp_path / "shapes", per_class=6)
    bad = root / "square" / "003.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated: Pillow's full decode fails
    with pytest.raises(DataError, match=r"square/003\.png.*does not decode.*on_invalid=drop"):
        prepare_dataset(make_config(root))
    prepared = prepare_dataset(make_config(root, on_invalid="drop"))
    assert prepared.manifest.dropped_rows == 1 and prepared.summary()["dropped_rows"] == 1
    assert sum(prepared.manifest.rows(split) for split in ("train", "val", "test")) == 17
    # A Parquet column: the error names the file and the row (of the file, across its read batches).
    table = image_table(30)
    photos = table["photo"].to_pylist()
    photos[25] = b"not an image"
    path = table_file(table.set_column(1, "photo", pa.array(photos, pa.binary())))
    config = make_config(path, label="shape", key="id", inputs={"photo": "image"}, read_batch_rows=10)
    with pytest.raises(DataError, match=rf"{path}: column 'photo' row 25: does not decode"):
        prepare_dataset(config)


def test_unsupported_modes_and_mixed_sizes_are_refused_by_name(tmp_path, table_file, make_config):
    deep = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint16) + 300).save(deep, format="PNG")  # mode I;16
    table = image_table(20)
    photos = table["photo"].to_pylist()
    photos[3] = deep.getvalue()
    path = table_file(table.set_column(1, "photo", pa.array(photos, pa.binary())), name="deep.parquet")
    with pytest.raises(DataError, match=r"row 3: image mode 'I;16' is not supported"):
        prepare_dataset(make_config(path, label="shape", key="id", inputs={"photo": "image"}))
    sizes = [draw_shape("circle", i, size=16 if i % 2 else 20) for i in range(20)]
    mixed = pa.table({"id": np.arange(20), "photo": pa.array(sizes, pa.binary()), "shape": ["a", "b"] * 10})
    with pytest.raises(DataError, match=r"2 sizes .* set data.inputs.photo.size"):
        prepare_dataset(
            make_config(table_file(mixed, name="mixed.parquet"), label="shape", key="id", inputs={"photo": "image"})
        )


def fitted_codec(options: dict) -> object:
    codec = make_codec("photo", "image", options)
    codec.observe(image_table(30)["photo"].combine_chunks())
    return codecs_from_states({"photo": {"kind": "image", "options": codec.options, "state": codec.fit()}})["photo"]


def test_a_rows_view_depends_on_seed_epoch_and_row_only():
    codec = fitted_codec({"size": 16})
    images = image_table(8)["photo"].to_pylist()
    values, offsets = packed(images)
    views = codec.collate(values, offsets, Context(range(8)))["photo"]
    assert views.shape == (8, 3, 16, 16) and views.dtype == torch.float32
    # The same rows in another batch, in another order (another rank, worker or batch size): the same views.
    order = [5, 2, 7]
    again = codec.collate(*packed([images[i] for i in order]), Context(order))["photo"]
    assert torch.equal(again, views[order])
    assert not torch.equal(codec.collate(values, offsets, Context(range(8), epoch=1))["photo"], views)
    assert not torch.equal(codec.collate(values, offsets, Context(range(8), seed=1))["photo"], views)
    # Evaluation: no randomness; resize + centre crop of a 16x16 image to 16x16 is the image itself, normalised.
    evaluated = codec.collate(values, offsets, Context(range(8), epoch=3, train=False))["photo"]
    assert torch.equal(evaluated, codec.collate(values, offsets, Context(range(8), seed=9, train=False))["photo"])
    pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(images[0])).convert("RGB"))).permute(2, 0, 1) / 255
    mean, std = (torch.tensor(codec.state[k]).view(3, 1, 1) for k in ("mean", "std"))
    assert torch.allclose(evaluated[0], (pixels - mean) / std, atol=1e-5)
    # augment none: the evaluation view in training too; one channel: grey.
    plain = fitted_codec({"size": 16, "augment": "none"})
    assert torch.equal(plain.collate(values, offsets, Context(range(8)))["photo"], evaluated)
    assert fitted_codec({"size": [8, 12], "channels": 1}).collate(values, offsets, Context(range(8)))[
        "photo"
    ].shape == (8, 1, 8, 12)


def test_serving_takes_bytes_structs_or_base64_alike():
    codec = fitted_codec({"size": 16})
    images = image_table(4)["photo"].to_pylist()

    def encode(array: pa.Array) -> torch.Tensor:  # what evaluation and serving call (encode_columns)
        return collate_encoded(codec, *codec.encode_ragged(array))["photo"]

    as_bytes = encode(pa.array(images, pa.binary()))
    as_text = encode(pa.array([base64.b64encode(image).decode() for image in images]))
    assert as_bytes.shape == (4, 3, 16, 16) and torch.equal(as_bytes, as_text)
    with pytest.raises(ValueError, match="row 1 is a string but not base64"):
        encode(pa.array([base64.b64encode(images[0]).decode(), "%%%"]))
    with pytest.raises(ValueError, match="row 1 does not decode"):
        encode(pa.array([images[0], b"\x89PNG broken"], pa.binary()))


def test_auto_is_a_groupnorm_cnn_that_takes_images_with_tabular_inputs():
    inputs = {
        "photo": InputInfo("photo", "image", "float32", (3, 16, 16)),
        "colour": InputInfo("colour", "categorical", "int64", (), 4),
        "age": InputInfo("age", "numeric", "float32"),
    }
    spec = ModelSpec.for_inputs("auto", inputs, 3, {"width": 8})
    assert spec.model == "image_cnn"
    model = build_model(spec)
    assert not any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules())
    assert any(isinstance(module, torch.nn.GroupNorm) for module in model.modules())
    batch = {"photo": torch.randn(5, 3, 16, 16), "colour": torch.tensor([0, 1, 2, 3, 1]), "age": torch.randn(5)}
    assert model(batch).shape == (5, 3)
    # Each input reaches the output: change one, the logits change.
    for name, other in (("colour", torch.tensor([3, 3, 3, 3, 3])), ("age", torch.randn(5))):
        assert not torch.allclose(model({**batch, name: other}), model(batch))


def test_drift_compares_width_height_and_brightness(tmp_path, make_config):
    from ddpflow.drift.report import compare

    reference = prepare_dataset(make_config(write_image_folder(tmp_path / "a", per_class=10))).manifest
    same = prepare_dataset(make_config(write_image_folder(tmp_path / "b", per_class=10))).manifest
    brighter = write_image_folder(tmp_path / "c", per_class=10, size=20)
    for path in brighter.rglob("*.png"):
        Image.eval(Image.open(path).convert("RGB"), lambda v: min(255, v + 90)).save(path)
    changed = prepare_dataset(make_config(brighter, inputs={"image": {"kind": "image", "size": 16}})).manifest
    unchanged = {drift.feature: drift.psi for drift in compare(reference, same).features}
    assert unchanged == {"image:width": 0.0, "image:height": 0.0, "image:brightness": 0.0}
    drifted = {drift.feature: drift.psi for drift in compare(reference, changed).features}
    assert min(drifted.values()) > 0.25, drifted
