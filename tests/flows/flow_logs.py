"""Reading a flow run's log back from the Prefect server, for the flow tests."""

from __future__ import annotations

import time


def flow_run_logs(flow_run_id: str, *needles: str, deadline_s: float = 30.0) -> str:
    """The flow run's log as the Prefect server holds it (what the UI shows), once it has every needle."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    text = ""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        text = "\n".join(log.message for log in logs)
        if all(needle in text for needle in needles):
            break
        time.sleep(0.5)  # logs reach the server in batches
    return text
