"""The subcommands ``flows/cli.py`` adds to ``ddpflow`` besides ``prepare``.

Each entry takes argparse's subparsers object and adds one subcommand. The
modules behind them import Prefect only when their command runs.
"""

from __future__ import annotations

from flows.pipeline_commands import add_register_command, add_run_command

SUBCOMMANDS = [add_run_command, add_register_command]
