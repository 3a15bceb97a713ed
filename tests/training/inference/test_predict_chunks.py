"""The Predictor's forward in chunks on a CPU (``CPU_FORWARD_ROWS``) and its Arrow input: neither changes an answer.

A user-shaped table (int64 with nulls, bool, float with nulls, strings, a category never seen in training) is
prepared by the real prepare stage; the model is the built-in mlp for its inputs (numeric embeddings, category
embeddings), seeded weights. The chunked answer is held against ONE forward call on the whole encoded batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training.inference.predict import CPU_FORWARD_ROWS, Predictor

ROWS = 2 * CPU_FORWARD_ROWS + 357  # three calls, the last one short


def user_table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    visits = rng.integers(0, 50, size=rows)
    income = rng.lognormal(10, 1, size=rows)
    plan = rng.choice(["basic", "plus", "pro"], size=rows).astype(object)
    plan[rng.random(rows) < 0.05] = None
    return pa.table(
        {
            "visits": pa.array(visits, pa.int64(), mask=rng.random(rows) < 0.1),
            "member": pa.array(rng.random(rows) < 0.4),
            "income": pa.array(income, mask=rng.random(rows) < 0.1),
            "plan": pa.array(plan, pa.string()),
            "label": pa.array(np.where(visits > 25, "churned", "stayed")),
        }
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    from training.core.config import load_config
    from training.core.manifest import read_manifest
    from training.inference.model_file import inference_checkpoint
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.models.registry import ModelSpec, build_model
    from training.prepare.dataset import prepare_dataset

    root = tmp_path_factory.mktemp("chunks")
    pq.write_table(user_table(600, seed=1), root / "train.parquet")
    inputs = {"visits": "numeric", "member": "numeric", "income": "numeric", "plan": "categorical"}
    overrides = [f"data.source={root / 'train.parquet'}", f"data.root={root / 'shards'}", "data.label=label"]
    data = load_config(None, [*overrides, f"data.inputs={json.dumps(inputs)}"]).data
    dataset = Path(prepare_dataset(data).dataset_dir)
    manifest = read_manifest(dataset)
    spec = ModelSpec.for_inputs("mlp", inputs_from_manifest(manifest), manifest.n_outputs, {"hidden": [64, 64]})
    torch.manual_seed(0)
    model = build_model(spec)
    checkpoint = inference_checkpoint(model.state_dict(), spec, manifest, 0, {}, read_encoders(dataset, manifest))
    torch.save(checkpoint, root / "model.pt")
    return root / "model.pt"


def forward_calls(predictor: Predictor) -> list[int]:
    """The row count of each forward call the predictor makes from now on (a forward hook on its model)."""
    calls: list[int] = []
    predictor.model.register_forward_hook(lambda _m, args, _out: calls.append(len(next(iter(args[0].values())))))
    return calls


def test_a_cpu_forward_is_cut_into_bounded_chunks_that_give_the_one_call_answer(model_path):
    predictor = Predictor.from_checkpoint(model_path, batch_size=65_536)
    raw = user_table(ROWS, seed=2).drop(["label"]).to_pandas()
    with torch.inference_mode():
        whole = predictor.model(predictor.batch_inputs(raw))  # one call on every row: the reference
    calls = forward_calls(predictor)
    chunked = predictor.outputs(raw)
    assert calls == [CPU_FORWARD_ROWS, CPU_FORWARD_ROWS, 357]  # every row once, in order, no chunk over the bound
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)
    assert torch.isfinite(chunked).all()


def test_a_batch_size_under_the_bound_is_the_chunk(model_path):
    predictor = Predictor.from_checkpoint(model_path, batch_size=300)
    calls = forward_calls(predictor)
    predictor.outputs(user_table(ROWS, seed=3).to_pandas())
    assert max(calls) == 300 and sum(calls) == ROWS


def test_an_arrow_batch_scores_as_its_dataframe_does(model_path):
    """Batch scoring hands the ranks' record batches over as they are; the pyfunc gets a DataFrame."""
    predictor = Predictor.from_checkpoint(model_path)
    table = user_table(ROWS, seed=4).drop(["label"])
    batch = table.to_batches(max_chunksize=ROWS)[0]
    from_arrow = predictor.scores(batch, "probabilities")
    from_frame = predictor.scores(table.to_pandas(), "probabilities")
    assert list(from_arrow.columns) == ["label", "probability_churned", "probability_stayed"]
    np.testing.assert_array_equal(from_arrow["label"].to_numpy(), from_frame["label"].to_numpy())
    for column in ("probability_churned", "probability_stayed"):
        np.testing.assert_allclose(from_arrow[column].to_numpy(), from_frame[column].to_numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(predictor.predict(table), predictor.predict(table.to_pandas()))  # a Table too
    with pytest.raises(ValueError, match=r"missing feature columns \['plan'\]"):
        predictor.scores(batch.drop_columns(["plan"]))


def test_each_input_column_is_encoded_once_and_an_infinite_value_is_named(model_path):
    """The encoding checks the numeric block it builds: no second encoding of a column to look for bad values."""
    predictor = Predictor.from_checkpoint(model_path)
    encoded: list[str] = []

    def counted(name: str, encode):
        def encode_and_count(column):
            encoded.append(name)
            return encode(column)

        return encode_and_count

    for name, codec in predictor._codecs.items():
        codec.encode = counted(name, codec.encode)
    table = user_table(ROWS, seed=5).drop(["label"])
    predictor.scores(table)
    assert sorted(encoded) == sorted(predictor.features)  # every input once (the numeric ones were encoded twice)
    income = table["income"].to_numpy(zero_copy_only=False).copy()
    income[7] = np.inf
    with pytest.raises(ValueError, match=r"input columns \['income'\] hold infinite values"):
        predictor.scores(table.set_column(table.schema.get_field_index("income"), "income", pa.array(income)))


# A scoring rank's start, as far as its program imports before it waits for its job (training/inference/
# batch_scoring.py: main, stopped at its argument parsing).
RANK_START = """
import sys
from training.inference.batch_scoring import main
try:
    main(["--help"])
except SystemExit:
    pass
print("pandas" in sys.modules, "torch" in sys.modules)
"""


def test_a_scoring_rank_starts_without_importing_pandas():
    """A scoring rank hands Arrow batches to the Predictor; pandas (about 0.23 s of every rank's start on 2 cores)
    is imported only where a DataFrame is made (the served model's answers)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", RANK_START], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "True"], done.stdout[-500:]
