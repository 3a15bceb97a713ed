"""Prefect task for the prepare stage: ``prepare_data(config) -> PreparedDataset``.

The work is ``training.prepare.dataset.prepare_dataset``; this wrapper adds the
Prefect view: a log line saying whether the dataset was reused (cache hit) or
prepared, and a table artifact with the rows and shards per split; a warning
and a second table artifact (``prepared-dataset-left-out``) for every column the
default inputs left out, with the ``data.inputs`` entry that would include it;
how the task was decided (inferred from the label, or data.task); prepare's warnings (integers beyond float32's
exact range); and each numeric
input's share of missing values in the train split. No retries (bad input fails
the same way every time) and no Prefect caching: prepare's own fingerprint cache
works across processes and flow runs.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from training.core.config import PipelineConfig
from training.core.layout import SPLITS
from training.kinds.inputs import describe_inputs, inputs_from_manifest
from training.prepare.dataset import PreparedDataset, prepare_dataset


@task(name="prepare-data", retries=0, cache_policy=NO_CACHE)
def prepare_data(config: PipelineConfig) -> PreparedDataset:
    logger = get_run_logger()
    prepared = prepare_dataset(config.data)
    manifest = prepared.manifest
    logger.info(
        "%s dataset %s at %s (%s, inputs: %s, train/val/test rows %s, %d dropped)",
        "cache hit:" if prepared.cache_hit else "prepared",
        prepared.fingerprint,
        prepared.dataset_dir,
        manifest.task,
        describe_inputs(inputs_from_manifest(manifest)),
        "/".join(str(manifest.rows(split)) for split in SPLITS),
        manifest.dropped_rows,
    )
    if manifest.extra.get("task_inferred"):
        logger.info("data: %s", manifest.extra["task_inferred"])
    for warning in manifest.extra.get("warnings", []):
        logger.warning("data: %s", warning)
    null_rates = manifest.extra.get("null_rates", {})
    if null_rates:
        logger.info(
            "data: missing values (imputed with the train median, the mean under scaling: standard, with a missing"
            " indicator) in the train split: %s",
            ", ".join(f"{name} {rate:.1%}" for name, rate in null_rates.items()),
        )
    left_out = manifest.extra.get("left_out", [])
    for column in left_out:
        logger.warning(
            "data: column %r (%s) is left out of the inputs (%s); to include it: data.inputs.%s: %s",
            column["column"], column["type"], column["why"], column["column"], column["suggest"],
        )  # fmt: skip
    if left_out:
        create_table_artifact(
            key="prepared-dataset-left-out",
            table=[
                {"column": c["column"], "type": c["type"], "data.inputs entry": c["suggest"], "why": c["why"]}
                for c in left_out
            ],
            description="Columns the default inputs (every numeric column) left out, with the data.inputs "
            "entry that would include each",
        )
    create_table_artifact(
        key="prepared-dataset",
        table=[
            {
                "split": split,
                "rows": manifest.rows(split),
                "shards": len(manifest.splits[split].shards),
                "bytes": sum(shard.bytes for shard in manifest.splits[split].shards),
            }
            for split in SPLITS
        ],
        description=(
            f"Dataset {prepared.fingerprint} ({'cache hit' if prepared.cache_hit else 'prepared'}) "
            f"from {manifest.source}"
        ),
    )
    return prepared
