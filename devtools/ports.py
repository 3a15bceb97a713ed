"""Free loopback ports for test servers, rendezvous endpoints and the local Slurm cluster."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (all bound at once, so no two are equal).

    Closed again before returning: a caller binds its port soon after, or another process may take it.
    """
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """One port that was free a moment ago."""
    return free_ports(1)[0]
