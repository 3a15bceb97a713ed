"""Streaming from object storage (``data.stream``): a real 2-rank run's samples/s streaming its shards from an S3
API on loopback through the bounded cache, ÷ the same run on the node cache; and a streaming rank's memory as the
data grows 4x.

The S3 API is moto's server (``moto_server``, the dev extra), its own process on 127.0.0.1; the dataset is
prepared twice from one source, locally (the node cache's run reads it) and to ``s3://ddpflow-bench/shards`` (the
stream's), the same fingerprint and shards. Shards of ``SHARD_ROWS`` rows at every size, so a 4x dataset is 4x
the shards, not 4x larger ones; the stream's cache holds a quarter of the train shards, so every epoch reads every
shard from the server again. The runs are the train stage as the Prefect task runs it (``launch_training``), 2
ranks, ``EPOCHS`` epochs; samples/s is each run's ``train_samples_per_s`` after its first epoch (the first warms
up: the node cache's build is before it, the stream's first window is read in it). The node cache's and the
stream's runs take turns in each repeat.

Memory: while each stream run trains, every rank's Pss_Anon is sampled (``/proc/PID/smaps_rollup``:
bench/harness/processes.py, ``rank_memory``); its peak at 1x and 4x. A rank holds the window it trains and the next,
so it should not grow (the node cache's rank grows by its sampler's permutation, 8 bytes a row: "Rank anonymous
memory as data grows").
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench import ddpflow_api
from bench.harness.context import Context
from bench.harness.processes import rank_memory, rank_pids
from bench.harness.results import Result, Row, Stats, log, turns
from bench.workloads.tabular import BATCH, source_file
from devtools.ports import free_port

TITLE = "Streaming from object storage"
MEMORY_TITLE = "Streaming rank memory as data grows"
RANKS, EPOCHS, WINDOW = 2, 3, 4
SHARDS_AT_1X = 64  # the 1x dataset's shards; their rows stay the same at 4x
THROUGHPUT_TARGET = 0.8  # stream samples/s ÷ node cache samples/s
MEMORY_TARGET = 1.1  # a streaming rank's peak anon at 4x ÷ at 1x
BUCKET = "ddpflow-bench"
SAMPLE_S = 0.05


def run(ctx: Context) -> list[Result]:
    small, large = ctx.sizes.rows // 4, ctx.sizes.rows  # 1x and 4x (a quarter of the workload: 3 runs a repeat)
    shard_rows = max(100, small // SHARDS_AT_1X)
    with moto_server() as env:
        local = {rows: prepared(ctx, rows, shard_rows, str(ctx.workdir / "stream-shards")) for rows in (small, large)}
        remote = {rows: prepared(ctx, rows, shard_rows, f"s3://{BUCKET}/shards") for rows in (small, large)}
        rates: dict[str, list[float]] = {"node_cache": [], "stream": []}
        anon: dict[int, list[float]] = {small: [], large: []}
        for repeat in range(ctx.sizes.repeats):
            for how in turns(["node_cache", "stream"], repeat):
                dataset = local[small] if how == "node_cache" else remote[small]
                figures = sampled(ctx, dataset, how == "stream", f"{how}-{repeat}", env)
                rates[how].append(figures["samples_per_s"])
                if how == "stream":
                    anon[small].append(figures["peak_anon"])
            anon[large].append(sampled(ctx, remote[large], True, f"stream-4x-{repeat}", env)["peak_anon"])
            log(
                f"stream: samples/s node cache {rates['node_cache'][-1]:,.0f}, stream {rates['stream'][-1]:,.0f}; "
                f"rank anon {anon[small][-1] / 1e6:.0f} MB at {small:,} rows, {anon[large][-1] / 1e6:.0f} MB at "
                f"{large:,}"
            )
    return [throughput_result(ctx, rates, shard_rows), memory_result(ctx, anon, small, large)]


def prepared(ctx: Context, rows: int, shard_rows: int, root: str):
    config = ddpflow_api.data_config(
        source=str(source_file(ctx, rows)), label="label", root=root, rows_per_shard=shard_rows
    )
    return ctx.cached(f"stream-prepared:{rows}:{root}", lambda: ddpflow_api.prepare(config))


def run_config(ctx: Context, dataset, stream: bool, name: str):
    manifest = ddpflow_api.manifest(dataset)
    train_bytes = sum(shard.bytes for shard in manifest.splits["train"].shards)
    data = {"source": "unused", "label": "label", "cache_dir": str(ctx.workdir / "stream-cache" / name)}
    if stream:
        data |= {"stream": True, "shuffle_window": WINDOW, "stream_cache_limit": train_bytes // 4}
    root = ctx.workdir / "stream-runs" / name
    return ddpflow_api.pipeline_config(
        {
            "data": data,
            "train": {
                "epochs": EPOCHS,
                "batch_size": BATCH,
                "nproc_per_node": RANKS,
                "run_root": str(root),
                "max_restarts": 0,
                "progress_interval_s": 60,
            },
        }  # fmt: skip
    ), root / "run"


def sampled(ctx: Context, dataset, stream: bool, name: str, env: dict[str, str]) -> dict[str, float]:
    """One run: its samples/s after the first epoch, and the largest rank's peak Pss_Anon (sampled every 50 ms)."""
    config, run_dir = run_config(ctx, dataset, stream, name)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            ddpflow_api.launch_training(config, dataset, run_dir, lambda line: None, timeout_s=3600)
        except BaseException as error:  # re-raised below
            failure.append(error)

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    peak_anon = 0
    while worker.is_alive():
        figures = [got for got in map(rank_memory, rank_pids()) if got]
        if len(figures) == RANKS:
            peak_anon = max(peak_anon, *(anon for anon, _ in figures))
        time.sleep(SAMPLE_S)
    if failure:
        raise failure[0]
    epochs = ddpflow_api.read_metrics(run_dir)
    steady = [record["train_samples_per_s"] for record in epochs[1:]]
    return {"samples_per_s": Stats.of(steady).median, "peak_anon": peak_anon}


def throughput_result(ctx: Context, rates: dict[str, list[float]], shard_rows: int) -> Result:
    ratio = Stats.of(s / n for s, n in zip(rates["stream"], rates["node_cache"]))
    small = ctx.sizes.rows // 4
    return Result(
        name="stream",
        title=TITLE,
        ratio=ratio,
        target=THROUGHPUT_TARGET,
        ratio_label="samples/s streaming from S3 on loopback ÷ samples/s on the node cache (2 ranks)",
        rows=[
            Row("node cache (the split mapped on the node)", Stats.of(rates["node_cache"]), "samples/s"),
            Row(
                "stream from moto's S3 server, cache = 1/4 of the train shards",
                Stats.of(rates["stream"]),
                "samples/s",
                ratio,
            ),  # fmt: skip
        ],
        notes=[
            f"{small:,} source rows in shards of {shard_rows:,}; 2 ranks x {BATCH} rows, the default model, "
            f"{EPOCHS} epochs, samples/s of epochs 2..{EPOCHS}; data.shuffle_window {WINDOW}. "
            f"{ctx.sizes.repeats} repeat(s), the two runs taking turns. The server, the ranks and this process "
            "share the machine's cores."
        ],
    )


def memory_result(ctx: Context, anon: dict[int, list[float]], small: int, large: int) -> Result:
    growth = Stats.of(b / a for a, b in zip(anon[small], anon[large]))
    return Result(
        name="stream_memory",
        title=MEMORY_TITLE,
        ratio=growth,
        target=MEMORY_TARGET,
        direction="le",
        ratio_label=f"a streaming rank's peak Pss_Anon at {large // small}x the rows ÷ at 1x",
        rows=[
            Row(f"{small:,} source rows", Stats.of(v / 1e6 for v in anon[small]), "MB"),
            Row(f"{large:,} source rows", Stats.of(v / 1e6 for v in anon[large]), "MB", growth),
        ],
        notes=[
            "The largest rank's Pss_Anon (its own memory, imports and model included), sampled every 50 ms over "
            "the whole run; the same shard size at both sizes."
        ],
    )


@contextlib.contextmanager
def moto_server() -> Iterator[dict[str, str]]:
    """moto's S3 server on a loopback port with the bench's bucket; the AWS variables for it, also set in this
    process's environment (the launcher passes it to the ranks) until the block ends."""
    port = free_port()
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        make_bucket(env, BUCKET, deadline_s=60)
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        server.wait(timeout=30)


def make_bucket(env: dict[str, str], bucket: str, deadline_s: float) -> None:
    """Create ``bucket`` once the server answers (it takes a few seconds to start)."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return
        except Exception:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
