"""Process defaults for Prefect, set before Prefect is imported.

Prefect reads its settings once, at import. The ``ddpflow`` command calls
``set_local_defaults()`` first so that Prefect keeps its state inside the
project (never ``~/.prefect``), sends no telemetry, and gives a temporary
local server (ddpflow/services/prefect_server.py) enough time to start on a busy machine.
"""

from __future__ import annotations

import os
from pathlib import Path

# The temporary server needs ~15 s cold on 2 cores; Prefect's 20 s default fails under load.
# ddpflow/services/prefect_server.py reads the same variable as Prefect does.
EPHEMERAL_STARTUP_TIMEOUT_S = "90"


def set_local_defaults(project_dir: str | os.PathLike | None = None) -> None:
    """Fill in what the user has not set; never override their environment."""
    project_dir = Path(project_dir or os.getcwd())
    home = Path(os.environ.setdefault("PREFECT_HOME", str(project_dir / ".ddpflow" / "prefect"))).expanduser()
    # Prefect creates only the last level; without the parents its server fails to open its database.
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # Prefect reports it, naming the path
    # Also removes a spurious "database is locked" traceback from the telemetry service.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S)
