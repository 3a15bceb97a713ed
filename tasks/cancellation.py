"""A cancelled flow run stops the ranks its task launched: the check a task hands its launcher as ``should_cancel``.

    check = flow_run_cancelled_check()          # None outside a flow run
    try:
        run_the_stage(..., should_cancel=check)
    except LaunchInterrupted as error:
        if check is not None:
            check.abort_if_fired(error)         # the task run and its flow run Cancelled, Abort raised
        raise

The launchers (local torchrun, a Slurm job: scancel) stop the ranks when the check answers a reason; the train
and score tasks use it. A flow run in a plain Python process has no worker to act on "Cancelling", so this is what
stops the ranks there; under a worker it merely gets there first (the worker's SIGTERM then finds no tree).

Ctrl-C in the terminal that runs a flow (``ddpflow run``) is a cancellation too: Prefect's engines end the runs
Crashed when a KeyboardInterrupt passes through them, and the command then records what the person meant:

    cancel_interrupted_run(flow_run_id, "Ctrl-C in the terminal")   # the flow run and its unfinished task runs
"""

from __future__ import annotations

from uuid import UUID

from prefect.context import TaskRunContext
from prefect.exceptions import Abort

__all__ = ["CANCEL_POLL_S", "FlowRunCancelled", "cancel_interrupted_run", "flow_run_cancelled_check"]

CANCEL_POLL_S = 2.0  # how often a launcher asks


class FlowRunCancelled:
    """For the launcher: a reason string once this task's flow run is being cancelled (polled every CANCEL_POLL_S)."""

    def __init__(self, flow_run_id: UUID, task_run_id: UUID):
        self.flow_run_id = flow_run_id
        self.task_run_id = task_run_id
        self.fired = False

    def __call__(self) -> str | None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception:  # the API being briefly unreachable must not stop the ranks
            return None
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self.fired = True
            return f"flow run {self.flow_run_id} was cancelled ({state.name})"
        return None

    def abort_if_fired(self, error: BaseException) -> None:
        """When this check stopped the launch: mark the runs Cancelled and raise Abort (not an ordinary exception:
        the engines then propose no Failed state that would overwrite Cancelled; the flow process just stops)."""
        if self.fired:
            self.finish_cancellation(str(error))
            raise Abort(str(error)) from error

    def finish_cancellation(self, message: str) -> None:
        """Mark this task run and its flow run Cancelled, as a worker would after killing the run.

        In a plain process nobody else would: the flow run would stay "Cancelling" forever.
        """
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        with get_client(sync_client=True) as client:
            client.set_task_run_state(self.task_run_id, Cancelled(message=message), force=True)
            state = client.read_flow_run(self.flow_run_id).state
            if state is not None and state.is_cancelling():
                client.set_flow_run_state(
                    self.flow_run_id, Cancelled(message=f"Flow run was cancelled: {message}"), force=True
                )


def flow_run_cancelled_check() -> FlowRunCancelled | None:
    """The check for the task run in progress; None outside one (a plain call: nothing to cancel it)."""
    context = TaskRunContext.get()
    if context is None or context.task_run.flow_run_id is None:
        return None
    return FlowRunCancelled(context.task_run.flow_run_id, context.task_run.id)


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
