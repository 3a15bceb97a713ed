"""Subcommands that flows/cli.py adds to `ddpflow`: each entry adds one subparser.

The modules behind them import Prefect only when their command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flows.pipeline_commands import add_register_command, add_run_command
from flows.stack import add_stack_command

SUBCOMMANDS: list[Callable[[Any], None]] = [add_run_command, add_register_command, add_stack_command]
