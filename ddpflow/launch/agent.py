"""torchrun's agent as ddpflow starts it: ``python -m ddpflow.launch.agent TORCHRUN_ARGS...`` runs
``torch.distributed.run``'s own ``main`` (its options, rendezvous, restarts, rank logs and exit status unchanged)
and, once it returned (every rank finished), ends the process without the interpreter's teardown.

Why: with torch loaded, tearing the agent's interpreter down takes about half a second after its ranks are gone
(a bare torchrun of 2 no-op ranks on 2 cores: ``main`` returned 0.05-0.12 s after the ranks' last line, the process
ended 0.5-0.65 s later), and ``ddpflow run``, ``ddpflow score`` and a sweep's trials wait for the agent's exit
status. A failure (an exception, an exit with a code, a signal) leaves as ``python -m torch.distributed.run``
would: through Python's own exit, with its traceback and status.
"""

from __future__ import annotations

import os
import sys

AGENT_MODULE = "ddpflow.launch.agent"


def main() -> None:
    from torch.distributed.run import main as torchrun_main

    torchrun_main()  # its arguments from sys.argv, as under ``python -m torch.distributed.run``
    # As a rank's exit (training/distributed/process.py: exit_without_teardown), without importing the rank's
    # modules into the agent: the streams flushed, then no teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
