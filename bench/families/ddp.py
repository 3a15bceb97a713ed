"""DDP scaling with real torchrun launches, and the comparison a user would make.

Scaling: ddpflow's 2-rank samples/s ÷ plain DDP's in the same run (the CPU
target), and each configuration's efficiency, total samples/s of 2 ranks ÷
(2 × samples/s of one rank); gloo on CPU, batch 512 per rank, one thread per
rank. Each configuration is its own torchrun launch that trains a fixed number
of steps after warm-up; the ranks write their samples and seconds to files.
Configurations take turns within each repeat.

Comparison: the same training written the plain way (a per-row Dataset over a
pandas DataFrame, DataLoader with DistributedSampler, DDP) against ddpflow's
path, both with 2 ranks in the same run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import ddpflow_api
from bench.harness import processes
from bench.harness.context import Context
from bench.harness.results import Result, Row, Stats, log, turns
from bench.workloads.tabular import BATCH, prepared_dir, train_arrays

# ddpflow's defaults at parity with plain DDP, both measured in the same run: this machine's wake-up latency
# (docs/benchmarks.md) is not ddpflow's to fix, so the defaults need only not cost anything.
CPU_TARGET_VS_PLAIN = 0.97


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    nproc: int
    flags: list[str] = field(default_factory=list)
    feed: str = ""  # "" = the run's default feed
    steps: int | None = None  # None: sizes.ddp_steps
    warmup: int | None = None  # None: sizes.ddp_warmup


RANK = "bench.ranks.ddp"  # the rank program every launch runs
# Ranks set up by ddpflow's own code (bench/ranks/ddp.py --ranks ddpflow), one thread each like every row.
DDPFLOW_RANKS = ["--ranks", "ddpflow", "--set", "train.num_threads=1"]
POLLING = ["--set", "train.cpu_poll_allreduce=true"]


def configs(ctx: Context, feed: str) -> list[Config]:
    """Plain DDP, + cpu affinity, + one gradient bucket (plain PyTorch, one change each); ddpflow's defaults
    (its own rank set-up); + polling (opt-in); + grad_accum."""
    accum = ctx.sizes.grad_accum
    bucket = ["--bucket-mb", str(ddpflow_api.bucket_cap_mb())]
    every = [
        Config("one", "one rank (baseline)", 1, bucket),
        Config("plain", "2 ranks, plain DDP (default buckets, no pinning)", 2),
        Config("affinity", "2 ranks + cpu affinity", 2, ["--affinity"]),
        Config("bucket", "2 ranks + cpu affinity + one gradient bucket", 2, ["--affinity", *bucket]),
        Config(
            "defaults", "2 ranks, ddpflow's defaults (cpu affinity, one gradient bucket, no polling)", 2, DDPFLOW_RANKS
        ),
        Config(
            "poll",
            "2 ranks, ddpflow's defaults + train.cpu_poll_allreduce=true (opt-in polling)",
            2,
            [*DDPFLOW_RANKS, *POLLING],
        ),
        Config(
            "alone",
            "2 ranks pinned, no gradient sync at all (compute alone: this machine's ceiling)",
            2,
            ["--affinity", "--independent", "--allreduce-probe", "300"],
        ),
        Config(
            "accum",
            f"2 ranks, ddpflow's defaults + grad_accum {accum} (no_sync)",
            2,
            [*DDPFLOW_RANKS, "--grad-accum", str(accum)],
        ),
        Config(
            "accum_more",
            f"2 ranks, ddpflow's defaults + grad_accum {ctx.sizes.grad_accum_more} (no_sync)",
            2,
            [*DDPFLOW_RANKS, "--grad-accum", str(ctx.sizes.grad_accum_more)],
        ),
        Config(
            "naive",
            "plain user code: pandas per-row Dataset, 2 ranks",
            2,
            feed="pandas",
            steps=ctx.sizes.naive_steps,
            warmup=2,
        ),
    ]
    wanted = set(ctx.sizes.ddp_configs) - ({"naive"} if feed != "ddpflow" else set())
    return [config for config in every if config.key in wanted]


def run(ctx: Context) -> list[Result]:
    sizes = ctx.sizes
    feed = "ddpflow"
    feed_data = {"presliced": str(npz(ctx)), "pandas": str(npz(ctx)), "ddpflow": str(prepared_dir(ctx, sizes.rows))}
    plan = configs(ctx, feed)
    rates: dict[str, list[float]] = {config.key: [] for config in plan}
    batches: dict[str, int] = {}
    probes: dict[str, list[float]] = {"allreduce_p50_ms": [], "allreduce_p90_ms": []}
    for repeat in range(sizes.ddp_repeats):
        for config in turns(plan, repeat):
            rates[config.key].append(measure(ctx, config, config.feed or feed, feed_data, repeat, batches, probes))
        log(f"ddp repeat {repeat + 1}: " + ", ".join(f"{key} {values[-1]:,.0f}/s" for key, values in rates.items()))
    labels = {config.key: config.label for config in plan}

    def efficiency(key: str) -> Stats:
        return Stats.of(two / (2 * one) for two, one in zip(rates[key], rates["one"]))

    def row(key: str, with_ratio: bool = True) -> Row:
        return Row(
            labels[key],
            Stats.of(rates[key]),
            "samples/s",
            efficiency(key) if with_ratio else None,
            note=f"effective batch {batches[key]}",
        )

    common = (
        f"Ranks run {what_ranks_run(feed)}; "
        f"{sizes.ddp_steps} timed steps after {sizes.ddp_warmup} warm-up steps per launch, gloo, one thread per rank; "
        f"{sizes.ddp_repeats} launch(es) per configuration, taking turns (reversed every other repeat). "
        "Ratio = total samples/s ÷ (2 × one rank's)."
    )
    unchanged = [key for key in ("plain", "affinity", "bucket", "defaults", "poll") if key in rates]
    if "defaults" in rates and "plain" in rates:
        # On CPU the target is ddpflow's defaults against plain DDP in the same run (parity): on these machines a
        # rank waiting in the all-reduce wakes a scheduler tick late, which caps plain DDP itself near 0.56 of 2x
        # (see docs). The efficiency stays in every row; on GPUs (nccl, one rank per GPU) its target is 0.9.
        ratio = Stats.of(ours / plain for ours, plain in zip(rates["defaults"], rates["plain"]))
        target, ratio_label = CPU_TARGET_VS_PLAIN, f"{labels['defaults']} ÷ 2 ranks, plain DDP (samples/s)"
    else:  # a run without both rows (--quick may leave them out)
        ratio, target, ratio_label = efficiency(unchanged[-1]), None, f"{labels[unchanged[-1]]} ÷ 2 × one rank"
    results = [
        Result(
            name="ddp",
            title="DDP scaling",
            ratio=ratio,
            target=target,
            ratio_label=ratio_label,
            rows=[row("one", False)] + [row(key) for key in unchanged] + ceiling_rows(rates, probes, row),
            notes=[
                common,
                "Headline: ddpflow's defaults ÷ plain DDP, both measured in this run (target ≥ 0.97 on CPU: parity); "
                "the ratio column is each row's efficiency (on GPUs, nccl with one rank per GPU, its target is 0.9).",
                "Semantics unchanged in these rows: each optimizer step averages 2 × 512 samples. The plain rows add "
                "one change each, in plain PyTorch. ddpflow's defaults are its own rank set-up, as training.train's "
                "ranks take it (training.distributed.process.configure_process, "
                "training.distributed.context.wrap_model): "
                "train.cpu_affinity=true pins every thread of a rank, DDP bucket_cap_mb=25 puts the model's ~0.3 MB "
                "of gradients in one all-reduce, and train.cpu_poll_allreduce=false. The polling row opts in "
                "(true: a rank polls for that all-reduce instead of sleeping in it, DDP's own arithmetic bit for bit).",
            ],
        )
    ]
    accumulated = [key for key in ("accum", "accum_more") if key in rates]
    if accumulated:
        headline_accum = accumulated[-1]
        accum_k = {"accum": sizes.grad_accum, "accum_more": sizes.grad_accum_more}
        results.append(
            Result(
                name="ddp_accum",
                title="DDP scaling with gradient accumulation",
                ratio=efficiency(headline_accum),
                target=0.95,
                ratio_label=f"2 ranks with train.grad_accum={accum_k[headline_accum]} ÷ 2 × one rank",
                rows=[row("one", False)] + [row(key) for key in accumulated],
                notes=[
                    common,
                    "Changes semantics: the effective batch is 512 × k micro-batches × 2 ranks; "
                    "gradients are all-reduced once per k micro-batches (no_sync).",
                ],
            )
        )
    if "naive" in rates and "defaults" in rates:
        ratio = Stats.of(ours / naive for ours, naive in zip(rates["defaults"], rates["naive"]))
        results.append(
            Result(
                name="comparison",
                title="The comparison a user would make",
                ratio=ratio,
                ratio_label="ddpflow's 2-rank training samples/s ÷ the plain way's",
                rows=[
                    Row(
                        "plain way: per-row Dataset over a pandas DataFrame, DataLoader + DistributedSampler, DDP",
                        Stats.of(rates["naive"]),
                        "samples/s",
                        note=f"{sizes.naive_steps} timed steps after 2 warm-up steps (it is that slow)",
                    ),
                    Row(
                        "ddpflow: loader, training loop, DDP with its defaults",
                        Stats.of(rates["defaults"]),
                        "samples/s",
                        ratio,
                    ),
                ],
                notes=["Same model, optimizer, batch 512 per rank, 2 ranks under torchrun, in the same run."],
            )
        )
    return results


def ceiling_rows(rates: dict[str, list[float]], probes: dict[str, list[float]], row) -> list[Row]:
    """What this machine allows: the ranks without any communication, and one all-reduce alone."""
    if "alone" not in rates:
        return []
    rows = [row("alone")]
    if probes["allreduce_p50_ms"]:
        rows += [
            Row(
                "  one all-reduce of the gradients (0.3 MB) between the 2 idle ranks: median",
                Stats.of(probes["allreduce_p50_ms"]),
                "ms",
            ),
            Row(
                "  the same: 90th percentile",
                Stats.of(probes["allreduce_p90_ms"]),
                "ms",
                note="vs a ~4 ms compute step",
            ),
        ]
    return rows


def measure(
    ctx: Context,
    config: Config,
    feed: str,
    feed_data: dict[str, str],
    repeat: int,
    batches: dict[str, int],
    probes: dict[str, list[float]],
) -> float:
    """One torchrun launch of ``config``; total samples/s over the ranks."""
    sizes = ctx.sizes
    steps = config.steps or sizes.ddp_steps
    out = ctx.workdir / "ddp" / f"{config.key}-{repeat}"
    args = ["--feed", feed, "--data", feed_data[feed], "--batch", str(BATCH), "--steps", str(steps)]
    warmup = config.warmup if config.warmup is not None else sizes.ddp_warmup
    args += ["--warmup", str(warmup), "--out", str(out), *config.flags]
    launch(config.nproc, args)
    ranks = processes.read_rank_files(out)
    if len(ranks) != config.nproc:
        raise RuntimeError(f"{config.label}: expected {config.nproc} rank reports in {out}, found {len(ranks)}")
    if "--ranks" in config.flags and any(r["polls"] != (POLLING[1] in config.flags) for r in ranks):
        raise RuntimeError(
            f"{config.label}: the ranks' polling is not what the row says: {[r['setup'] for r in ranks]}"
        )
    batches[config.key] = ranks[0]["effective_batch"]
    for key in probes:
        if key in ranks[0]:
            probes[key].append(max(r[key] for r in ranks))
    return sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks)


def what_ranks_run(feed: str) -> str:
    if feed == "ddpflow":
        return "ddpflow's loader, CPU setup and training loop"
    return "the bare step on pre-sliced tensors (ddpflow's loop not there yet)"


def launch(nproc: int, args: list[str]) -> None:
    processes.run(processes.torchrun_argv(nproc, RANK, args), timeout=600)


def npz(ctx: Context) -> Path:
    """The train rows as one .npz every rank can load."""

    def build() -> Path:
        x, y = train_arrays(ctx, ctx.sizes.rows)
        path = ctx.workdir / "train.npz"
        np.savez(path, x=x.numpy(), y=y.numpy())
        return path

    return ctx.cached("npz", build)
