"""The shell commands a doc tells a person to type, run as written on a fresh copy of the checkout, in order.

    blocks = shell_blocks(REPO / "README.md")        # every ```bash / ```sh / ```shell / ```console fence
    session = DocShell(fresh_checkout(tmp), env)     # one shell's state carried from command to command
    session.run_all(blocks)                          # stops at the first command that fails

What a person's shell would carry (``. .venv/bin/activate``, ``eval "$(ddpflow stack env)"``, a ``cd``) is carried:
each command runs in ``bash -c`` and its environment and directory are read back after it. A command a person
leaves running in one terminal (``ddpflow serve``, ``mlflow ui``) runs in the background until its section of the doc
ends, then gets Ctrl-C, as a person would press it.

What the test changes, and why (nothing else):
- the ports: a free one for ``ddpflow serve``, ``mlflow ui`` and the stack's two servers, given as the command's
  own option and replaced in the URLs of later commands (``127.0.0.1:5001``): the suite's workers, and other
  checkouts on the machine, must not collide on the defaults;
- ``make TARGET`` runs with ``-o .venv/.ddpflow-installed``: the checkout's ``.venv`` is the suite's own
  environment (linked), never rebuilt or reinstalled by a test;
- ``PREFECT_API_URL`` is the session's Prefect harness until a command brings up the stack: each ``ddpflow run``
  would otherwise start and stop a temporary server (tests/flows/test_run_cli.py covers that path).

A fence preceded by ``<!-- not run by the docs test: REASON -->`` is not run; the reason says why (it needs a
cluster or a GPU, or it is this suite itself), and the test reports it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ddpflow.services.stack import http_ok
from devtools.ports import free_port
from tests.flows.cli_runs import cli_env
from tests.flows.serve_cli import as_from_a_terminal

REPO = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell", "console")
NOT_RUN = re.compile(r"<!--\s*not run by the docs test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
STAMP = ".venv/.ddpflow-installed"
COMMAND_TIMEOUT_S = 600
GROUP_GRACE_S = 30.0  # after Ctrl-C, how long what a command started may take to end
DEFAULT_PORTS = {"serve": 5001, "prefect": 4200, "mlflow": 5000}  # ddpflow serve, the stack's two servers


@dataclass
class Block:
    """One fenced shell block: its commands (a heredoc or a continued line is one command) and its mark."""

    doc: str
    line: int
    commands: list[str]
    not_run: str | None = None  # the reason, when marked
    section: str = ""  # the heading it is under: a command left running runs until the section ends


def shell_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, index, section = [], 0, ""
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            section = lines[index] if lines[index].startswith("#") else section
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        if fence.group(1) in SHELL_FENCES:
            before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            mark = NOT_RUN.search(before)
            commands = commands_of(lines[index + 1 : end])
            blocks.append(Block(path.name, index + 1, commands, mark and mark.group(1), section))
        index = end + 1
    return blocks


def commands_of(lines: list[str]) -> list[str]:
    """A block's lines as commands: comment lines dropped, a line ending in ``\\`` joined with the next, a
    heredoc kept whole with its body."""
    commands, index = [], 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and index < len(lines):
            line = line[:-1] + " " + lines[index].strip()
            index += 1
        heredoc = HEREDOC.search(line)
        if heredoc:
            body = []
            while index < len(lines) and lines[index].strip() != heredoc.group(1):
                body.append(lines[index])
                index += 1
            line = "\n".join([line, *body, lines[index] if index < len(lines) else heredoc.group(1)])
            index += 1
        commands.append(line)
    return commands


def fresh_checkout(destination: Path) -> Path:
    """What a clone of this tree holds (tracked files and untracked ones git does not ignore), its .venv the suite's
    own environment (linked)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    (destination / ".venv").symlink_to(Path(sys.prefix))
    return destination


@dataclass
class Ran:
    """One command as it ran: what was typed, what the test ran, its exit status and output."""

    block: Block
    typed: str
    ran: str
    status: int | None
    output: str
    seconds: float


@dataclass
class Background:
    """A command left running in its own terminal until its block ends."""

    typed: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class DocShell:
    """One person's shell over a checkout: the environment and directory carried from command to command."""

    checkout: Path
    env: dict[str, str]
    harness_url: str | None = None
    ports: dict[str, int] = field(default_factory=lambda: {name: free_port() for name in (*DEFAULT_PORTS, "ui")})
    ran: list[Ran] = field(default_factory=list)
    skipped: list[Block] = field(default_factory=list)
    stopped: list[tuple[Background, int, str]] = field(default_factory=list)  # (command, exit status, output)
    cwd: Path | None = None
    after: dict[str, object] = field(default_factory=dict)  # a command's prefix -> a look taken right after it
    after_results: dict[str, object] = field(default_factory=dict)  # what those looks found, for the tests

    def __post_init__(self) -> None:
        self.cwd = self.cwd or self.checkout
        self.scratch = Path(tempfile.mkdtemp(prefix="doc-shell-"))
        if self.harness_url:
            self.env["PREFECT_API_URL"] = self.harness_url

    def run_all(self, blocks: list[Block]) -> None:
        """Each block's commands in order, until one fails. A command left running (``ddpflow serve``) runs
        until its section of the doc ends: the commands "from another terminal" that follow it are its users."""
        running: list[Background] = []
        try:
            for index, block in enumerate(blocks):
                if block.not_run is not None:
                    self.skipped.append(block)
                    continue
                for typed in block.commands:
                    if not self.run(block, typed, running):
                        return
                if index + 1 == len(blocks) or blocks[index + 1].section != block.section:
                    while running:
                        self.stop(running.pop())
        finally:
            while running:
                self.stop(running.pop())

    def run(self, block: Block, typed: str, running: list[Background]) -> bool:
        command = self.as_run(typed)
        if re.match(r"\s*ddpflow stack up\b", command):
            self.env.pop("PREFECT_API_URL", None)  # the stack's server from here on, as in a person's shell
        if re.match(r"\s*(ddpflow serve|mlflow ui)\b", command):
            running.append(self.start(typed, command))
            return True
        started = time.monotonic()
        status, output = self.shell(command)
        self.ran.append(Ran(block, typed, command, status, output, time.monotonic() - started))
        check = next((check for prefix, check in self.after.items() if typed.startswith(prefix)), None)
        if status == 0 and callable(check):
            check(self)
        return status == 0

    def as_run(self, typed: str) -> str:
        """The command with the test's ports and make's stamp (module docstring)."""
        ports = self.ports
        command = typed
        for name, default in DEFAULT_PORTS.items():
            command = command.replace(f"127.0.0.1:{default}", f"127.0.0.1:{ports[name]}")
        if re.match(r"\s*ddpflow serve\b", command) and "--port" not in command:
            command = _with_options(command, f"--port {ports['serve']}")
        if re.match(r"\s*mlflow ui\b", command) and "--port" not in command:
            command = _with_options(command, f"--port {ports['ui']}")
        if re.match(r"\s*ddpflow stack up\b", command) and "--prefect-port" not in command:
            command = _with_options(command, f"--prefect-port {ports['prefect']} --mlflow-port {ports['mlflow']}")
        if re.match(r"\s*make\b", command):
            command = re.sub(r"^(\s*make)\b", rf"\1 -o {STAMP}", command)
        return command

    def shell(self, command: str) -> tuple[int, str]:
        """Run one command in bash with this shell's state; read the state back after it."""
        state = self.scratch / "state"
        script = f"{command}\n__status=$?\nenv -0 > {state}.env\npwd > {state}.pwd\nexit $__status\n"
        done = subprocess.run(
            ["bash", "-c", script], cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=COMMAND_TIMEOUT_S, preexec_fn=as_from_a_terminal,
        )  # fmt: skip
        env_file = Path(f"{state}.env")
        if env_file.is_file():
            pairs = (item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
            self.env = {key: value for key, value in pairs if not key.startswith("BASH_FUNC_") and key != "_"}
            self.cwd = Path(Path(f"{state}.pwd").read_text().strip())
            env_file.unlink()
        return done.returncode, done.stdout + done.stderr

    def start(self, typed: str, command: str) -> Background:
        """A command a person leaves running: in its own session (a terminal's job), until it is ready."""
        log = self.scratch / f"background-{len(self.stopped)}-{int(time.monotonic())}.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=as_from_a_terminal,
            )  # fmt: skip
        background = Background(typed, process, log)
        deadline = time.monotonic() + 240
        while not self.ready(command, background):
            if process.poll() is not None or time.monotonic() > deadline:
                self.ran.append(Ran(Block("", 0, []), typed, command, process.poll(), background.output(), 0.0))
                self.stop(background)
                raise AssertionError(f"{typed!r} did not get ready:\n{background.output()[-4000:]}")
            time.sleep(0.5)
        return background

    def ready(self, command: str, background: Background) -> bool:
        if command.lstrip().startswith("ddpflow serve"):
            return "Ctrl-C stops it." in background.output()
        return http_ok(f"http://127.0.0.1:{self.ports['ui']}/health")

    def stop(self, background: Background) -> None:
        """Ctrl-C, as in the terminal it runs in: SIGINT to its process group; then what is left, if anything."""
        process = background.process
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        deadline = time.monotonic() + GROUP_GRACE_S
        while _group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)  # its children end after it (a server's workers, MLflow's job runner)
        left = _group_members(process.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self.stopped.append((background, process.returncode, background.output() + (f"\nleft: {left}" if left else "")))

    def close(self) -> None:
        """Whatever the doc's commands left up when the run stopped early (a failure, the suite's timeout): a stack
        that `ddpflow stack up` recorded in the checkout is brought down."""
        if (self.checkout / ".ddpflow" / "stack.json").is_file():
            subprocess.run(
                [sys.executable, "-m", "flows.cli", "stack", "down", "--project", str(self.checkout)],
                cwd=self.checkout, env=self.env, capture_output=True, timeout=180,
            )  # fmt: skip

    def output_of(self, prefix: str) -> str:
        """The output of the last command typed as ``prefix...``."""
        found = [ran.output for ran in self.ran if ran.typed.startswith(prefix)]
        assert found, f"no command {prefix!r} ran: {[ran.typed[:60] for ran in self.ran]}"
        return found[-1]

    def stopped_one(self, prefix: str) -> tuple[int, str]:
        """How the command typed as ``prefix...`` that ran until its block ended ended: (exit status, output)."""
        found = [(status, output) for background, status, output in self.stopped if background.typed.startswith(prefix)]
        assert found, f"no command {prefix!r} ran in the background"
        return found[-1]

    def typed(self) -> list[str]:
        """Every command typed: those that ended, and those left running until their block ended."""
        return [ran.typed for ran in self.ran] + [background.typed for background, _, _ in self.stopped]

    def failures(self) -> list[str]:
        return [
            f"{ran.block.doc}:{ran.block.line}: {ran.typed[:200]!r} exited {ran.status}:\n{ran.output[-3000:]}"
            for ran in self.ran
            if ran.status != 0
        ]

    def report(self) -> str:
        lines = [f"{ran.seconds:6.1f} s  {ran.typed.splitlines()[0][:100]}" for ran in self.ran]
        lines += [
            f"  left running until its block ended: {background.typed[:100]}" for background, _, _ in self.stopped
        ]
        lines += [f"  not run ({block.doc}:{block.line}): {block.not_run}" for block in self.skipped]
        return "\n".join(lines)


def _with_options(command: str, options: str) -> str:
    """``options`` after the command's arguments, before a trailing comment."""
    code, hash_, comment = command.partition(" #")
    return f"{code.rstrip()} {options}" + (f"  #{comment}" if hash_ else "")


def _group_members(pgid: int) -> list[int]:
    """Processes still in the process group ``pgid`` (what a Ctrl-C should have ended)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return members


@contextmanager
def doc_run(doc: Path, checkout: Path, mlflow_db: Path, harness_url: str, after: dict) -> Iterator[DocShell]:
    """Every fenced shell command of ``doc`` run in ``checkout`` (a fresh checkout), with ``mlflow_db`` as its empty
    store and ``after`` (a typed prefix -> a check run after it); a stack it left up is brought down after."""
    shutil.copy(mlflow_db, checkout / "mlflow.db")  # an empty store, its schema made once per session
    shell = DocShell(checkout, doc_env(checkout), harness_url=harness_url)
    shell.after.update(after)
    try:
        shell.run_all(shell_blocks(doc))
        yield shell
    finally:
        shell.close()


def doc_env(checkout: Path) -> dict[str, str]:
    """A person's environment: this one without the suite's Prefect and MLflow settings, the checkout's code
    first on the path (the suite's environment has this tree installed in place of the copy's)."""
    env = cli_env()
    env["PYTHONPATH"] = str(checkout)
    return env
