"""``python -m bench``: run ddpflow's benchmarks, write results.json, regenerate docs/benchmarks.md.

    python -m bench                  # full run (~10 min on 2 cores): bench/results.json + docs/benchmarks.md
    python -m bench --quick          # smoke run on tiny sizes: bench/results-quick.json, docs untouched
    python -m bench --only datapath,ddp --repeats 5
    python -m bench --only real_tables  # public tables beside boosting (the bench extra); only when named
    python -m bench --quick --gpu    # smoke run plus the CUDA figures (bf16, nccl) on a GPU machine
    python -m bench --profile scoring --rows 200000   # one repeat under py-spy: bench/profiles/scoring.{txt,md}

A benchmark that breaks is recorded as an error and the others still run; the
exit status is 0 unless the arguments are wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path

from bench.harness.context import Context
from bench.harness.machine import machine_info
from bench.harness.report import render_docs
from bench.harness.results import REPO_ROOT, Result, log, run_guarded, write_results

# name -> title; run in this order. Family NAME is the module bench/families/NAME.py, with run(ctx) -> list[Result].
FAMILIES = {
    "datapath": "Data path",
    "ddp": "DDP scaling",
    "prepare": "Prepare and shards",
    "memory": "Memory",
    "checkpoint": "Step checkpoints",
    "evaluate": "Evaluate",
    "launch": "Launch and orchestration",
    "scripts": "Your own script",  # a training script under ddpflow run against a bare torchrun
    "slurm": "Launch through Slurm",  # skipped (recorded as such) without Slurm
    "scale": "Scale",
    "images": "Images",
    "text": "Text",
    "tables": "Tables beside boosting",  # ddpflow's default model against HistGradientBoosting
    "real_tables": "Real tables beside boosting",  # public tables shipped in packages (the bench extra); --only
    "scoring": "Batch scoring",  # ddpflow score on 2 ranks against the pyfunc in one process
    "stream": "Streaming from object storage",  # data.stream from moto's S3 server against the node cache
    "gpu": "GPU",  # skipped (recorded as such) without CUDA
}


# Run only when named (--only): real_tables fits 15 tables at 3 seeds and RealMLP beside them (over an hour on 2
# shared cores).
ONLY_WHEN_NAMED = ("real_tables",)


def family_module(name: str) -> str:
    return f"bench.families.{name}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 2 repeats, fewer DDP configurations: proves the harness works, measures nothing",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="also run the CUDA benchmarks (bf16, nccl); by default they run only where CUDA is",
    )
    parser.add_argument("--only", default="", help=f"comma-separated families: {', '.join(FAMILIES)}")
    parser.add_argument("--repeats", type=int, help="override the number of repeats")
    parser.add_argument(
        "--rows",
        type=int,
        help="dataset rows (default 1M; prepare memory uses rows and 4 x rows, scale rows/4, rows, 4 x rows)",
    )
    parser.add_argument(
        "--out", type=Path, help="results file (default bench/results.json, or bench/results-quick.json with --quick)"
    )
    parser.add_argument(
        "--docs", type=Path, help="markdown file whose tables to regenerate (default docs/benchmarks.md on a full run)"
    )
    parser.add_argument("--no-docs", action="store_true", help="leave the docs alone")
    parser.add_argument("--workdir", help="where to put generated data (default: a temp dir, removed afterwards)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument(
        "--profile",
        metavar="FAMILY",
        help="run one repeat of FAMILY under py-spy (every process it starts) into --profile-dir: FAMILY.txt "
        "(collapsed stacks) and FAMILY.md (where the CPU went, per process); results and docs untouched",
    )
    parser.add_argument("--profile-dir", type=Path, default=REPO_ROOT / "bench" / "profiles")
    args = parser.parse_args(argv)
    if args.profile and args.profile not in FAMILIES:
        parser.error(f"--profile: unknown family {args.profile!r}; known: {', '.join(FAMILIES)}")
    # The GPU family runs by default where CUDA is, and wherever --gpu asks for it; ONLY_WHEN_NAMED when named.
    args.families = [name.strip() for name in args.only.split(",") if name.strip()] or [
        name for name in FAMILIES if (name != "gpu" or _has_cuda()) and name not in ONLY_WHEN_NAMED
    ]
    if args.gpu and "gpu" not in args.families:
        args.families.append("gpu")
    unknown = [name for name in args.families if name not in FAMILIES]
    if unknown:
        parser.error(f"--only: unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.rows is not None and args.rows < 4_000:
        parser.error("--rows must be >= 4000")
    return args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        from bench.harness.profile import profile_family

        forwarded = [*(["--quick"] if args.quick else []), *(["--rows", str(args.rows)] if args.rows else [])]
        profile_family(args.profile, forwarded, args.profile_dir)
        return 0
    # Ranks and in-process loops each use one thread; set before torch starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    started = time.time()
    ctx = Context.create(quick=args.quick, gpu=args.gpu, workdir=args.workdir)
    if args.repeats:
        ctx.sizes = dataclasses.replace(ctx.sizes, repeats=args.repeats, ddp_repeats=args.repeats)
    if args.rows:
        ctx.sizes = ctx.sizes.with_rows(args.rows)
    machine = machine_info()
    out = args.out or REPO_ROOT / "bench" / ("results-quick.json" if args.quick else "results.json")
    docs = None if args.no_docs else args.docs or (None if args.quick else REPO_ROOT / "docs" / "benchmarks.md")
    log(f"{'quick' if args.quick else 'full'} run of {', '.join(args.families)}; data in {ctx.workdir}")
    kept = earlier_benchmarks(out, "quick" if args.quick else "full", args.families)
    results: list[Result] = []
    try:
        for name in args.families:
            module_name, title = family_module(name), FAMILIES[name]
            log(f"--- {title}")
            results += run_guarded(name, title, lambda module=module_name: importlib.import_module(module).run(ctx))
            for result in results[-1:]:
                log(f"{result.title}: {result.status} {result.ratio.fmt() if result.ratio else result.reason}")
            machine["load_average_end"] = list(os.getloadavg())
            write_results(
                out,
                mode="quick" if args.quick else "full",
                machine=machine,
                results=results,
                started=started,
                argv=sys.argv[1:] if argv is None else list(argv),
                kept=kept,
                order=list(FAMILIES),
            )
    finally:
        if not args.keep:
            ctx.cleanup()
    payload = _read(out)
    if docs:
        render_docs(payload, docs, args.families)
        log(f"docs regenerated: {docs}")
    log(f"results: {out} ({payload['wall_s']:.0f} s)")
    for bench in payload["benchmarks"]:
        ratio = bench["ratio"]
        shown = f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})" if ratio else bench["status"]
        print(f"{bench['title']:<40} {shown:<28} target {bench['target_text']:<8} met={bench['met']}")
    return 0


def earlier_benchmarks(out: Path, mode: str, families: list[str]) -> list[dict]:
    """With --only, the other families' results of the last run of the same mode stay in results.json."""
    if not out.exists():
        return []
    try:
        earlier = _read(out)
    except (OSError, ValueError):
        return []
    if earlier.get("mode") != mode:
        return []
    kept = [bench for bench in earlier.get("benchmarks", []) if bench.get("family") not in families]
    for bench in kept:
        bench.setdefault("measured_at", earlier.get("started_at", ""))
    return kept


def _read(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


if __name__ == "__main__":
    sys.exit(main())
