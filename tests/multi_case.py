"""Several training runs ("cases") in ONE torchrun launch: the exact-update tests' shared launches.

Why: a launch costs ~2.5 s of torchrun plus ~4 s of imports per rank before it trains a step, and an
exact-update test needs two (W ranks x b against 1 rank x W*b). Each of these runs trains for about a
second, so most of the cost was start-up. Here every case of one world size trains in one launch, one
after another, through the real ``Trainer`` of training/train.py, on the process group the launch joined
once (``Trainer`` takes a joined ``DistContext``: no seam in train.py is needed). Each case keeps its own
run directory (train_config.json, metrics.jsonl, checkpoints/, model.pt, indices/), its own seeds (the
Trainer seeds every process RNG when it builds the model) and its own log: rank r's stdout and stderr
during the case are also written to ``RUN_DIR/output-rank{r}.txt``, so a test can check what one case
printed. A test then compares its own case's files, so a failure still names the case.

How a test uses it (tests/training/test_train_ddp.py: ``EXACT_RUNS`` and the ``exact_runs`` fixture)::

    results = launch_cases(root, {"w2": (config_w2, dataset), "w2_poll": (config_poll, dataset)}, env)
    results["w2"].returncode, results["w2"].run_dir, results["w2"].output

Adding an exact-update case (images, text, long runs): add ONE entry to ``EXACT_RUNS`` per world size
(and its dataset to ``exact_datasets``); the module's three launches (W = 1, 2, 3) pick it up. What cases
of one launch must share is the launch itself (``LAUNCH_FIELDS``: ranks, backend, timeouts, threads,
restarts); ``launch_cases`` refuses cases that differ there. Not for fault tests: a case that fails
ends the launch, and the cases after it never run (their output says so).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from training.core.config import PipelineConfig

RANK_MODULE = "tests.multi_case"  # this file, run by every rank: python -m tests.multi_case --config A --config B
CASE_OUTPUT = "output-rank{rank}.txt"
REPO = Path(__file__).resolve().parents[1]
# train.* fields that belong to the launch (torchrun's argv, the environment, the process group), not a case.
LAUNCH_FIELDS = (
    "nproc_per_node", "nnodes", "max_restarts", "backend", "num_threads", "cpu_affinity",
    "collective_timeout_s", "checkpoint_timeout_s",
)  # fmt: skip


@dataclass
class CaseResult:
    """One case of a multi-case launch: the launch's exit status, the case's run directory and its output."""

    run_dir: Path
    returncode: int
    output: str


# --- the test side ------------------------------------------------------------------------------------------


def launch_cases(
    root: Path, cases: dict[str, tuple[PipelineConfig, Path]], env: dict[str, str], timeout_s: float | None = None
) -> dict[str, CaseResult]:
    """Train every case (name -> (config, dataset dir)) in one launch of the production torchrun argv;
    case ``name`` runs in ``root/name``. ``env``: what the launcher gives torchrun (``launch_env``)."""
    from ddpflow.launch.command import RANK_ENTRYPOINT, torchrun_command
    from training.core.job import TrainJob

    configs = [config for config, _ in cases.values()]
    check_one_launch(dict(zip(cases, configs)))
    job_paths = []
    for name, (config, dataset_dir) in cases.items():
        run_dir = root / name
        job = TrainJob(config=config, dataset_dir=str(dataset_dir), run_dir=str(run_dir), init_weights=None)
        job_paths.append(job.write(run_dir / "train_config.json"))
    argv = torchrun_command(configs[0], root / "train_config.json", gpus=0)
    assert argv[-4:-2] == ["-m", RANK_ENTRYPOINT], argv  # the production argv ends "-m training.train --config X"
    argv = [*argv[:-4], "-m", RANK_MODULE, *(arg for path in job_paths for arg in ("--config", str(path)))]
    timeout_s = timeout_s or 120 + 60 * len(cases)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    launch_output = done.stdout + done.stderr
    results = {}
    for name in cases:
        output = case_output(root / name, configs[0].train.nproc_per_node)
        if done.returncode != 0:  # the launch's own report (torchrun's root cause) goes with every case
            output += f"\n--- the launch of {list(cases)} failed ({done.returncode}):\n{launch_output[-4000:]}"
        results[name] = CaseResult(root / name, done.returncode, output)
    return results


def check_one_launch(configs: dict[str, PipelineConfig]) -> None:
    """Cases share the launch: every ``LAUNCH_FIELDS`` value must be the first case's."""
    (first_name, first), *rest = configs.items()
    for name, config in rest:
        for field in LAUNCH_FIELDS:
            mine, theirs = getattr(config.train, field), getattr(first.train, field)
            if mine != theirs:
                raise ValueError(
                    f"case {name!r} has train.{field}={mine!r}, case {first_name!r} {theirs!r}: cases of one "
                    f"launch share {', '.join(LAUNCH_FIELDS)}; launch it separately"
                )


def case_output(run_dir: Path, ranks: int) -> str:
    """What every rank printed during the case, rank by rank."""
    parts = []
    for rank in range(ranks):
        path = run_dir / CASE_OUTPUT.format(rank=rank)
        parts.append(path.read_text() if path.exists() else f"(rank {rank} never started this case)\n")
    return "".join(parts)


# --- the rank side ------------------------------------------------------------------------------------------


class _Tee:
    """A text stream that writes to the rank's own stream and to the case's file."""

    def __init__(self, stream: TextIO, file: TextIO):
        self._stream, self._file = stream, file

    def write(self, text: str) -> int:
        self._file.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._file.flush()
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def case_log(run_dir: Path, rank: int):
    """Rank ``rank``'s stdout and stderr also go to ``run_dir``'s CASE_OUTPUT while the case trains."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / CASE_OUTPUT.format(rank=rank), "w") as file:
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(streams[0], file), _Tee(streams[1], file)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = streams


def main(argv: list[str] | None = None) -> None:
    """Join the group once (the first case's config; ``launch_cases`` checked the others agree), then train
    each case with ``training.train``'s own Trainer and hooks."""
    from training.core.fileio import log_main
    from training.core.job import TrainJob
    from training.distributed.context import distributed
    from training.distributed.process import die_with_parent, preload_in_background
    from training.loop.hooks import hooks_from_env
    from training.train import Trainer

    preload_in_background()
    parser = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}")
    parser.add_argument("--config", action="append", required=True, help="a case's train_config.json (repeat)")
    jobs = [TrainJob.read(path) for path in parser.parse_args(argv).config]
    die_with_parent()
    with distributed(jobs[0].config.train) as ctx:
        for job in jobs:
            with case_log(Path(job.run_dir), ctx.rank):
                log_main(ctx.is_main, f"case {Path(job.run_dir).name}")
                Trainer(job, ctx, hooks_from_env(ctx.rank, job.run_dir)).train()


if __name__ == "__main__":
    from training.distributed.process import exit_without_teardown, record_root_cause

    record_root_cause(main)()  # a failing rank's traceback reaches torchrun as the root cause, as training.train's does
    exit_without_teardown()
