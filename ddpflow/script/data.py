"""``ddpflow.dataset(split)``: a prepared split of the run's data section as a map-style torch ``Dataset``.

    train = ddpflow.dataset("train")                     # in a ddpflow run with a data section
    sampler = DistributedSampler(train)                  # each rank its part; set_epoch(epoch) every epoch
    loader = DataLoader(train, batch_size=256, sampler=sampler)
    model = MyModel(train.inputs, train.n_outputs)       # what a model factory receives (docs/models.md)
    for batch in loader: loss = F.cross_entropy(model(batch), batch["label"])

Item ``i`` is a dict with one tensor per input, as the model contract's batch has it for one row (numeric inputs
scaled, with their missing indicators; categoricals and ids as indices; ...), and ``label`` (a class index; a
regression target standardised, as ddpflow's own models learn it: evaluation and serving invert it) and ``weight``
when ``data.weight`` is set. The split is the node cache's memory-mapped file (training/loading/node_cache.py),
built once per node and shared by its ranks: data larger than memory works as it does for ddpflow's own runs.
``.inputs`` (name -> InputInfo), ``.n_outputs``, ``.task`` and ``.label_mapping`` describe it.

Outside a ddpflow run, ``ddpflow.dataset(split, config="cfg.yaml")`` prepares the config's data section (or reuses
the prepared dataset: the same cache as ``ddpflow prepare``); without a config it says how to run the script.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ddpflow.script.run import current_run
from training.core.manifest import Manifest, read_manifest
from training.kinds.inputs import InputInfo, inputs_from_manifest
from training.loading.batches import SplitArrays
from training.loading.node_cache import open_split

LABEL, WEIGHT = "label", "weight"  # the item's entries besides the inputs


class NoDatasetError(ValueError):
    """ddpflow.dataset() where there is no data section to read."""


class PreparedSplit(Dataset):
    """One prepared split, row by row (module doc)."""

    def __init__(self, dataset_dir: str | os.PathLike, split: str, cache_dir: str | None = None):
        manifest = read_manifest(dataset_dir)
        self.split = split
        self.manifest: Manifest = manifest
        self.inputs: dict[str, InputInfo] = inputs_from_manifest(manifest)
        taken = sorted({LABEL, WEIGHT} & set(self.inputs))
        if taken:
            raise NoDatasetError(f"ddpflow.dataset: inputs named {taken} would hide the item's own {taken} entries")
        self.n_outputs: int = manifest.n_outputs
        self.task: str = manifest.task
        self.label_mapping: list[Any] | None = manifest.label_mapping
        self._arrays: SplitArrays = open_split(dataset_dir, manifest, split, cache_dir).tensors

    def __len__(self) -> int:
        return len(self._arrays)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of the {self.split} split's {len(self)}")
        index %= len(self)
        item = {name: tensor[0] for name, tensor in self._arrays.rows(index, index + 1).items()}
        item[LABEL] = self._arrays.labels[index]
        if self._arrays.weights is not None:
            item[WEIGHT] = self._arrays.weights[index]
        return item

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``[start, stop)`` as one batch dict of the inputs (what ``forward`` takes), without labels."""
        return dict(self._arrays.rows(start, min(stop, len(self))))


def dataset(split: str, config: str | os.PathLike | None = None) -> PreparedSplit:
    """The prepared ``split`` ("train", "val" or "test") of the run's data section (module doc)."""
    run = current_run()
    if run is not None and config is None:
        if run.dataset_dir is None:
            raise NoDatasetError(
                "ddpflow.dataset: this run's config has no data section; add one (docs/scripts.md) to read a "
                "prepared dataset"
            )
        return PreparedSplit(run.dataset_dir, split, (run.config.get("data") or {}).get("cache_dir"))
    if config is None:
        raise NoDatasetError(
            "ddpflow.dataset: not in a ddpflow run; run the script with `ddpflow run --config CFG` (its train.script "
            "naming this file), or pass ddpflow.dataset(split, config='CFG.yaml') to prepare that config's data"
        )
    return _prepared_outside_a_run(config, split)


def example_batch(dataset_dir: str | os.PathLike, rows: int = 2) -> dict[str, torch.Tensor]:
    """The first ``rows`` rows of the train split as a batch: log_model's example in a run with a data section."""
    return PreparedSplit(dataset_dir, "train").batch(0, rows)


def _prepared_outside_a_run(config: str | os.PathLike, split: str) -> PreparedSplit:
    from training.core.config import load_config
    from training.prepare.dataset import prepare_dataset

    data = load_config(Path(config)).data
    if data is None:
        raise NoDatasetError(f"ddpflow.dataset: {config} has no data section")
    prepared = prepare_dataset(data)
    return PreparedSplit(prepared.dataset_dir, split, data.cache_dir)
