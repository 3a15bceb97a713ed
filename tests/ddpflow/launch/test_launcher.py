"""ddpflow/launch with real torchrun launches of a stand-in rank (tests/ranks/dummy_rank.py),
and the one rule for ranks and backend (training/core/topology.py) as every user of it sees it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import DUMMY_RANK, dummy_rank_argv, is_alive, make_manifest, still_alive

import ddpflow.launch.command
from ddpflow.launch.command import launch_env, torchrun_command
from ddpflow.launch.failure import LaunchStalled, LaunchTimeout, RankFailed, failure_from_output
from ddpflow.launch.supervisor import launch
from training.core import topology
from training.core.config import ConfigError, PipelineConfig
from training.core.manifest import read_manifest
from training.distributed import context as distributed
from training.preflight import check_data, check_machine

RUN_LAUNCHER = Path(__file__).resolve().parents[2] / "ranks" / "run_launcher.py"


def config(**train) -> PipelineConfig:
    return PipelineConfig.model_validate({"train": train})


# ----------------------------------------------------------------------------- argv, env


def test_one_node_argv_is_a_list_with_standalone_and_the_rank_module(tmp_path):
    argv = torchrun_command(config(max_restarts=2), tmp_path / "train_config.json", gpus=0)
    assert argv[:3] == [sys.executable, "-m", "ddpflow.launch.agent"]  # torch.distributed.run's main
    assert "--standalone" in argv and "--rdzv-endpoint" not in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "1"  # auto on CPU: one rank
    assert argv[argv.index("--max-restarts") + 1] == "2"
    assert argv[-4:] == ["-m", "training.train", "--config", str(tmp_path / "train_config.json")]
    assert all(isinstance(part, str) for part in argv)


def test_several_nodes_argv_names_the_rendezvous(tmp_path):
    cfg = config(
        nnodes=3, node_rank=2, rdzv_endpoint="head:29400", rdzv_id="job-7", nproc_per_node="auto", backend="nccl"
    )
    argv = torchrun_command(cfg, tmp_path / "job.json", gpus=4)
    assert "--standalone" not in argv
    pairs = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--nnodes"] == "3" and pairs["--node-rank"] == "2"
    assert (
        pairs["--rdzv-backend"] == "c10d" and pairs["--rdzv-endpoint"] == "head:29400" and pairs["--rdzv-id"] == "job-7"
    )
    assert pairs["--nproc-per-node"] == "4"  # auto: one per GPU


def test_environment_sets_threads_unbuffered_mlflow_and_error_file(tmp_path):
    env = launch_env(config(nproc_per_node=1), tmp_path, tracking_uri="sqlite:///x.db", gpus=0, base={})
    assert env["PYTHONUNBUFFERED"] == "1"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert env["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"
    assert Path(env["TORCHELASTIC_ERROR_FILE"]).parent == tmp_path
    assert int(launch_env(config(num_threads=3), tmp_path, gpus=0, base={})["OMP_NUM_THREADS"]) == 3


def test_a_fresh_rendezvous_store_per_round_only_where_torchrun_can_restart(tmp_path):
    """pytorch/pytorch#135712: a restarted round that shares the agent's store can read a dead peer's address (a
    user's script meets it on one node: tests/flows/test_scripts.py, the killed rank). A fresh store per round,
    which costs every start, is asked for only where torchrun can restart (batch scoring's launches cannot)."""
    several = {"nnodes": 2, "rdzv_endpoint": "head:29400"}
    trains = ({"max_restarts": 3}, {"max_restarts": 0}, {**several, "max_restarts": 0}, {**several, "max_restarts": 1})
    fresh = [launch_env(config(**train), tmp_path, gpus=0, base={}).get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
             for train in trains]  # fmt: skip
    assert fresh == ["1", None, None, "1"]


# ----------------------------------------------------------------------------- one rule for ranks and backend


@pytest.mark.parametrize(
    ("train", "gpus", "ranks", "backend"),
    [
        ({}, 0, 1, "gloo"),  # auto on CPU: one rank
        ({}, 4, 4, "nccl"),  # auto with GPUs: one per GPU, NCCL
        ({"backend": "gloo"}, 4, 4, "gloo"),  # gloo with GPUs: still one rank per GPU (each rank takes one)
        ({"backend": "gloo", "nproc_per_node": 2}, 0, 2, "gloo"),
        ({"backend": "nccl", "nproc_per_node": 2}, 4, 2, "nccl"),
        ({"nnodes": 2, "rdzv_endpoint": "head:29400"}, 8, 8, "nccl"),
    ],
)
def test_the_preflight_the_argv_and_the_environment_resolve_ranks_alike(tmp_path, train, gpus, ranks, backend):
    cfg = config(**train)
    layout = check_machine(cfg, gpus=gpus)  # what the preflight checks, and the MLflow ddp.* tags show
    assert (layout.nproc_per_node, layout.backend) == (ranks, backend)
    assert layout.world_size == ranks * cfg.train.nnodes
    argv = torchrun_command(cfg, tmp_path / "job.json", gpus=gpus)  # what torchrun starts
    assert argv[argv.index("--nproc-per-node") + 1] == str(ranks)
    assert_threads_share_the_cores(cfg, ranks, gpus, tmp_path)


def assert_threads_share_the_cores(cfg: PipelineConfig, ranks: int, gpus: int, run_dir: Path) -> None:
    """The node's ranks together use its cores: none oversubscribed (unless there are fewer cores than
    ranks: one thread each), and no more than one rank's share left idle."""
    threads = int(launch_env(cfg, run_dir, gpus=gpus, base={})["OMP_NUM_THREADS"])
    cores = topology.available_cores()
    assert threads >= 1
    if cores >= ranks:
        assert threads * ranks <= cores < (threads + 1) * ranks, (threads, ranks, cores)
    else:
        assert threads == 1


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 64])
def test_each_local_rank_gets_its_share_of_the_cores_the_process_may_use(monkeypatch, tmp_path, cores):
    """The share follows the cores this process may run on (affinity, cgroup), not the machine's count."""
    monkeypatch.setattr(topology, "available_cores", lambda: cores)
    monkeypatch.setattr(ddpflow.launch.command, "available_cores", lambda: cores)
    for ranks in (1, 2, 4):
        assert_threads_share_the_cores(config(nproc_per_node=ranks), ranks, 0, tmp_path)


def test_more_gloo_ranks_than_gpus_are_rejected_before_they_start():
    """Each rank takes GPU LOCAL_RANK whatever the backend, so GPUs are what a GPU machine counts."""
    with pytest.raises(ConfigError, match=r"train\.nproc_per_node: 3 ranks asked for, but this machine has 2 GPUs"):
        check_machine(config(backend="gloo", nproc_per_node=3), gpus=2)
    assert check_machine(config(backend="gloo", nproc_per_node=2), gpus=2).nproc_per_node == 2


def test_the_rank_resolves_its_backend_as_the_preflight_did_on_this_machine():
    """training/distributed/context.py (the rank's side) starts the backend the launcher resolved, and refuses
    NCCL without GPUs with the preflight's own message."""
    gpus = topology.visible_gpus()
    assert distributed.resolve_backend("auto") == ("nccl" if gpus else "gloo")
    assert distributed.resolve_backend("gloo") == "gloo"
    if gpus == 0:
        with pytest.raises(ConfigError, match=r"train\.backend: 'nccl' needs CUDA GPUs") as on_rank:
            distributed.resolve_backend("nccl")
        with pytest.raises(ConfigError) as in_preflight:
            check_machine(config(backend="nccl"), gpus=gpus)
        assert str(on_rank.value) == str(in_preflight.value)
    else:
        assert distributed.resolve_backend("nccl") == "nccl"


def test_the_gpus_are_counted_as_torch_counts_them_and_without_torch_where_no_gpu_driver_is():
    """``visible_gpus`` answers torch.cuda's count; on a Linux machine with no GPU driver's node it answers 0
    without importing torch (a `ddpflow score` starts torchrun before it pays for torch)."""
    probe = ("import sys; from training.core.topology import visible_gpus; gpus = visible_gpus(); "
             "print(gpus, 'torch' in sys.modules); import torch; "
             "print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    (counted, imported), (torch_counts,) = (line.split() for line in done.stdout.splitlines())
    assert counted == torch_counts
    no_driver = sys.platform == "linux" and not any(os.path.exists(node) for node in topology.GPU_DRIVER_NODES)
    assert imported == str(not no_driver), done.stdout


# ----------------------------------------------------------------------------- preflight


@pytest.mark.parametrize(
    ("train", "field"),
    [
        ({"nproc_per_node": 10_000}, "train.nproc_per_node"),
        ({"backend": "nccl"}, "train.backend"),
        ({"model": "no_such_package.models:factory"}, "train.model"),
    ],
)
def test_the_machine_check_rejects_what_cannot_run_and_names_the_field(train, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_machine(config(**train), gpus=0)


def test_the_data_check_rejects_a_batch_larger_than_a_ranks_share(tmp_path):
    manifest = read_manifest(make_manifest(tmp_path / "abc123", train_rows=1000))
    two_ranks = check_machine(config(nproc_per_node=2), gpus=0)
    with pytest.raises(ConfigError, match=r"train\.batch_size: 600 .*\(1000 rows / 2 ranks = 500\)"):
        check_data(config(batch_size=600, nproc_per_node=2), manifest, two_ranks)
    check_data(config(batch_size=500, nproc_per_node=2), manifest, two_ranks)  # fits: no error
    with pytest.raises(ConfigError, match=r"train\.model_kwargs"):
        check_data(config(batch_size=10, model_kwargs={"no_such_argument": 1}), manifest, two_ranks)


# ----------------------------------------------------------------------------- the train stage's contract


def test_every_train_launcher_choice_has_one_launcher_that_takes_the_request():
    import inspect
    import typing

    from ddpflow.launch.stage import LAUNCHERS, TrainRequest, launcher_for
    from training.core.config import TrainConfig

    choices = typing.get_args(TrainConfig.model_fields["launcher"].annotation)
    assert sorted(LAUNCHERS) == sorted(choices), "train.launcher's choices and LAUNCHERS must name the same launchers"
    for name in choices:
        launcher = launcher_for(config(launcher=name, nnodes=1))
        [parameter] = inspect.signature(launcher).parameters.values()
        assert parameter.annotation in (TrainRequest, "TrainRequest"), (name, parameter)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TrainRequest(config(), "data", "run").run_dir = "elsewhere"


@pytest.mark.torchrun
def test_the_local_launcher_runs_the_request_and_tells_its_start(tmp_path, monkeypatch):
    from ddpflow.launch.stage import TrainRequest, run_train_stage

    monkeypatch.setattr(ddpflow.launch.command, "RANK_ENTRYPOINT", str(DUMMY_RANK))
    started, lines = [], []
    request = TrainRequest(
        config(nproc_per_node=2, batch_size=10, epochs=2),
        make_manifest(tmp_path / "fp123"),
        tmp_path / "run",
        on_line=lines.append,
        on_start=lambda layout, argv: started.append((layout.world_size, argv)),
    )
    result = run_train_stage(request)
    [(world_size, argv)] = started
    assert world_size == 2 and argv[-2:] == ["--config", str(tmp_path / "run" / "train_config.json")]
    assert result.metrics == {"epoch": 1, "val_loss": 0.5, "world_size": 2} and result.restarts == 0
    assert result.model_path == str(tmp_path / "run" / "model.pt")
    assert {line.rank for line in lines if line.text.endswith(" done")} == {0, 1}


def test_a_launch_that_ended_well_without_a_model_is_not_a_result(tmp_path):
    from ddpflow.launch.stage import finished_result

    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n')  # ranks that ended well, before model.pt
    with pytest.raises(RuntimeError, match=r"torchrun exited 0 but wrote no .*model\.pt: training did not finish"):
        finished_result(PipelineConfig(), tmp_path, restarts=0, ended="torchrun exited 0")
    (tmp_path / "model.pt").write_bytes(b"weights")
    assert finished_result(PipelineConfig(), tmp_path, restarts=1, ended="torchrun exited 0").metrics == {"epoch": 0}


# ----------------------------------------------------------------------------- launching


def torchrun_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "torchrun.pid").read_text())["torchrun_pid"]


@pytest.mark.torchrun
def test_lines_stream_while_torchrun_runs_labelled_by_rank(tmp_path):
    seen = []

    def on_line(line):
        # Record, for each line, whether torchrun was still running when it arrived.
        seen.append(
            (
                line,
                psutil.pid_exists(torchrun_pid(tmp_path))
                and psutil.Process(torchrun_pid(tmp_path)).status() != psutil.STATUS_ZOMBIE,
            )
        )

    result = launch(dummy_rank_argv(tmp_path, "--lines", "6", "--interval", "0.3"), tmp_path, on_line=on_line)
    rank_lines = [(line, alive) for line, alive in seen if line.rank is not None]
    assert result.returncode == 0 and result.restarts == 0
    assert {line.rank for line, _ in rank_lines} == {0, 1}
    first_line, torchrun_alive = rank_lines[0]
    assert torchrun_alive, f"the first rank line {first_line} only arrived after torchrun had exited"
    assert str(first_line).startswith(f"[rank {first_line.rank}] ")


@pytest.mark.torchrun
def test_a_rank_that_raises_fails_with_its_rank_exit_code_and_exception(tmp_path):
    with pytest.raises(RankFailed) as caught:
        launch(dummy_rank_argv(tmp_path, "--mode", "raise", "--fail-rank", "1"), tmp_path, on_line=lambda line: None)
    error = caught.value
    assert error.rank == 1 and error.exitcode == 1
    assert "ValueError: dummy failure on rank 1" in str(error) and "rank 1" in str(error)


@pytest.mark.torchrun
def test_a_restart_is_counted_and_the_second_attempt_succeeds(tmp_path):
    result = launch(dummy_rank_argv(tmp_path, "--mode", "flaky", max_restarts=1), tmp_path, on_line=lambda line: None)
    assert result.returncode == 0 and result.restarts == 1


@pytest.mark.torchrun
def test_timeout_kills_the_tree_even_a_rank_that_ignores_sigterm(tmp_path):
    stubborn = []
    on_line = lambda line: stubborn.append(line.rank) if "ignores SIGTERM" in line.text else None  # noqa: E731
    # 12 s: room for torchrun and both ranks to start on a loaded machine before the limit hits.
    with pytest.raises(LaunchTimeout, match=r"train\.timeout_s=12s") as caught:
        launch(
            dummy_rank_argv(tmp_path, "--mode", "stubborn", "--lines", "1"),
            tmp_path,
            on_line=on_line,
            timeout_s=12,
            grace_s=1,
        )
    assert sorted(stubborn) == [0, 1], "both ranks must have been running (and ignoring SIGTERM) when the limit hit"
    pids = json.loads((tmp_path / "torchrun.pid").read_text())["descendants"]
    assert len(pids) >= 3, pids  # torchrun + two ranks were recorded
    assert still_alive(pids, within_s=5) == []
    assert "killed torchrun and its ranks" in str(caught.value)


@pytest.mark.torchrun
def test_stall_watchdog_kills_a_silent_run(tmp_path):
    # The ranks print, then go silent; 8 s also covers a slow, silent torchrun start-up.
    with pytest.raises(LaunchStalled, match=r"train\.stall_timeout_s=8s"):
        launch(
            dummy_rank_argv(tmp_path, "--mode", "hang", "--lines", "1"),
            tmp_path,
            on_line=lambda line: None,
            stall_timeout_s=8,
            grace_s=1,
        )
    pids = json.loads((tmp_path / "torchrun.pid").read_text())["descendants"]
    assert still_alive(pids, within_s=5) == []


# ----------------------------------------------------------------------------- signals to the launching process


@pytest.fixture
def leftovers():
    """PIDs a test started; whatever a failing test left alive is SIGKILLed at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_launcher(
    run_dir: Path, *rank_args: str, thread: str | None = None, leftovers: list[int], option: str | None = None
) -> tuple[subprocess.Popen, list[int]]:
    """A python process running launch(); returns it once torchrun, both ranks and their children are up.
    ``thread``, ``option``: run_launcher.py's options."""
    options = [str(run_dir)] + [extra for extra in (thread, option) if extra]
    proc = subprocess.Popen(
        [sys.executable, str(RUN_LAUNCHER), *options, "--", *rank_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = 0
    assert proc.stdout is not None
    for line in proc.stdout:  # the ranks announce themselves (and, in spawn mode, their child)
        if "spawned a child" in line or ("step 0" in line and "spawn" not in rank_args):
            ready += 1
        if ready == 2:
            break
    assert ready == 2, "the ranks never started"
    tree = psutil.Process(torchrun_pid(run_dir)).children(recursive=True)
    ranks = [p.pid for p in tree]
    # Children that left the rank's session are no longer below torchrun: find them by parent.
    spawned = [child.pid for pid in ranks for child in psutil.Process(pid).children(recursive=True)]
    pids = [torchrun_pid(run_dir), *ranks, *spawned]
    leftovers += [proc.pid, *pids]
    return proc, pids


@pytest.mark.torchrun
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_kills_every_process_of_the_run(tmp_path, sig, leftovers):
    proc, pids = start_launcher(tmp_path, "--mode", "spawn", "--lines", "1", leftovers=leftovers)
    assert len(pids) >= 5, pids  # torchrun, 2 ranks, 2 grandchildren in their own sessions
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert still_alive(pids) == [], output


GRACE_S = 6.0


@pytest.mark.torchrun
@pytest.mark.parametrize("second_signal", [True, False], ids=["second-signal", "grace-passes"])
def test_a_stop_signal_goes_to_the_ranks_and_a_second_one_or_the_grace_kills_them(tmp_path, second_signal, leftovers):
    """With a Preemption (the local launcher's), a first SIGTERM is passed on to ranks that catch it, which then
    save and exit (training/loop/preemption.py); these never end: a second signal kills them at once, or they are
    killed once train.preempt_grace_s has passed. Either way nothing is left."""
    proc, pids = start_launcher(
        tmp_path, "--mode", "preemptible", "--lines", "1", option=f"--preempt-grace={GRACE_S:g}", leftovers=leftovers
    )
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    told = set()
    for line in proc.stdout:
        told |= {rank for rank in (0, 1) if f"rank {rank} got SIGTERM" in line}
        if len(told) == 2:
            break
    assert told == {0, 1}, "the signal was not passed on to both ranks"
    assert still_alive(pids, within_s=0) == pids, "the first signal killed the ranks"
    if second_signal:
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    took_s = time.monotonic() - sent
    assert still_alive(pids) == []
    assert proc.returncode == -signal.SIGTERM  # the held signal's default action, once the tree was gone
    assert (took_s < GRACE_S) if second_signal else (took_s >= GRACE_S), took_s


@pytest.mark.torchrun
def test_sigkill_of_the_launcher_still_takes_torchrun_and_ranks_down(tmp_path, leftovers):
    """Prefect's worker escalates to SIGKILL: PR_SET_PDEATHSIG makes torchrun stop its ranks."""
    proc, pids = start_launcher(tmp_path, "--mode", "hang", "--lines", "1", leftovers=leftovers)
    proc.kill()
    proc.wait(timeout=30)
    assert still_alive(pids) == []


@pytest.mark.torchrun
def test_launcher_in_a_worker_thread_dies_with_its_process(tmp_path, leftovers):
    """No signal handler can be set off the main thread: SIGTERM kills the process, PDEATHSIG does the rest."""
    proc, pids = start_launcher(tmp_path, "--mode", "hang", "--lines", "1", thread="--thread", leftovers=leftovers)
    proc.terminate()
    proc.wait(timeout=30)
    assert still_alive(pids) == []


@pytest.mark.torchrun
def test_launcher_in_a_worker_thread_stops_the_tree_when_the_main_thread_ends(tmp_path, leftovers):
    """Interpreter shutdown would wait for the worker thread (and torchrun) forever; the launcher notices it instead."""
    proc, pids = start_launcher(
        tmp_path, "--mode", "hang", "--lines", "1", thread="--orphan-thread", leftovers=leftovers
    )
    output, _ = proc.communicate(timeout=60)  # without the check: blocked for the rank's 600 s sleep
    assert "LAUNCH-ERROR: the launching process is shutting down" in output, output
    assert still_alive(pids) == []


@pytest.mark.torchrun
def test_an_nccl_watchdog_abort_is_reported_as_the_collective_timeout_of_the_cpu_path(tmp_path):
    """On GPUs a collective timeout kills the rank with SIGABRT and no Python exception: the launcher
    reads NCCL's watchdog text in the rank's log and names the setting and the rank, as on CPU."""
    with pytest.raises(RankFailed) as caught:
        launch(
            dummy_rank_argv(tmp_path, "--mode", "nccl-timeout", "--fail-rank", "1", "--lines", "1"),
            tmp_path,
            on_line=lambda line: None,
            grace_s=2,
        )
    error = caught.value
    assert error.rank == 1 and error.exitcode == -6  # SIGABRT
    assert str(error).startswith(
        "rank 1 failed with exit code -6: CollectiveTimeout: rank 1: a collective timed out after "
        "train.collective_timeout_s=10s waiting for another rank (it stalled or died)"
    ), error
    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE" in str(error)
    assert error.log_file is not None and "Watchdog caught" in Path(error.log_file).read_text()
    pids = json.loads((tmp_path / "torchrun.pid").read_text())["descendants"]
    assert still_alive(pids, within_s=10) == []  # the stalled peer was stopped too


def test_a_rank_that_only_lost_its_peer_is_not_blamed(tmp_path):
    """torchrun's timestamps are whole seconds: when both ranks fail in the same second it can
    blame the rank whose gloo connection closed. The launcher names the rank with the real error."""
    attempt = tmp_path / "logs" / "job" / "attempt_0"
    messages = {
        0: "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234",
        1: "RuntimeError: injected fault (DDPFLOW_FAULT) at rank 1 epoch 1 step 2",
    }
    for local_rank, message in messages.items():
        (attempt / str(local_rank)).mkdir(parents=True)
        (attempt / str(local_rank) / "error.json").write_text(
            json.dumps({"message": {"message": message, "extraInfo": {}}})
        )
    tail = [
        "Root Cause (first observed failure):",
        "  time      : 2026-11-29_20:24:58",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -6 (pid: 2617)  (SIGABRT)",
        f"  error_file: {attempt / '0' / 'error.json'}",
    ]
    error = failure_from_output(tmp_path, attempt.parent, tail, returncode=1)
    assert error.rank == 1
    assert "injected fault" in str(error) and str(error).startswith("rank 1 failed")

    # A genuine error on the blamed rank is kept as torchrun reported it.
    (attempt / "0" / "error.json").write_text(
        json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {}}})
    )
    error = failure_from_output(tmp_path, attempt.parent, tail, returncode=1)
    assert error.rank == 0 and "bad batch" in str(error)


def test_a_script_rank_that_aborted_on_its_lost_peer_is_not_blamed(tmp_path):
    """A user's script writes no error file, and a rank whose gloo pair closed under a collective aborts (SIGABRT,
    no error file either): the ranks' logs say whose error is its own, and torchrun's list of failures its code."""
    attempt = tmp_path / "logs" / "job" / "attempt_0"
    logs = {
        0: "terminate called after throwing an instance of 'gloo::IoException'\n"
        "  what():  [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: Connection reset by peer\n"
        "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\n",
        1: 'Traceback (most recent call last):\n  File "failing.py", line 9, in <module>\n'
        "    raise ValueError('bad batch in epoch 1')\nValueError: bad batch in epoch 1\n",
    }
    for local_rank, text in logs.items():
        (attempt / str(local_rank)).mkdir(parents=True)
        (attempt / str(local_rank) / "stderr.log").write_text(text)
    tail = [
        "Failures:",
        "[1]:",
        "  time      : 2026-12-07_00:37:21",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 2618)",
        "  error_file: <N/A>",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-07_00:37:21",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -6 (pid: 2617)",
        "  error_file: <N/A>",
    ]
    error = failure_from_output(tmp_path, attempt.parent, tail, returncode=1, show_traceback=True)
    assert (error.rank, error.exitcode) == (1, 1)
    assert str(error).startswith(
        f"rank 1 failed with exit code 1: ValueError: bad batch in epoch 1 (its log: {attempt / '1' / 'stderr.log'})"
        "; torchrun first saw rank 0 exit with code -6, after it lost this peer"
    ), str(error)
    assert error.traceback.endswith("ValueError: bad batch in epoch 1")
    # torchrun's shutdown may stop the rank while it is still exiting: its own error still exits 1.
    stopped = [text.replace("exitcode  : 1 (pid: 2618)", "exitcode  : -15 (pid: 2618)") for text in tail]
    error = failure_from_output(tmp_path, attempt.parent, stopped, returncode=1, show_traceback=True)
    assert (error.rank, error.exitcode) == (1, 1) and str(error).startswith(
        "rank 1 failed with exit code 1: ValueError"
    )
