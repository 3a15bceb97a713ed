"""The ``ddpflow`` command: all of its argument parsing and all of its printing.

    ddpflow prepare  --config configs/demo.yaml [--set data.root=/tmp/shards] [--json]
    ddpflow run      --config configs/demo.yaml [--set train.epochs=1] [--json] [--verbose]
    ddpflow register --run-id <mlflow run id> [--config ...] [--verbose]   (re-run the registration gate)
    ddpflow sweep    --config sweep.yaml [--set sweep.trials=40] [--json] [--verbose]   (tune; docs/sweeps.md)
    ddpflow stack    up|down|status|env [--project .] [--prefect-port 4200] [--mlflow-port 5000] ...
    ddpflow serve    NAME[@alias|/version] [--port 5001] [--tracking-uri URI]   (MLflow's scoring server)
    ddpflow score    --config CFG [--model NAME@alias] [--source GLOB] [--output DIR]   (batch scoring on DDP ranks)

Each subcommand calls plain functions (``training.prepare.dataset``, the flows,
``ddpflow.services.stack``) and prints a short summary for people, or with ``--json``
one JSON object on stdout (everything else goes to stderr).

Exit status: 0 done; 1 a flow or the stack failed (the last line says which and
why); 2 a user error (``error: ...`` on the last line, said once, no traceback); 130 Ctrl-C, a cancellation:
the flow run ends Cancelled and the last line says how to resume (the first Ctrl-C lets the ranks save where they
are, a second stops at once);
128 + N when signal N ended it (SIGTERM 143, SIGHUP 129, also sent when the
parent process dies). Whatever ends it, `run` and `register` stop everything
they started first (ddpflow/lifetime.py, ddpflow/services/prefect_server.py).

`run` and `register` log everything, tracebacks included, to
``.ddpflow/logs/<command>-<time>-<pid>.log``; the console shows a user's error once
(``--verbose``: also Prefect's records of it, with the trace) (ddpflow/console.py).

`run` and `register` use ``PREFECT_API_URL`` if set, else the project's stack
if it runs (`ddpflow stack up`), else a temporary Prefect server of their own.
This module is the top of the import graph: nothing imports it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

from ddpflow.console import CommandLog
from ddpflow.launch.failure import ScriptFailed
from ddpflow.lifetime import Terminated, ended_by_signals, shielded
from ddpflow.services import stack
from ddpflow.services.prefect_server import PrefectServer, PrefectServerError, prefect_server
from flows.environment import set_local_defaults
from training.core.config import ConfigError, PipelineConfig, load_config
from training.loop.selection import describe_selection

# Errors that are the user's to fix: print the message, not a traceback.
# ConnectionError: an unreachable tracking server names its URI.
# ScriptFailed: a user's training script raised, in its own code (the last lines of its traceback are shown).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    PermissionError,
    ConnectionError,
    ScriptFailed,
)


FLOW_COMMANDS = ("run", "register", "sweep")  # the commands that run a flow: they keep a log file


class CommandFailed(Exception):
    """A flow or the stack failed: exit 1 with this message as the last line."""


# --------------------------------------------------------------------------- subcommands


def cmd_prepare(args: argparse.Namespace) -> None:
    from training.prepare.dataset import prepare_dataset

    prepared = prepare_dataset(_load(args).data)
    print_summary(prepared.summary(), args.json)


def cmd_run(args: argparse.Namespace) -> None:
    config = _load(args)  # a bad config exits 2 here, before any server starts

    def run(server: PrefectServer) -> dict[str, Any]:
        from flows.pipeline import train_pipeline  # while a temporary server starts

        _say_which_store(config)
        _log_to_file(args)
        server.wait_until_ready()
        return _run_flow(train_pipeline, config=config)

    summary = _with_prefect_server(run)
    if args.json:
        print_summary(summary, as_json=True)
        return
    print_summary(_for_people(summary), as_json=False)
    print(_where_to_look(summary))


def cmd_sweep(args: argparse.Namespace) -> None:
    from ddpflow.sweep.space import load_sweep

    sweep = load_sweep(args.config, args.overrides)  # a bad sweep section exits 2 here, before any server starts

    def run(server: PrefectServer) -> dict[str, Any]:
        from flows.sweep import sweep_pipeline

        _log_to_file(args)
        server.wait_until_ready()
        return _run_flow(sweep_pipeline, config=sweep.as_raw())

    summary = _with_prefect_server(run)
    if not args.json:
        summary = {**summary, "test_metrics": ", ".join(_metric_text(k, v, summary["test_metrics"])
                                                         for k, v in summary["test_metrics"].items())}  # fmt: skip
    print_summary(summary, args.json)


def cmd_register(args: argparse.Namespace) -> None:
    # --config replaces the run's own config; --set alone applies on top of the run's own config.
    config = _load(args) if args.config else None
    overrides = None if args.config else args.overrides

    def register(server: PrefectServer) -> dict[str, Any]:
        from flows.registration import register_finished_run

        _log_to_file(args)
        server.wait_until_ready()
        return _run_flow(register_finished_run, run_id=args.run_id, config=config, overrides=overrides)

    print_summary(_with_prefect_server(register), args.json)


def cmd_serve(args: argparse.Namespace) -> None:
    """MLflow's scoring server for a registered model, until Ctrl-C or SIGTERM (then nothing is left running)."""
    from ddpflow.services.scoring_server import ScoringServer, ScoringServerError
    from ddpflow.tracking.served_model import served_model
    from ddpflow.tracking.tracking_uri import resolve_tracking_uri

    if args.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
    tracking_uri = resolve_tracking_uri(_load(args))  # --tracking-uri, else $MLFLOW_TRACKING_URI, else the config
    model = served_model(args.model, tracking_uri)  # a missing model, alias or version: exit 2, named
    try:
        with ScoringServer(model.uri, tracking_uri, host=args.host, port=args.port) as server:
            server.wait_until_ready()
            print(_serving_note(model, server.url), flush=True)
            server.wait()
    except ScoringServerError as error:
        raise CommandFailed(str(error)) from None


def cmd_score(args: argparse.Namespace) -> None:
    """A model scores a whole table on torchrun ranks, each row once, resumable (ddpflow/scoring.py)."""
    from ddpflow.scoring import score_table, with_score_settings

    config = with_score_settings(_load(args), args.model, args.source, args.output)
    _say_which_store(config)
    summary = score_table(config, on_line=lambda line: print(line, file=sys.stderr, flush=True))
    shown = {key: value for key, value in summary.items() if key not in ("files", "source", "coverage", "rejects")}
    shown |= {"source": summary["source"]["url"], "parts": len(summary["files"])}
    if summary.get("data_drift") and not args.json:  # its line; the per-feature numbers in --json and MLflow
        shown["data_drift"] = summary["data_drift"]["message"]
    print_summary(shown, args.json)


def _say_which_store(config: PipelineConfig) -> None:
    """One line when $MLFLOW_TRACKING_URI and the config's mlflow.tracking_uri differ: the variable wins."""
    from ddpflow.tracking.tracking_uri import tracking_uri_note

    note = tracking_uri_note(config)
    if note:
        print(f"ddpflow: {note}", file=sys.stderr)


def _serving_note(model: Any, url: str) -> str:
    lines = [f"Serving {model.name} v{model.version} ({model.uri}) at {url}"]
    if model.example is not None:
        body = shlex.quote(json.dumps(model.example))
        lines.append("Score one row of its input example:")
        lines.append(f"  curl -s {url}/invocations -H 'Content-Type: application/json' -d {body}")
    lines.append("Ctrl-C stops it.")
    return "\n".join(lines)


def cmd_stack(args: argparse.Namespace) -> None:
    try:
        if args.action == "env":
            print(_export_line(stack.shell_env(args.project, state_dir=args.state_dir)))
            return
        if args.action == "up":
            state = stack.up(
                args.project,
                prefect_port=args.prefect_port,
                mlflow_port=args.mlflow_port,
                state_dir=args.state_dir,
                mlflow_dir=args.mlflow_dir,
            )
            shell = stack.shell_env(args.project, state_dir=args.state_dir)
            summary = {
                "prefect_ui": state.prefect_url,
                "mlflow_ui": state.mlflow_url,
                **{name: info["pid"] for name, info in state.processes.items()},
                **({"env": shell} if args.json else {}),
            }
            print_summary(summary, args.json)
            if not args.json:
                print(f'\nFor `prefect` in your shell (or: eval "$(ddpflow stack env)"):\n{_export_line(shell)}')
            return
        elif args.action == "down":
            summary = {"stopped": stack.down(args.project, state_dir=args.state_dir)}
        else:
            summary = stack.status(args.project, state_dir=args.state_dir)
    except stack.StackError as error:
        raise CommandFailed(str(error)) from None  # names the part that failed and its log
    print_summary(summary, args.json)


def _export_line(env: dict[str, str]) -> str:
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())


def _log_to_file(args: argparse.Namespace) -> None:
    """Once Prefect has configured logging (on import): every record to the command's log file; a user's
    error kept off the console, which says it once (unless --verbose)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    args.command_log.attach(consoles, () if args.verbose else USER_ERRORS)


def _load(args: argparse.Namespace) -> PipelineConfig:
    """The config, each input's options checked by its kind's record too (ConfigError: exit 2 before anything
    starts)."""
    from training.kinds.registry import check_inputs  # pyarrow and the kinds: only for a command with a config

    config = load_config(args.config, args.overrides)
    if config.data is not None:
        check_inputs(config.data)
    return config


def _with_prefect_server(body: Callable[[PrefectServer], dict[str, Any]]) -> dict[str, Any]:
    """Run ``body`` with a Prefect server chosen for this project; the summary says which one."""
    with prefect_server(Path.cwd()) as server:
        if server.note:
            print(f"ddpflow: {server.note}; using a temporary Prefect server", file=sys.stderr)
        try:
            summary = body(server)
        finally:
            with shielded():
                _send_prefect_backlog()
    return {**summary, **server.describe(), **_prefect_run_url(server, summary)}


def _send_prefect_backlog(timeout_s: float = 3.0) -> None:
    """Send the flow's queued logs and events while the server still runs (Prefect sends them in batches,
    and would otherwise try at exit, after a temporary server is gone: "Error logging to API")."""
    if "prefect" not in sys.modules:
        return  # the command ended before the flow was imported: nothing queued
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception as error:  # a failed send must not hide how the command ended
            print(f"ddpflow: could not send Prefect's queued {worker.__name__} items: {error}", file=sys.stderr)


def _prefect_run_url(server: PrefectServer, summary: dict[str, Any]) -> dict[str, str]:
    if server.ui_url is None or not summary.get("flow_run_id"):
        return {}  # a temporary server is gone with the command: no page to open
    return {"prefect_run_url": f"{server.ui_url}/runs/flow-run/{summary['flow_run_id']}"}


def _run_flow(flow: Any, **parameters: Any) -> dict[str, Any]:
    """Call the flow; a failure ends with one clear line (Prefect has logged the traceback). Ctrl-C cancels its
    flow run (``_cancel_flow_run``)."""
    started: list[Any] = []  # the flow run, once it runs

    def remember(flow: Any, flow_run: Any, state: Any) -> None:
        started.append(flow_run)

    try:
        return flow.with_options(on_running=[*flow.on_running_hooks, remember])(**parameters)
    except USER_ERRORS:
        raise  # printed as "error: ...", exit 2
    except KeyboardInterrupt as interrupt:
        if started:
            _cancel_flow_run(started[-1], interrupt)
        raise
    except Exception as error:
        raise CommandFailed(f"{flow.name} failed: {type(error).__name__}: {error}") from None


CTRL_C = "Ctrl-C in the terminal that ran it"


def cancel_interrupted_run(flow_run_id: UUID, message: str) -> None:
    """Mark a flow run that an interrupt stopped, and each of its task runs that did not complete, Cancelled.

    Prefect reports a KeyboardInterrupt as a crash ("Execution was aborted by an interrupt signal"); whoever
    pressed Ctrl-C meant a cancellation. Completed task runs keep their state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        for task_run in runs:
            if task_run.state is None or not task_run.state.is_completed():
                client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
        client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)


def _cancel_flow_run(flow_run: Any, interrupt: KeyboardInterrupt) -> None:
    """Ctrl-C is a cancellation: the flow run and its unfinished task runs end Cancelled, not Crashed (the state
    Prefect's engines give a run that a KeyboardInterrupt went through), while its server still runs."""
    with shielded():  # a second Ctrl-C must not leave the run half-recorded
        try:
            cancel_interrupted_run(flow_run.id, CTRL_C)
        except Exception as error:  # the server gone or busy: the run stays as Prefect left it
            print(f"ddpflow: could not mark flow run {flow_run.name!r} Cancelled: {error}", file=sys.stderr)
            return
    interrupt.cancelled_flow_run = flow_run.name  # type: ignore[attr-defined]  # said by _interrupted


# --------------------------------------------------------------------------- printing


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    for key, value in summary.items():
        print(f"{key:>18}: {value}")


def _for_people(summary: dict[str, Any]) -> dict[str, Any]:
    """The headline test metrics on one line, the accuracy with the majority class's share beside it (what always
    guessing that class scores) and counts as integers; the baselines' comparison on another line; per-class
    precision/recall stay in --json and MLflow.
    Data drift as its one-line message (the per-feature numbers are in --json and the MLflow run). What a run does
    not have (a training script's data, a rejected model's version) is left out."""
    metrics = summary.get("test_metrics") or {}
    headline = {
        name: value
        for name, value in metrics.items()
        if not re.search(r"_(precision|recall)_", name) and not name.endswith(MAJORITY_SHARE)
    }
    shown = ", ".join(_metric_text(name, value, metrics) for name, value in headline.items())
    drift = {"data_drift": summary["data_drift"].get("message")} if summary.get("data_drift") else {}
    selection = {"selection": describe_selection(summary["selection"])} if summary.get("selection") else {}
    # The model beside the reference model and the trivial baseline: "test_roc_auc 0.781 · reference 0.781 ·
    # guessing 0.500" (their full metrics are in --json and the MLflow run).
    baselines = {"baselines": (summary.get("baselines") or {}).get("comparison") or "none scored"}
    baselines = baselines if "baselines" in summary else {}
    shown_summary = {**summary, "test_metrics": shown, **baselines, **drift, **selection}
    return {key: value for key, value in shown_summary.items() if value is not None}  # e.g. a script's data


MAJORITY_SHARE = "_majority_share"  # <split>_majority_share: training/inference/evaluate.py
_COUNT = re.compile(r"_(samples|tokens|scored_rows)$")  # metrics that count rows or tokens


def _metric_text(name: str, value: Any, metrics: dict[str, Any]) -> str:
    """``name=value``: 4 significant digits, a count as an integer, an accuracy with its split's majority share."""
    if isinstance(value, float) and _COUNT.search(name) and value.is_integer():
        return f"{name}={int(value)}"
    text = f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
    share = metrics.get(name.removesuffix("_accuracy") + MAJORITY_SHARE) if name.endswith("_accuracy") else None
    return f"{text} (majority class {share:.4g})" if isinstance(share, float) else text


def _where_to_look(summary: dict[str, Any]) -> str:
    lines = [""]
    if summary.get("run_dir"):  # a skipped run (train.skip_if_unchanged) has none
        lines.append(f"Run directory (checkpoints, metrics.jsonl, model.pt): {summary['run_dir']}")
    uri = str(summary.get("tracking_uri") or "")
    if uri.startswith("sqlite:"):
        lines.append(
            f"MLflow UI on this store:  mlflow ui --backend-store-uri {uri} --workers 1   then open "
            f"{summary.get('mlflow_run_url')}"
        )
    elif summary.get("mlflow_run_url"):
        lines.append(f"MLflow run: {summary['mlflow_run_url']}")
    if summary.get("prefect_run_url"):
        lines.append(f"Prefect flow run: {summary['prefect_run_url']}")
    else:
        lines.append("Prefect: a temporary server ran this flow; `ddpflow stack up` keeps runs in a UI")
    return "\n".join(lines)


# --------------------------------------------------------------------------- parsing


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")


def _verbose_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="show the full trace of a failure here, not only in the log file"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpflow", description="Retrain PyTorch models on a schedule: prepare, train (DDP), evaluate, register."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prepare = sub.add_parser("prepare", help="raw data -> Parquet shards per split, with a manifest")
    _config_args(prepare)
    prepare.set_defaults(handler=cmd_prepare)

    run = sub.add_parser("run", help="run the whole pipeline once, locally: prepare, train (DDP), evaluate, register")
    _config_args(run)
    _verbose_arg(run)
    run.set_defaults(handler=cmd_run)

    sweep = sub.add_parser("sweep", help="tune train.* settings: one prepare, a DDP run per trial, the best one gated")
    _config_args(sweep)
    _verbose_arg(sweep)
    sweep.set_defaults(handler=cmd_sweep)

    register = sub.add_parser("register", help="re-run the registration gate for a finished MLflow run")
    register.add_argument("--run-id", required=True, help="the MLflow run id of a finished pipeline run")
    _config_args(register)
    _verbose_arg(register)
    register.set_defaults(handler=cmd_register)

    stack_parser = sub.add_parser(
        "stack",
        help="local Prefect server + worker + MLflow server on 127.0.0.1; `env`: the export line for `prefect`",
    )
    stack_parser.add_argument("action", choices=("up", "down", "status", "env"))
    stack_parser.add_argument("--project", default=".", help="project root holding prefect.yaml (default: .)")
    stack_parser.add_argument("--prefect-port", type=int, default=stack.DEFAULT_PREFECT_PORT)
    stack_parser.add_argument("--mlflow-port", type=int, default=stack.DEFAULT_MLFLOW_PORT)
    stack_parser.add_argument("--state-dir", help="default: <project>/.ddpflow")
    stack_parser.add_argument("--mlflow-dir", help="where mlflow.db and mlartifacts/ live (default: <project>)")
    stack_parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    stack_parser.set_defaults(handler=cmd_stack)

    serve = sub.add_parser("serve", help="serve a registered model over HTTP (MLflow's scoring server) until Ctrl-C")
    serve.add_argument("model", metavar="NAME[@alias|/version]", help="registered model; NAME alone: NAME@champion")
    serve.add_argument("--port", type=int, default=5001, help="default: 5001 (the stack's MLflow server has 5000)")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (0.0.0.0: reachable from others)")
    serve.add_argument("--tracking-uri", help="the registry (default: $MLFLOW_TRACKING_URI, else the config's)")
    serve.add_argument("--config", "-c", help="YAML config file (its mlflow.tracking_uri)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    serve.set_defaults(handler=cmd_serve)

    score = sub.add_parser("score", help="score a whole table with a model on torchrun ranks, each row once")
    _config_args(score)
    score.add_argument("--model", help="NAME@alias, NAME/version or a model.pt (default: score.model)")
    score.add_argument("--source", help="Parquet/CSV file, directory, glob or fsspec URL (default: score.source)")
    score.add_argument("--output", help="directory of Parquet parts + manifest.json (default: score.output)")
    score.set_defaults(handler=cmd_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status. Without ``argv`` (run as the program, from
    ``sys.argv``) the process then ends at once, without the interpreter's teardown."""
    set_local_defaults()  # before anything imports Prefect: it reads its settings once
    args = build_parser().parse_args(argv)
    status = _run_command(args)
    if argv is None:
        _end_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    log = args.command_log = CommandLog.open(Path.cwd(), args.command) if args.command in FLOW_COMMANDS else None
    with ended_by_signals():
        try:
            args.handler(args)
        except USER_ERRORS as error:
            return _fail(str(error), 2, log, error)
        except (CommandFailed, PrefectServerError) as error:
            return _fail(str(error), 1, log, error)
        except KeyboardInterrupt as error:
            return _interrupted(error, log)
        except Terminated as stop:
            return _fail(str(stop), stop.code, log, stop)
        finally:
            if log is not None:
                log.detach()
    return 0


def _fail(message: str, status: int, log: CommandLog | None = None, error: BaseException | None = None) -> int:
    """The command's last line; before it, how to resume (an interrupted run's note) and where the trace is."""
    for note in getattr(error, "__notes__", None) or []:
        print(f"ddpflow: {note}", file=sys.stderr)
    if log is not None and log.attached and error is not None:
        log.record_error(error)
        if status in (1, 2) and log.quiet:
            print(f"ddpflow: the full trace is in {log.path} (or run with --verbose)", file=sys.stderr)
    if isinstance(error, ScriptFailed):  # the script's own traceback, then the one line that says what failed
        print(error.traceback, file=sys.stderr)
        message = error.headline
    print(f"error: {message}", file=sys.stderr)
    return status


def _interrupted(error: KeyboardInterrupt, log: CommandLog | None) -> int:
    """Ctrl-C: a cancellation, not an error. What stopped, then how to go on (an interrupted run's note), last."""
    if log is not None and log.attached:
        log.record_error(error, "stopped by Ctrl-C")  # where it was, in the file only
    cancelled = getattr(error, "cancelled_flow_run", None)
    print("ddpflow: stopped by Ctrl-C" + (f"; flow run {cancelled!r} cancelled" if cancelled else ""), file=sys.stderr)
    for note in getattr(error, "__notes__", None) or []:
        print(f"ddpflow: {note}", file=sys.stderr)
    return 130


def _end_process(status: int) -> None:
    """Exit handlers (Prefect's, MLflow's), flushed streams, then ``os._exit``.

    Why: `run` has loaded torch, MLflow, Prefect, pydantic and SQLAlchemy, and the
    interpreter's teardown (a full garbage collection of all of it) took 4-7 s on
    2 cores under load, after everything the command started had stopped: time in every run,
    and a run that looks alive to whoever signalled it. Nothing is left to free that
    the kernel does not free anyway.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
