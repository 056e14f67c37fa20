"""The watcher's side of the fork server (`resilience/forkserver.py`): ask the node's server
for a rank, and see the forked rank as `subprocess.Popen` sees its child.

`start(command)` is what the watcher (`resilience/watch.py`) starts its rank with: a rank
forked by the server when the job runs one (`HPCTRAIN_FORKSERVER=1`, exported by `attempts
begin`) and it agrees, else a plain subprocess. The standard library only: the watcher starts
in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

# "1": the job script started one per node (`attempts begin` exports it, slurm.forkserver)
ENABLED_ENV = "HPCTRAIN_FORKSERVER"
# How long a watcher waits for its server's answer: a server still importing (it started with
# the job, the first attempt's ranks may come before it is ready) is worth waiting for, since
# a fresh start imports the same; one that never answers is given up on.
ANSWER_WAIT_S = 180.0
# How long a watcher tries to reach a server that is not listening yet (started with the job,
# beside the first attempt's probe): seconds; then the rank starts afresh.
CONNECT_WAIT_S = 5.0
# Signals the job's steps get from SLURM (watch.NOTED_SIGNALS): the watcher forwards them to
# its forked rank; the server ignores them (TERM: ends it once no child is left).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def address(environ: Mapping[str, str]) -> str:
    """The server's abstract socket name on this node, for this job (and requeue)."""
    job = environ.get("SLURM_JOB_ID", "")
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    node = environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    restart = environ.get("SLURM_RESTART_COUNT", "0") or "0"
    return f"\0hpctrain-forkserver-{os.getuid()}-{job}-{restart}-{node}"


def gpus_of_step(environ: Mapping[str, str]) -> str:
    """The GPUs SLURM gave the step (what its tasks' CUDA_VISIBLE_DEVICES count from)."""
    return environ.get("SLURM_STEP_GPUS", environ.get("SLURM_JOB_GPUS", ""))


# ------------------------------------------------------------------------------ the protocol
def send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class _Lines:
    """JSON messages, one a line, read from a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def read(self, block: bool = True) -> dict[str, Any] | None:
        """The next message; None when none came yet (not blocking). Raises EOFError at the
        end of the stream."""
        while b"\n" not in self.buffer:
            try:
                data = self.sock.recv(65536, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except ConnectionError:
                data = b""
            if not data:
                raise EOFError
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line)
        return message if isinstance(message, dict) else {}


class Refused(Exception):
    """The server would not fork this rank (the reason is the message)."""


# ------------------------------------------------------------------------------ the watcher's side
def _connect(sock: socket.socket, name: str) -> None:
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            sock.connect(name)
            return
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class ForkedChild:
    """A rank forked by the node's server, seen as `subprocess.Popen` sees its child: `pid`,
    `returncode`, `wait`, `poll`, `send_signal`, `terminate`, `kill` (its process group)."""

    def __init__(self, sock: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.sock, self.pid, self.args = sock, pid, list(args)
        self.returncode: int | None = None
        self._lines = _Lines(sock)

    @classmethod
    def request(
        cls,
        name: str,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        timeout: float = ANSWER_WAIT_S,
        stdio: Sequence[int] = (0, 1, 2),
    ) -> ForkedChild:
        """Ask the server at `name` to run `python -m MODULE ARGS` with `env` and this
        process's folder, umask, CPUs and stdio. Raises OSError (no server), Refused."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            _connect(sock, name)
            mask = os.umask(0)
            os.umask(mask)
            request = {
                "module": module,
                "args": list(args),
                "env": dict(env),
                "cwd": os.getcwd(),
                "umask": mask,
                "cpus": sorted(os.sched_getaffinity(0)),
                "gpus": gpus_of_step(env),
            }
            data = struct.pack("!I", len(body := json.dumps(request).encode())) + body
            sent = socket.send_fds(sock, [data], list(stdio))
            if sent < len(data):  # (a send of nothing to a server that answered: EPIPE)
                sock.sendall(data[sent:])
            try:
                answer = _Lines(sock).read() or {}
            except EOFError:
                raise OSError("the fork server closed the connection") from None
            if "pid" not in answer:
                raise Refused(str(answer.get("refused", "no reason given")))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(sock, int(answer["pid"]), [module, *args])

    def forward_signals(self, signals: Sequence[signal.Signals] = FORWARDED) -> None:
        """From now on each of `signals` reaches the child's process group too, after this
        process's own handler (main thread only)."""
        for sig in signals:
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
                if callable(previous):
                    previous(signum, frame)
                self.send_signal(signum)

            signal.signal(sig, handler)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, message: dict[str, Any] | None) -> int:
        """The child's end: `message` is the server's last word (None: it went away)."""
        if message is None or "status" not in message:
            # The server went away without a word (killed, or its node): the kernel killed
            # the child (parent-death signal); make sure of it, and report that kill.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = int(message["status"])
        self.sock.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                message = self._lines.read(block=False)
            except EOFError:
                return self._ended(None)
            if message is not None:
                return self._ended(message)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self.sock.settimeout(timeout)
        try:
            message = self._lines.read()
        except EOFError:
            message = None
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)
        return self._ended(message)


Child = ForkedChild | subprocess.Popen  # what `start` returns


def start(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    say: Callable[[str], None] | None = None,
) -> Child:
    """Start `command` as `subprocess.Popen(command, env=env)` would, or, when the job runs a
    fork server on this node (`HPCTRAIN_FORKSERVER`) and `command` is `python -m MODULE ...`
    with this interpreter (the server's: the job's), as that server's child (signals
    forwarded to it from here on). A server that is missing or refuses gets one line
    (`say`), and the command starts afresh."""
    environ = dict(os.environ if env is None else env)
    wanted = (
        environ.get(ENABLED_ENV) == "1"
        and len(command) >= 3
        and command[1] == "-m"
        and os.path.realpath(command[0]) == os.path.realpath(sys.executable)
    )
    if wanted:
        try:
            child = ForkedChild.request(address(environ), command[2], command[3:], environ)
        except (OSError, Refused, ValueError) as exc:
            (say or stderr_line)(
                f"fork server: {exc or type(exc).__name__}; this rank starts afresh"
            )
        else:
            child.forward_signals()
            return child
    return subprocess.Popen(list(command), env=env)


def stderr_line(line: str) -> None:
    sys.stderr.write(f"hpctrain: {line}\n")
    sys.stderr.flush()
