"""An s3:// source through s3fs, against moto's S3 server on loopback."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.ports import free_port
from training.prepare.dataset import DataError, prepare_dataset

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture
def s3_bucket(monkeypatch):
    """A fresh bucket on a local moto server; s3fs finds it through AWS_ENDPOINT_URL_S3."""
    import boto3

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ddpflow-test")
    try:
        yield client, "ddpflow-test"
    finally:
        server.stop()


def _put_parquet(client, bucket: str, key: str, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    client.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


@pytest.mark.server  # moto's S3, on a thread
def test_prepare_from_s3_prefix_and_object(s3_bucket, make_config, dh):
    client, bucket = s3_bucket
    _put_parquet(client, bucket, "raw/part-0.parquet", dh.numeric_table(rows=2000, start=0))
    _put_parquet(client, bucket, "raw/part-1.parquet", dh.numeric_table(rows=1000, seed=1, start=2000))
    config = make_config(f"s3://{bucket}/raw/", key="id")
    prepared = prepare_dataset(config)
    ids = sorted(sum((table["id"].to_pylist() for table in dh.read_all_splits(prepared).values()), []))
    assert ids == list(range(3000))
    files = prepared.manifest.extra["source_identity"]["files"]
    assert [name for name, _, _ in files] == [f"s3://{bucket}/raw/part-0.parquet", f"s3://{bucket}/raw/part-1.parquet"]
    assert all(etag for _, _, etag in files)  # the ETag is the object's version
    assert prepare_dataset(config).cache_hit
    # a changed object (new ETag) is a new dataset
    _put_parquet(client, bucket, "raw/part-1.parquet", dh.numeric_table(rows=500, seed=2, start=2000))
    changed = prepare_dataset(config)
    assert not changed.cache_hit and sum(changed.summary()["rows"].values()) == 2500
    single = prepare_dataset(make_config(f"s3://{bucket}/raw/part-0.parquet", key="id"))
    assert sum(single.summary()["rows"].values()) == 2000


@pytest.mark.server  # moto's S3, on a thread
def test_missing_s3_object_is_a_data_error(s3_bucket, make_config):
    _, bucket = s3_bucket
    with pytest.raises(DataError, match=rf"s3://{bucket}/nothing/here.parquet.*no such file"):
        prepare_dataset(make_config(f"s3://{bucket}/nothing/here.parquet"))
