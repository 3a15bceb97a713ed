"""The local launcher: the train stage as torchrun on this machine (``train.launcher: local``).

    result = run_training(TrainRequest(config, dataset_dir, run_dir, on_line=print))

The preflight's data checks, RUN_DIR/config.json and the job every rank reads (stage.py),
the torchrun argv, the ranks' environment and working directory (command.py: ddpflow's trainer, or a user's
``train.script``), then supervisor.py's ``launch``
(streaming, timeouts, stall watchdog, cancellation, signals passed on to the ranks to save and stop
within ``train.preempt_grace_s``, the run-dir lock), limited by
``train.timeout_s`` and ``train.stall_timeout_s``; then the result.
"""

from __future__ import annotations

from pathlib import Path

from ddpflow.launch.command import launch_env, rank_workdir, torchrun_command
from ddpflow.launch.stage import TrainRequest, TrainResult, check_request, finished_result, write_job
from ddpflow.launch.supervisor import Preemption, launch


def run_training(request: TrainRequest) -> TrainResult:
    """Train as ``request`` says, with torchrun here; raise a LaunchError naming why not.

    ``request.on_start(layout, argv)`` is told just before torchrun starts.
    """
    config = request.config
    layout = check_request(request)  # ConfigError naming the field; nothing started yet
    run_dir = Path(request.run_dir)
    job_path = write_job(request, run_dir, request.dataset_dir)
    argv = torchrun_command(config, job_path, gpus=layout.gpus)
    env = launch_env(config, run_dir, tracking_uri=request.tracking_uri, gpus=layout.gpus, grace_s=request.grace_s)
    if request.on_start is not None:
        request.on_start(layout, argv)
    launched = launch(
        argv,
        run_dir,
        env=env,
        on_line=request.on_line,
        timeout_s=config.train.timeout_s,
        stall_timeout_s=config.train.stall_timeout_s,
        grace_s=request.grace_s,
        should_cancel=request.should_cancel,
        cancel_check_s=request.cancel_check_s,
        preemption=Preemption.for_train(config.train, layout.nproc_per_node),  # a stop signal: save, then stop
        cwd=rank_workdir(config),
        show_traceback=bool(config.train.script),  # a user's script: the traceback is the user's own code
    )
    return finished_result(config, run_dir, launched.restarts, ended="torchrun exited 0")
