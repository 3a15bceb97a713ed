"""``ddpflow run`` and ``ddpflow register``: the pipeline flows, run once, here.

With no ``PREFECT_API_URL`` Prefect starts a temporary local server for the
run; with one, the run shows up on that server. Prefect's logs go to stderr,
so ``--json`` leaves stdout to the one summary object.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from flows.cli import USER_ERRORS, _config_args, _load, _print_summary


def add_run_command(sub: Any) -> None:
    parser = sub.add_parser(
        "run", help="run the whole pipeline once, locally: prepare, train (DDP), evaluate, register"
    )
    _config_args(parser)
    parser.set_defaults(handler=cmd_run)


def add_register_command(sub: Any) -> None:
    parser = sub.add_parser("register", help="re-run the registration gate for a finished MLflow run")
    parser.add_argument("--run-id", required=True, help="the MLflow run id of a finished pipeline run")
    _config_args(parser)
    parser.set_defaults(handler=cmd_register)


def cmd_run(args: argparse.Namespace) -> dict[str, Any] | None:
    config = _load(args)  # a bad config exits 2 here, before Prefect even starts
    from flows.pipeline import train_pipeline

    summary = _run_flow(train_pipeline, config=config)
    if args.json:
        return summary
    _print_summary(_for_people(summary), as_json=False)
    _print_where_to_look(summary)
    return None


def cmd_register(args: argparse.Namespace) -> dict[str, Any]:
    config = _load(args) if (args.config or args.overrides) else None
    from flows.registration import register_finished_run

    return _run_flow(register_finished_run, run_id=args.run_id, config=config)


def _run_flow(flow: Any, **parameters: Any) -> dict[str, Any]:
    """Call the flow; a failure ends with one clear line (Prefect has logged the traceback)."""
    try:
        return flow(**parameters)
    except USER_ERRORS:
        raise  # the CLI prints these as "error: ..." and exits 2
    except Exception as error:
        print(f"error: {flow.name} failed: {type(error).__name__}: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _for_people(summary: dict[str, Any]) -> dict[str, Any]:
    """The headline test metrics on one line; per-class precision/recall stay in --json and MLflow."""
    metrics = summary.get("test_metrics") or {}
    headline = {name: value for name, value in metrics.items() if not re.search(r"_(precision|recall)_", name)}
    shown = ", ".join(
        f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}" for name, value in headline.items()
    )
    return {**summary, "test_metrics": shown}


def _print_where_to_look(summary: dict[str, Any]) -> None:
    lines = [
        "",
        f"Run directory (checkpoints, metrics.jsonl, model.pt): {summary.get('run_dir')}",
    ]
    uri = str(summary.get("tracking_uri") or "")
    if uri.startswith("sqlite:"):
        lines.append(
            f"MLflow UI on this store:  mlflow ui --backend-store-uri {uri}   then open {summary.get('mlflow_run_url')}"
        )
    elif summary.get("mlflow_run_url"):
        lines.append(f"MLflow run: {summary['mlflow_run_url']}")
    print("\n".join(lines))
