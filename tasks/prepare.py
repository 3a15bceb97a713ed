"""Prefect task for the prepare stage: ``prepare_data(config) -> PreparedDataset``.

The work is ``training.data.prepare.prepare_dataset``; this wrapper adds the
Prefect view: a log line saying whether the dataset was reused (cache hit) or
prepared, and a table artifact with the rows and shards per split. No retries
(bad input fails the same way every time) and no Prefect caching: prepare's
own fingerprint cache works across processes and flow runs.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from training.config import PipelineConfig
from training.data.prepare import PreparedDataset, prepare_dataset
from training.layout import SPLITS


@task(name="prepare-data", retries=0, cache_policy=NO_CACHE)
def prepare_data(config: PipelineConfig) -> PreparedDataset:
    logger = get_run_logger()
    prepared = prepare_dataset(config.data)
    manifest = prepared.manifest
    logger.info(
        "%s dataset %s at %s (%s, %d features, train/val/test rows %s, %d dropped)",
        "cache hit:" if prepared.cache_hit else "prepared",
        prepared.fingerprint,
        prepared.dataset_dir,
        manifest.task,
        manifest.n_features,
        "/".join(str(manifest.rows(split)) for split in SPLITS),
        manifest.dropped_rows,
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
