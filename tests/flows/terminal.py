"""A command run in a terminal, as a person runs it, for the flow tests: a pseudo-terminal (pty) is its
controlling terminal and its stdin, stdout and stderr; Ctrl-C is the key typed into the terminal, so the
terminal's line discipline sends SIGINT to the foreground process group, as it does for a person."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

from tests.flows.serve_cli import as_from_a_terminal

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor codes: a terminal shows none of them as text
COLUMNS = 400  # wide: a long log line stays one line, as it is one record


class TerminalRun:
    """``argv`` started in a new session whose controlling terminal is a fresh pty; what it printed, read."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLUMNS, 0, 0))

        def take_the_terminal() -> None:
            as_from_a_terminal()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the new session's controlling terminal: its foreground group

        self.popen = subprocess.Popen(
            argv, cwd=cwd, env={**env, "TERM": "xterm", "COLUMNS": str(COLUMNS)},
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=take_the_terminal,
        )  # fmt: skip
        os.close(slave)
        self._bytes = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.key_at: int | None = None  # where in the output Ctrl-C was typed

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                return
            if not chunk:
                return
            with self._lock:
                self._bytes.extend(chunk)

    def text(self, start: int = 0) -> str:
        with self._lock:
            raw = bytes(self._bytes[start:])
        return ANSI.sub("", raw.decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")

    def wait_for(self, marker: str, within_s: float = 300) -> None:
        deadline = time.monotonic() + within_s
        while marker not in self.text():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} within {within_s} s:\n{self.text()[-4000:]}")
            time.sleep(0.1)

    def ctrl_c(self) -> None:
        """Type Ctrl-C (the terminal's interrupt character) into the terminal."""
        with self._lock:
            self.key_at = len(self._bytes)
        os.write(self.master, termios.tcgetattr(self.master)[6][termios.VINTR])

    def finish(self, within_s: float = 60) -> int:
        code = self.popen.wait(timeout=within_s)
        self._reader.join(timeout=10)
        os.close(self.master)
        return code

    def lines_after_the_key(self) -> list[str]:
        """The lines shown from Ctrl-C on (the terminal echoes the key as ``^C`` at the start of the first)."""
        assert self.key_at is not None, "Ctrl-C was not typed"
        return [line for line in self.text(self.key_at).split("\n") if line.strip()]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
