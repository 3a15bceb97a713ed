"""A benchmark run's settings and scratch space: the sizes (full or ``--quick``) and the ``Context`` every family's
``run(ctx)`` gets. Everything a benchmark writes lives under the run's temporary directory and is built at most
once per run (``Context.cache``)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sizes:
    rows: int = 1_000_000
    repeats: int = 3
    # in-process training measurements: timed steps after warm-up steps
    steps: int = 400
    warmup: int = 20
    # torchrun measurements (per launch)
    ddp_steps: int = 800  # ~6 s per launch: short windows let one burst of host noise decide a repeat
    ddp_warmup: int = 30
    naive_steps: int = 15
    grad_accum: int = 4
    grad_accum_more: int = (
        8  # the headline: the accumulation this machine needs to hide its all-reduce (docs/benchmarks.md)
    )
    ddp_configs: tuple[str, ...] = (
        "one",
        "plain",
        "affinity",
        "bucket",
        "defaults",
        "poll",
        "alone",
        "accum",
        "accum_more",
        "naive",
    )
    ddp_repeats: int = 3
    memory_repeats: int = 2
    # rows for the memory and scale families
    prepare_memory_rows: tuple[int, int] = (1_000_000, 4_000_000)  # 1x and 4x the workload
    # 1x and 4x for a rank's anon memory with an image column: prepare checks and profiles every image
    # (about 1-2 ms each on 2 cores), so far fewer rows than the numeric 1x/4x
    image_anon_rows: tuple[int, int] = (25_000, 100_000)
    scale_rows: tuple[int, ...] = (250_000, 1_000_000, 4_000_000)
    orchestration_rows: int = 20_000
    orchestration_repeats: int = 2

    def with_rows(self, rows: int) -> Sizes:
        """The same run on another dataset size; the 1x/4x and scale sizes follow."""
        return replace(self, rows=rows, prepare_memory_rows=(rows, rows * 4), scale_rows=(rows // 4, rows, rows * 4))


FULL = Sizes()
QUICK = Sizes(
    rows=20_000,
    repeats=2,
    steps=20,
    warmup=3,
    ddp_steps=20,
    ddp_warmup=3,
    naive_steps=5,
    grad_accum=2,
    ddp_configs=("one", "plain", "defaults"),  # proves both rank set-ups and the headline, measures nothing
    ddp_repeats=1,
    memory_repeats=1,
    prepare_memory_rows=(5_000, 20_000),
    image_anon_rows=(200, 800),
    scale_rows=(5_000, 20_000),
    orchestration_rows=2_000,
    orchestration_repeats=1,
)


@dataclass
class Context:
    sizes: Sizes
    quick: bool
    gpu: bool
    workdir: Path
    threads: int = 1
    cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, *, quick: bool, gpu: bool, workdir: str | None = None) -> Context:
        root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ddpflow-bench-"))
        root.mkdir(parents=True, exist_ok=True)
        return cls(sizes=QUICK if quick else FULL, quick=quick, gpu=gpu, workdir=root)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]
