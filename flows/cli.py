"""The ``ddpflow`` command.

    ddpflow prepare --config configs/demo.yaml [--set data.root=/tmp/shards] [--json]
    ddpflow run     --config configs/demo.yaml [--set train.epochs=1] [--json]
    ddpflow register --run-id <mlflow run id> --config ...   (re-run registration)
    ddpflow stack up|down|status

Each subcommand prints a short human summary, or with ``--json`` one JSON
object. A user error exits 2 with the error as the last line, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flows.environment import set_local_defaults
from training.config import ConfigError, PipelineConfig, load_config

# Errors that are the user's to fix: print the message, not a traceback.
# ConnectionError: an unreachable tracking server (tasks.tracking.TrackingUnreachableError) names its URI.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    PermissionError,
    ConnectionError,
)


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


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.config, args.overrides)


def cmd_prepare(args: argparse.Namespace) -> dict[str, Any]:
    from training.data.prepare import prepare_dataset

    prepared = prepare_dataset(_load(args).data)
    return prepared.summary()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpflow", description="Retrain PyTorch models on a schedule: prepare, train (DDP), evaluate, register."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prepare = sub.add_parser("prepare", help="raw data -> Parquet shards per split, with a manifest")
    _config_args(prepare)
    prepare.set_defaults(handler=cmd_prepare)
    from flows.commands import SUBCOMMANDS  # here, not at the top: their modules import this one

    for add_command in SUBCOMMANDS:
        add_command(sub)
    return parser


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    for key, value in summary.items():
        print(f"{key:>18}: {value}")


def main(argv: list[str] | None = None) -> int:
    set_local_defaults()  # before anything imports Prefect: it reads its settings once
    args = build_parser().parse_args(argv)
    try:
        summary = args.handler(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if summary is not None:
        _print_summary(summary, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
