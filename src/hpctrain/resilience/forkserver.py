"""A warm process per node that forks each attempt's ranks: `python -m hpctrain.resilience.forkserver`.

A rank started afresh spends seconds in the interpreter and its imports (`import torch`
alone takes 2-6 s on a loaded node) before it trains; after a failure every rank of the next
attempt pays that again. The job script starts one fork server per node for the whole
allocation (`srun --overlap`, in the background, `slurm.forkserver`): it imports torch and
the trainer once, then waits. Each rank's watcher (`resilience/watch.py`) asks the server of
its node for its rank (`forked.start`): it sends its command's module and arguments, its
environment, working folder, umask, CPU affinity and its stdin/stdout/stderr
(`socket.send_fds`); the server forks a child that takes all of them on and runs `python -m
hpctrain train ...` as a fresh interpreter would (`hpctrain/__main__.py`, its exit included),
and tells the watcher the child's pid, then its exit status. The watcher waits for that
status as it would wait for its own child.

What a child started this way keeps of a fresh start, and how:
- the environment per rank (SLURM_PROCID, CUDA_VISIBLE_DEVICES, NCCL_*, ...): the watcher's,
  set before anything reads it. What reads the environment at import (OpenMP's thread count)
  is set again from it (`torch.set_num_threads`); CUDA and NCCL read theirs when they start,
  in the child. The server never starts CUDA (it refuses to fork once CUDA is up, or once a
  thread runs beside numpy's BLAS pool, which stops itself before a fork: a fork copies only
  the thread that forks), and forks only for a watcher whose
  step has the same GPUs as its own (`SLURM_STEP_GPUS`), so a child's CUDA_VISIBLE_DEVICES
  means what it means to a rank started by srun;
- signals: SLURM signals the processes of the training step, and the child is not one of
  them (it belongs to the fork server's step): the watcher forwards each signal it notes to
  the child's process group (the rank and its loader workers), as SLURM would have sent it
  (`forked.ForkedChild`); the server itself ignores the job's signals (a TERM ends it once it has
  no child left), so that the ranks can save on a preemption before it goes;
- ends: a child whose watcher goes away (srun killed the step, the node's watcher died) is
  killed with its process group at once (the server sees the watcher's connection close);
  a child whose server dies gets SIGKILL from the kernel (parent-death signal), and its
  watcher then ends it too and reports SIGKILL;
- the CPUs: the watcher's affinity; a server that cannot grant it (its step has other
  CPUs) refuses, and so for a mismatch of GPUs, a thread, CUDA: the watcher then starts its
  rank afresh, as without a server, and says why in one line.

The server listens on an abstract Unix socket named after the user, job, requeue and node
(nothing on disk, nothing left behind), and serves only processes of its own user (the
peer's credentials). It imports torch at run time only (`--preload`); the watcher's side,
`resilience/forked.py`, is the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from hpctrain.resilience.forked import (
    FORWARDED,
    address,
    gpus_of_step,
    send_message,
    stderr_line,
)

PR_SET_PDEATHSIG = 1
REQUEST_READ_S = 10.0  # a watcher sends its request at once: one that does not is dropped
# What the server imports before it forks (the trainer's own modules, torch among them), and
# what the child would import later anyway (resume, the image pipeline, the summary).
PRELOAD = (
    "numpy",  # first: the threads its BLAS pool starts are those a fork may leave (`preload`)
    "hpctrain.cli.main",
    "hpctrain.cli.train",
    "hpctrain.train",
    "hpctrain.train.entry",
    "torch.distributed.checkpoint",
    "torchvision.transforms.v2",
)


# ------------------------------------------------------------------------------ the server
class _Fork(BaseException):
    """Raised in a freshly forked child to leave the server's loop (its stack unwinds to
    `main`, which runs the rank): not an Exception, so that nothing on the way catches it."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def threads_running() -> int:
    """Threads of this process (Linux's /proc; 1 where it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cpus_granted(cpus: Sequence[int]) -> bool:
    """Whether this process (so its child) may run on `cpus`: tried on itself, then undone."""
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
        granted = os.sched_getaffinity(0) == set(cpus)
    except OSError:
        granted = False
    finally:
        os.sched_setaffinity(0, mine)
    return granted


class Server:
    """The loop: accept a watcher, fork its rank, report the rank's end, kill a rank whose
    watcher went away. One thread (the fork needs it), one selector."""

    def __init__(self, name: str, environ: Mapping[str, str]) -> None:
        self.gpus = gpus_of_step(environ)
        # The threads a fork may leave behind safely: numpy's OpenBLAS starts its pool at
        # import and stops it itself before a fork (pthread_atfork); `preload` counts them.
        self.threads = 1
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(name)  # OSError: another server of this job holds it
        self.listener.listen(64)
        self.children: dict[int, socket.socket | None] = {}  # pid -> its watcher's connection
        self.stopping = False
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector = selectors.DefaultSelector()

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def serve(self) -> None:
        """Until a TERM came and no child is left; in a forked child, raises `_Fork`."""
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        for end in (self.wake_r, self.wake_w):
            end.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        while not (self.stopping and not self.children):
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self.wake_r.recv(4096)
                else:
                    self._watcher_gone(key.fileobj, key.data)  # type: ignore[arg-type]
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():  # another user's process: never run its commands
            conn.close()
            return
        try:
            request, fds = self._read_request(conn)
        except (OSError, ValueError) as exc:
            stderr_line(f"fork server: a request could not be read ({exc})")
            conn.close()
            return
        why = self._refusal(request, fds)
        if why:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                send_message(conn, {"refused": why})
            conn.close()
            return
        pid = self._fork(request, fds)
        self.children[pid] = conn
        try:
            send_message(conn, {"pid": pid})
        except OSError:  # the watcher is already gone: so is its rank
            self._kill(pid)
        self.selector.register(conn, selectors.EVENT_READ, data=pid)

    def _read_request(self, conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
        conn.settimeout(REQUEST_READ_S)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if len(data) < 4:
            raise ValueError("a request too short")
        (size,) = struct.unpack("!I", data[:4])
        body = data[4:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ValueError("a request cut short")
            body += more
        conn.settimeout(None)
        request = json.loads(body)
        if not isinstance(request, dict) or len(fds) != 3:
            raise ValueError("a request without its arguments or its three stdio descriptors")
        return request, list(fds)

    def _refusal(self, request: Mapping[str, Any], fds: Sequence[int]) -> str:
        """Why this rank cannot be forked here ("" when it can)."""
        if cuda_started():
            return "CUDA started in the fork server (a fork would break it)"
        threads = threads_running()
        if threads > self.threads:
            return (
                f"{threads} threads run in the fork server, {self.threads} after numpy's "
                "import (a fork copies only one thread)"
            )
        if str(request.get("gpus", "")) != self.gpus:
            return (
                f"the rank's step has GPUs {request.get('gpus') or 'none'}, the fork server's "
                f"{self.gpus or 'none'}"
            )
        cpus = request.get("cpus") or []
        if cpus and not cpus_granted(cpus):
            return f"the fork server's step may not run on the rank's CPUs {cpus}"
        return ""

    def _fork(self, request: dict[str, Any], fds: Sequence[int]) -> int:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        pid = os.fork()
        if pid == 0:
            self._become_child(fds)
            raise _Fork(request)
        for fd in fds:
            os.close(fd)
        return pid

    def _become_child(self, fds: Sequence[int]) -> None:
        """In the child: nothing of the server's is left but what a fresh start has too."""
        os.setpgid(0, 0)  # its own group: the watcher signals the rank and its workers
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.set_wakeup_fd(-1)
        for sig in (*FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what Python starts with
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        self.selector.close()
        for sock in (self.listener, self.wake_r, self.wake_w, *self.children.values()):
            if sock is not None:
                sock.close()
        self.children.clear()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)

    def _watcher_gone(self, conn: socket.socket, pid: int) -> None:
        """The watcher's connection is readable: it closed (the watcher died or was killed):
        its rank goes too, with its loader workers."""
        with contextlib.suppress(OSError):
            if conn.recv(1, socket.MSG_PEEK):
                conn.recv(4096)  # nothing is expected: drop it
                return
        self.selector.unregister(conn)
        conn.close()
        if pid in self.children:
            self.children[pid] = None
            self._kill(pid)

    def _kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                send_message(conn, {"status": os.waitstatus_to_exitcode(status)})
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()


def preload(modules: Sequence[str], say: Callable[[str], None]) -> int:
    """Import `modules` in order; returns the threads running once `numpy` of them is
    imported (its BLAS pool: it stops itself before a fork), else 1."""
    threads = 1
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a child imports it itself, and fails there if it must
            say(f"fork server: could not preload {name}: {exc}")
        if name == "numpy":
            threads = threads_running()
    return threads


def task_module(args: Sequence[str]) -> str | None:
    """The module of the built-in task the training arguments name (None: a task of yours,
    left for the child to import, or arguments that do not load)."""
    if len(args) < 2 or args[0] != "train":
        return None
    from hpctrain.config import load_config
    from hpctrain.tasks.task import BUILTIN_TASKS  # torch's: import it after `preload`

    try:
        cfg = load_config(args[1], [a for a in args[2:] if "=" in a and not a.startswith("-")])
    except Exception:  # a config the child will refuse, in its own words
        return None
    return BUILTIN_TASKS.get(cfg.task, "").partition(":")[0] or None


def run_rank(request: Mapping[str, Any]) -> None:
    """In a forked child: become `python -m MODULE ARGS` with the watcher's environment,
    folder, umask and CPUs; returns or raises as that program does (SystemExit)."""
    os.chdir(str(request["cwd"]))
    os.umask(int(request["umask"]))
    if request.get("cpus"):
        os.sched_setaffinity(0, [int(c) for c in request["cpus"]])
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})
    torch = sys.modules.get("torch")
    if torch is not None:  # OpenMP read its thread count when the server loaded it
        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                              else len(os.sched_getaffinity(0)))  # fmt: skip
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh process seeds numpy's global generator from the OS
        numpy.random.seed()
    sys.argv = ["-m", *[str(a) for a in request["args"]]]  # runpy puts the module's file first
    runpy.run_module(str(request["module"]), run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.resilience.forkserver")
    parser.add_argument(
        "--preload",
        default=",".join(PRELOAD),
        help="modules to import before forking, comma-separated (default: torch's and the "
        "trainer's; the built-in task the training arguments name is added)",
    )
    parser.add_argument(
        "training", nargs=argparse.REMAINDER, help="-- train CONFIG [overrides]: the job's"
    )
    options = parser.parse_args(argv)
    args = options.training[1:] if options.training[:1] == ["--"] else options.training
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    began = time.monotonic()
    try:
        server = Server(address(os.environ), os.environ)
    except OSError as exc:
        stderr_line(f"fork server on {node}: cannot listen ({exc}); ranks there start afresh")
        return 0
    try:
        modules = [m for m in options.preload.split(",") if m]
        server.threads = preload(modules, stderr_line)
        task = task_module(args) if modules else None
        preload([task] if task else [], stderr_line)
        stderr_line(f"fork server on {node}: ready in {time.monotonic() - began:.1f} s")
        server.serve()
    except _Fork as fork:
        run_rank(fork.request)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
