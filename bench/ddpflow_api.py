"""The one door from bench/ to the product: every ddpflow, training, tasks or flows name the benchmarks use.

Benchmarks drive the stages (prepare, load, the training loop, evaluate, launch, the local stack) and read the
contracts (config, manifest, models, job, synthetic data) only through these functions and constants, so that
when the product's modules move or a stage's API changes, only this file changes
(tests/bench/test_bench.py checks that no other bench/ module imports the product). What ``python -m`` starts in
a child process (the rank program, an evaluation) is named here too. Product imports sit inside the functions:
importing bench costs no product import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

AGENT_MODULE = "ddpflow.launch.agent"  # torchrun's agent as ddpflow starts it (torch.distributed.run's main)
RANK_MODULE = "training.train"  # what every rank runs: python -m training.train --config RUN_DIR/train_config.json
CLI_MODULE = "flows.cli"  # ``ddpflow`` (the console script) as python -m flows.cli
FLOW_MODULE = "flows.pipeline"  # the pipeline flow: what a fresh CLI process imports
EVALUATE_IN_A_PROCESS = "; ".join(
    (
        "import sys",
        "from training.inference.evaluate import evaluate_split",
        "print(evaluate_split(sys.argv[1], sys.argv[2]).metrics)",
    )
)


# ----------------------------------------------------------------------------- files and contracts


def atomic_write_json(path: Path, payload: Any) -> Path:
    """ddpflow's atomic write (``training.core.fileio``): a reader never sees half a results file."""
    from training.core.fileio import atomic_write_json as write

    return write(path, payload)


def manifest(dataset_dir: str | Path):
    """The prepared dataset's manifest (``training.core.manifest.Manifest``)."""
    from training.core.manifest import read_manifest

    return read_manifest(dataset_dir)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run's epochs, from RUN_DIR/metrics.jsonl (``training.core.fileio.read_metrics_lines``)."""
    from training.core.fileio import read_metrics_lines
    from training.core.layout import METRICS

    return read_metrics_lines(Path(run_dir) / METRICS)


def train_line_prefix() -> str:
    """``training.core.fileio.TRAIN``: the prefix of the training program's own lines."""
    from training.core.fileio import TRAIN

    return TRAIN


def data_config(**fields: Any):
    """A ``training.core.config.DataConfig`` (what prepare takes)."""
    from training.core.config import DataConfig

    return DataConfig(**fields)


def data_config_from_overrides(overrides: list[str]):
    """The ``data`` section of ddpflow's defaults plus ``overrides`` (``data.source=...``), as the CLI reads them."""
    from training.core.config import load_config

    return load_config(None, overrides).data


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``raw`` with ``section.key=value`` overrides applied, as ``--set`` does (``training.core.config``)."""
    from training.core.config import apply_overrides as apply

    return apply(raw, overrides)


def pipeline_config(raw: dict[str, Any]):
    """A validated ``training.core.config.PipelineConfig``."""
    from training.core.config import PipelineConfig

    return PipelineConfig.model_validate(raw)


def write_synthetic(url: str, path: Path) -> Path:
    """ddpflow's synthetic source (``training.prepare.synthetic``): a Parquet file for a ``synthetic://`` URL."""
    from training.prepare.synthetic import write_synthetic as write

    return write(url, path)


def write_train_job(config, dataset_dir: str | Path, run_dir: Path) -> Path:
    """The job file a rank reads (``training.core.job.TrainJob``), written to RUN_DIR/train_config.json."""
    from training.core.job import TrainJob

    return TrainJob(config, str(dataset_dir), str(run_dir)).write(run_dir / "train_config.json")


# ----------------------------------------------------------------------------- prepare and load


def prepare(data_config):
    """``training.prepare.dataset.prepare_dataset`` -> the dataset directory (a URL stays a string)."""
    from training.prepare.dataset import prepare_dataset

    dataset_dir = prepare_dataset(data_config).dataset_dir
    return dataset_dir if isinstance(dataset_dir, str) else Path(dataset_dir)


def import_prepare_and_load() -> None:
    """Import what preparing and loading need, so that a memory probe's baseline holds them."""


def import_node_cache() -> None:
    """Import what a rank (and the node cache's builder) imports before it gets its data (``training.train``)."""
    import training.loading.node_cache  # noqa: F401


def load_split(dataset_dir: str | Path, split: str):
    """ddpflow's preallocated load of a split (``training.loading.batches.load_split``)."""
    from training.loading.batches import load_split as ddpflow_load_split

    return ddpflow_load_split(dataset_dir, manifest(dataset_dir), split)


def load_train_split(dataset_dir: str | Path):
    return load_split(dataset_dir, "train")


def node_splits(dataset_dir: str | Path, splits=("train", "val"), cache_dir: str | Path | None = None):
    """Splits the way every rank gets them (``training.loading.node_cache.open_splits``): mapped from the node
    cache, built there first when missing (in the rank or the builder child: ``builds_in_rank``).
    Split name -> ``CachedSplit`` (``.tensors``, ``.how``, ``.seconds``)."""
    from training.loading.node_cache import open_splits

    return open_splits(dataset_dir, manifest(dataset_dir), splits, None if cache_dir is None else str(cache_dir))


def build_node_cache_file(dataset_dir: str | Path, split: str, cache_dir: str | Path) -> Path:
    """What the node cache's builder process does for one split (``training.loading.node_cache._build``: the file
    sized up front, mapped, filled record batch by record batch, published atomically), in THIS process."""
    from training.loading.node_cache import _build, _expected_header, cache_path

    read, cache_dir = manifest(dataset_dir), str(cache_dir)
    path = cache_path(dataset_dir, read, split, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _build(dataset_dir, read, split, path, _expected_header(read, split), cache_dir)
    return path


def record_batch_bytes(dataset_dir: str | Path, split: str) -> int:
    """Arrow bytes of one record batch as the loader reads the split's shards (``fill_split``'s ``read_rows``
    rows of the columns its inputs, label and weight need), from the first shard."""
    import inspect

    import pyarrow.parquet as pq

    from training.kinds.inputs import inputs_from_manifest
    from training.loading.batches import fill_split

    read = manifest(dataset_dir)
    read_rows = inspect.signature(fill_split).parameters["read_rows"].default
    columns = [*inputs_from_manifest(read), read.label, *([read.weight] if read.weight else [])]
    shard = read.split_files(dataset_dir, split)[0]
    return next(pq.ParquetFile(shard).iter_batches(batch_size=read_rows, columns=columns)).nbytes


def codecs(dataset_dir: str | Path) -> dict[str, Any]:
    """The dataset's fitted codecs by input name (``training.loading.batches.manifest_codecs``)."""
    from training.loading.batches import manifest_codecs

    return manifest_codecs(dataset_dir, manifest(dataset_dir))


def shard_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's contiguous slice of ``rows`` (``training.distributed.context.shard_range``: validation's split)."""
    from training.distributed.context import shard_range as ddpflow_shard_range

    return ddpflow_shard_range(rows, rank, world_size)


# ----------------------------------------------------------------------------- batches and the training loop


def train_batches(
    split,
    *,
    batch: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
):
    """ddpflow's per-rank batches (``training.loading.batches.TrainBatches``: DistributedSampler, one gather per batch;
    ``num_workers`` persistent processes collating what a codec decodes, images)."""
    from training.loading.batches import TrainBatches

    device = torch.device(device)
    return TrainBatches(
        split, rank, world_size, batch, seed, device, pin_memory=device.type == "cuda", num_workers=num_workers
    )


def collate_one(codec, values, offsets, row: int, epoch: int):
    """One row of a ragged input through its codec's ``collate`` (the training transforms), as one batch of it."""
    from training.kinds.ragged import BatchContext

    start, stop = int(offsets[row]), int(offsets[row + 1])
    context = BatchContext(torch.tensor([row]), epoch, 0, True)
    batch = codec.collate(values[start:stop], torch.tensor([0, stop - start]), context)
    return batch[codec.name][0]


def on_device(split, device: str | torch.device):
    """The split copied to ``device`` once, as ``train.data_on_device=true`` does (``training.loading.placement``)."""
    from training.loading.placement import place_splits

    placed, _ = place_splits({"train": split}, True, torch.device(device), torch.nn.Module())
    return placed["train"]


def first_rows(split, rows: int):
    """The split's first ``rows`` rows (repeated when it has fewer): a split whose epoch is exactly N steps."""
    from training.loading.batches import SplitTensors

    repeats = -(-rows // len(split))
    features, labels = split.features, split.labels
    if repeats > 1:
        features, labels = features.repeat(repeats, 1), labels.repeat(repeats)
    return SplitTensors(features[:rows], labels[:rows])


def train_epoch(
    model,
    optimizer,
    batches,
    epoch: int,
    *,
    device: str | torch.device = "cpu",
    grad_accum: int = 1,
    bf16: bool = False,
    stops=None,
) -> int:
    """ddpflow's training epoch: ``Trainer.run_epoch``'s loop over ``training.loop.step.TrainStep`` (the exact update),
    without the Trainer's validation and hooks; returns the samples trained. ``stops``: the run's stop check after
    every micro-batch (``DdpflowRank.stop_flags``), as ``training.loop.step.EpochPass`` makes it."""
    from training.loop.step import StepSettings, TrainStep

    device = torch.device(device)
    train_step = TrainStep(
        model, optimizer, None, batches, StepSettings("classification", device, grad_accum, bf16=bf16)
    )
    model.train()
    loss = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device, as a rank does
    samples = 0
    for step, batch in enumerate(batches.epoch(epoch)):
        loss.add_(train_step(step, batch))
        samples += batch.samples
        if stops is not None and stops.due(step):
            raise RuntimeError("a stop flag was set")  # no handler is installed: never
    return samples


# ----------------------------------------------------------------------------- models


def mlp(n_features: int, n_outputs: int, hidden: Iterable[int]):
    """The built-in ``mlp`` on a bare numeric block (``training.models.registry.build_model``)."""
    from training.models.registry import ModelSpec, build_model

    return build_model(ModelSpec("mlp", n_features, n_outputs, {"hidden": list(hidden)}))


def model_for(dataset_dir: str | Path, kind: str, kwargs: dict[str, Any], n_outputs: int | None = None):
    """The built-in model ``kind`` (``auto``, ``mlp``, ``transformer``...) for the dataset's inputs
    (``ModelSpec.for_inputs``); ``n_outputs`` defaults to the manifest's."""
    from training.kinds.inputs import inputs_from_manifest
    from training.models.registry import ModelSpec, build_model

    read = manifest(dataset_dir)
    outputs = read.n_outputs if n_outputs is None else n_outputs
    return build_model(ModelSpec.for_inputs(kind, inputs_from_manifest(read), outputs, kwargs))


def embedding_dim(cardinality: int) -> int:
    """How wide the built-in mlp embeds a categorical of ``cardinality`` values."""
    from training.models.tabular import embedding_dim as width

    return width(cardinality)


def write_model_file(dataset_dir: str | Path, path: Path, model, hidden: Iterable[int]) -> Path:
    """A model.pt as training writes it (``training/inference/model_file.py: inference_checkpoint``) for an ``mlp`` of
    ``hidden`` on the dataset's numeric block."""
    from training.inference.model_file import inference_checkpoint
    from training.models.registry import ModelSpec

    read = manifest(dataset_dir)
    spec = ModelSpec("mlp", read.n_features, read.n_outputs, {"hidden": list(hidden)})
    torch.save(inference_checkpoint(model.state_dict(), spec, read, epochs=0, metrics={}), path)
    return path


# ----------------------------------------------------------------------------- a rank's set-up


@dataclass
class DdpflowRank:
    """A rank joined and configured by ddpflow's own code, as ``training.train.Trainer`` sets one up."""

    ctx: Any  # training.distributed.context.DistContext
    setup: Any  # training.distributed.process.ProcessSetup: threads, cores, whether it polls for the all-reduce
    gradients: Any = None  # training.distributed.context.GradientAllReduce, once ``wrap`` made it

    def wrap(self, model):
        """``training.distributed.context.wrap_model``: DDP with ddpflow's bucket size and its gradient all-reduce
        (the stop flags carried on it; polling when asked)."""
        from training.distributed.context import GradientAllReduce, wrap_model

        self.gradients = GradientAllReduce(self.setup.poll_allreduce)
        return wrap_model(model, self.ctx, self.gradients)

    def stop_flags(self, grad_accum: int, micro_batches: int):
        """``training.loop.step.StopFlags`` as a run's epoch asks it after every micro-batch, over ``wrap``'s
        all-reduce (no signal handler: it never says stop, but it reads the flags a run reads)."""
        from training.loop.counting import OptimizerSteps
        from training.loop.preemption import PreemptionWatch
        from training.loop.step import StopFlags

        return StopFlags(PreemptionWatch(), self.ctx, OptimizerSteps(grad_accum, micro_batches), self.gradients)


@contextmanager
def ddpflow_rank(overrides: list[str]) -> Iterator[DdpflowRank]:
    """Join the process group and configure this process exactly as every training rank does
    (``training.distributed.context.distributed``, ``training.distributed.process.configure_process``), for
    ddpflow's defaults plus ``overrides`` (``train.num_threads=1``, ``train.cpu_poll_allreduce=true``, ...);
    leave it after."""
    from training.core.config import load_config
    from training.distributed.context import distributed
    from training.distributed.process import configure_process

    train = load_config(None, overrides).train
    with distributed(train) as ctx:
        yield DdpflowRank(ctx, configure_process(train, ctx))


def bucket_cap_mb() -> float:
    """The DDP bucket size ddpflow passes (one bucket for models whose gradients fit)."""
    from training.distributed.context import BUCKET_CAP_MB

    return float(BUCKET_CAP_MB)


def default_decode_arrangement(cores: tuple[int, ...]) -> tuple[int, int]:
    """(decode workers, intra-op threads) that ddpflow gives a pinned CPU rank owning ``cores`` with an image
    input (``training.distributed.process``: ``decode_workers("auto")``, ``make_room_for_workers``), for the
    default config."""
    from training.core.config import TrainConfig
    from training.distributed.process import CpuSetup, decode_workers, make_room_for_workers

    train = TrainConfig()
    pinned = CpuSetup(len(cores), cores)
    workers = decode_workers(train.num_workers, pinned, on_gpu=False, decodes=True)
    return workers, make_room_for_workers(pinned, workers, train).threads


# ----------------------------------------------------------------------------- evaluate and checkpoints


def evaluate(model_path: str | Path, dataset_dir: str | Path, split: str = "test") -> int:
    """``training.inference.evaluate.evaluate_split``; returns the rows scored."""
    from training.inference.evaluate import evaluate_split

    return evaluate_split(model_path, dataset_dir, split).samples


def step_checkpointer(run_dir: str | Path):
    """ddpflow's checkpointer for one process (``training.checkpoint.files.Checkpointer``): ``save_step`` writes a step
    checkpoint in the background, ``wait_for_writes`` joins it."""
    from training.checkpoint.files import Checkpointer
    from training.distributed.context import SingleProcess

    return Checkpointer(run_dir, SingleProcess(), keep_steps=2)


def training_snapshot(model, optimizer) -> dict[str, Any]:
    """The copy a step checkpoint writes, as ``Trainer.state_dict`` takes it (``training.train.on_cpu``, copy)."""
    from training.train import on_cpu

    return {"model": on_cpu(model.state_dict(), copy=True), "optimizer": on_cpu(optimizer.state_dict(), copy=True)}


# ----------------------------------------------------------------------------- launch, processes, servers


def launch_training(config, dataset_dir: str | Path, run_dir: Path, on_line, timeout_s: float = 600):
    """The train stage exactly as the Prefect task runs it (``ddpflow.launch.stage.run_train_stage`` on a
    ``TrainRequest``) through the launcher ``config.train.launcher`` names (local: preflight, job file,
    torchrun; slurm: preflight, job files, sbatch, following), limited to ``timeout_s``. The Slurm commands and
    SLURM_CONF come from the environment. Returns the ``TrainResult``."""
    from ddpflow.launch.stage import TrainRequest, run_train_stage

    train = config.train.model_copy(update={"timeout_s": timeout_s})
    return run_train_stage(
        TrainRequest(config.model_copy(update={"train": train}), dataset_dir, run_dir, on_line=on_line)
    )


def session_members(sid: int):
    """Every process of session ``sid`` (``ddpflow.launch.process_tree``)."""
    from ddpflow.launch.process_tree import session_members as members

    return members(sid)


def stop_processes(processes, grace_s: float) -> None:
    """ddpflow's one way to stop processes: SIGTERM, wait ``grace_s``, SIGKILL, reap."""
    from ddpflow.launch.process_tree import stop_processes as stop

    stop(processes, grace_s)


def stack_up(project: Path, **options: Any) -> None:
    """``ddpflow stack up`` (the local Prefect and MLflow servers, work pool, deployments, worker) for ``project``."""
    from ddpflow.services import stack

    stack.up(project, **options)


def stack_down(project: Path, **options: Any) -> None:
    """``ddpflow stack down``: stops what ``stack_up`` started."""
    from ddpflow.services import stack

    stack.down(project, **options)


def start_temporary_server(env: dict[str, str]):
    """The temporary Prefect server a ``ddpflow run`` without a stack starts (``.wait_until_ready``, ``.stop``)."""
    from ddpflow.services.prefect_server import start_temporary_server as start

    return start(env)


# ----------------------------------------------------------------------------- quality on a prepared table


def evaluate_metrics(model_path: str | Path, dataset_dir: str | Path, split: str = "test") -> dict[str, float]:
    """``training.inference.evaluate.evaluate_split``'s metrics (``test_roc_auc``, ``test_accuracy``, ``test_r2``)."""
    from training.inference.evaluate import evaluate_split

    return dict(evaluate_split(model_path, dataset_dir, split).metrics)


def frame_predictions(model_path: str | Path, frame):
    """A model's prediction for each row of ``frame`` (a split as ``split_frame`` reads it), as a served model makes
    it (``training.inference.predict.Predictor``): the value (regression), or (class indices, a probability column
    per class index) for a classifier."""
    from training.inference.predict import Predictor

    predictor = Predictor.from_checkpoint(model_path)
    if predictor.task == "regression":
        return predictor.predict_raw(frame)
    return predictor.predict_raw(frame), predictor.predict_proba(frame).to_numpy()


def split_frame(dataset_dir: str | Path, split: str):
    """The rows of a prepared split as its shards hold them (after ``data.on_invalid``), as a pandas frame."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = manifest(dataset_dir).split_files(dataset_dir, split)
    return pa.concat_tables([pq.read_table(path) for path in files]).to_pandas()


# ----------------------------------------------------------------------------- batch scoring


def write_input_model_file(dataset_dir: str | Path, path: Path, hidden: Iterable[int]) -> Path:
    """A model.pt as training writes it for the built-in mlp on the dataset's inputs (embeddings for its
    categoricals, with the dataset's fitted encoders); untrained weights score as fast as trained ones."""
    from training.inference.model_file import inference_checkpoint
    from training.kinds.inputs import inputs_from_manifest
    from training.kinds.registry import read_encoders
    from training.models.registry import ModelSpec, build_model

    read = manifest(dataset_dir)
    spec = ModelSpec.for_inputs("mlp", inputs_from_manifest(read), read.n_outputs, {"hidden": list(hidden)})
    model = build_model(spec)
    checkpoint = inference_checkpoint(model.state_dict(), spec, read, 0, {}, read_encoders(dataset_dir, read))
    torch.save(checkpoint, path)
    return path


def pyfunc_scorer(model_path: str | Path):
    """What the served pyfunc runs for ``predict(frame, params={"output": "probabilities"})``
    (``training.inference.serving``: ``load_context`` then ``predict``), minus MLflow's schema check."""
    from training.inference.serving import load_predictor, predictions

    predictor = load_predictor(model_path)
    return lambda frame: predictions(predictor, frame, "probabilities")


def encoded_forward(model_path: str | Path, frame):
    """(the model, its batch dict for ``frame``, encoded once): the model's own forward rate, no encoding."""
    from training.inference.predict import Predictor

    predictor = Predictor.from_checkpoint(model_path)
    return predictor.model, predictor.batch_inputs(frame)


def cpu_forward_rows() -> int:
    """The most rows ``Predictor`` forwards in one call on a CPU (``training.inference.predict.CPU_FORWARD_ROWS``)."""
    from training.inference.predict import CPU_FORWARD_ROWS

    return CPU_FORWARD_ROWS


def score_command(model_path: Path, source: Path, output: Path, nproc: int, tracking_uri: str) -> list[str]:
    """``ddpflow score`` of a model.pt, as a user runs it (the command line: start-up included)."""
    import sys

    return [
        sys.executable, "-m", CLI_MODULE, "score", "--model", str(model_path), "--source", str(source),
        "--output", str(output), "--set", f"score.nproc_per_node={nproc}", "--set",
        f"mlflow.tracking_uri={tracking_uri}", "--json",
    ]  # fmt: skip
