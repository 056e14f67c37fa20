"""Where a hung rank hangs: the Python stacks of all its threads in `RUN_DIR/hangs/<time>/`.

A rank writes `rank-<R>.txt` (faulthandler's dump of every thread, plus the traceback of
the call that timed out when there is one) in three cases:

- a collective timed out (`train.collective_timeout_s`): before the rank gives up, the
  trainer turns the timeout into one error line that names the folder (`report_timeout`);
- `SIGUSR1` reached a live rank (`kill -USR1`, `scancel --signal=USR1 JOBID`): the rank
  dumps and trains on. USR1 is free by default (preemption uses USR2 and TERM). Where a
  user made USR1 a preemption signal (`checkpoint.signals`), preemption keeps it and dumps
  on USR1 are off (said once in the log): a requeue then still works as configured;
- no training step finished within `train.step_timeout_s` (off by default): the rank
  dumps, prints one line naming the folder and ends with exit code 1. The first step of a
  process has its own allowance, `train.first_step_timeout_s` (30 min by default, at least
  `step_timeout_s`): it compiles (`train.compile`, flex attention's kernels), autotunes
  cuDNN, starts the loader's workers and NCCL's communicators, minutes that tell nothing
  of a hang (nvidia-resiliency-ext's fault tolerance gives its first heartbeat its own
  timeout likewise).

The signal and the step deadline are watched by one daemon thread, so they work while the
main thread is blocked in C (a collective, a read): the signal's C handler wakes the thread
through `signal.set_wakeup_fd`, and faulthandler reads every thread's frames without the
GIL's holder's help. Ranks that dump within `JOIN_WINDOW_S` of each other (one `scancel
--signal`, peers timing out together) share one folder.

Stdlib only: the launcher (`launch/local.py`) and `hpctrain status` read the folders too.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from hpctrain.errors import DistributedError, rank_tag

log = logging.getLogger("hpctrain")

HANGS_DIR = "hangs"
JOIN_WINDOW_S = 60.0  # a rank joins a folder another rank made this recently
STEP_TIMEOUT_EXIT_CODE = 1
_FOLDER = re.compile(r"^(\d{8}-\d{6})Z(?:-\d+)?$")


class CollectiveTimeout(DistributedError):
    """A collective waited longer than `train.collective_timeout_s` for a peer rank.

    Exit 7 (`EXIT_DISTRIBUTED`): the peer hung or died, not this rank; the job script
    restarts the run and blames the rank that never ended (resilience/restart_policy.py).
    """

    label = "hang error"


def _folder_time(name: str) -> float | None:
    match = _FOLDER.match(name)
    if match is None:
        return None
    return time.mktime(time.strptime(match.group(1), "%Y%m%d-%H%M%S")) - time.timezone


def dump_folder(run_dir: Path, rank: int, now: float | None = None) -> Path:
    """The folder for this rank's dump: the newest made within `JOIN_WINDOW_S` without this
    rank's file (ranks dumping together share it), else a new `hangs/<UTC time>Z`."""
    root = run_dir / HANGS_DIR
    now = time.time() if now is None else now
    folders = sorted(root.iterdir()) if root.is_dir() else []
    for folder in reversed(folders):
        made = _folder_time(folder.name)
        if made is not None and 0 <= now - made <= JOIN_WINDOW_S:
            if not (folder / f"rank-{rank}.txt").exists():
                return folder
            break  # this rank already dumped there: a new dump, a new folder
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "Z"
    folder, number = root / stamp, 1
    while (folder / f"rank-{rank}.txt").exists():
        number += 1
        folder = root / f"{stamp}-{number}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_dump(run_dir: Path, rank: int, reason: str, error: BaseException | None = None) -> Path:
    """Write `rank-<R>.txt` (why, the failed call's traceback, every thread's stack); the folder."""
    folder = dump_folder(run_dir, rank)
    with open(folder / f"rank-{rank}.txt", "x") as f:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        f.write(f"rank {rank} on {socket.gethostname()}, pid {os.getpid()}, {when}: {reason}\n\n")
        if error is not None:
            f.write("The call that timed out (its traceback, innermost last):\n")
            f.write("".join(traceback.format_exception(error)))
            f.write("\n")
        f.write("Python stacks of all threads (innermost first):\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return folder


def newest_dump(run_dir: Path, since: float = 0.0) -> Path | None:
    """The newest `RUN_DIR/hangs/<time>` folder with a rank file written at or after `since`."""
    root = run_dir / HANGS_DIR
    if not root.is_dir():
        return None
    found: tuple[float, Path] | None = None
    for folder in root.iterdir():
        if _folder_time(folder.name) is None:
            continue
        times = [p.stat().st_mtime for p in folder.glob("rank-*.txt")]
        if times and max(times) >= since and (found is None or max(times) > found[0]):
            found = (max(times), folder)
    return found[1] if found else None


def is_collective_timeout(error: BaseException) -> bool:
    """A timed-out collective: gloo's "Timed out waiting ... ms" (a RuntimeError), NCCL's
    "Watchdog caught collective operation timeout" (torch's DistBackendError), anywhere in
    the cause chain (a checkpoint error wrapping it too)."""
    seen: BaseException | None = error
    visited: set[int] = set()  # a chain can loop (an error raised while handling its own cause)
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        from_torch = type(seen).__module__.startswith("torch") or isinstance(seen, RuntimeError)
        text = str(seen).lower()
        if from_torch and ("timed out" in text or "timeout" in text):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class HangWatch:
    """SIGUSR1 dumps and the step deadline of one rank (see the module's docstring).

    Args:
        run_dir: the run folder; dumps go to `run_dir/hangs/`.
        rank: this rank (names the file).
        step_timeout_s: dump and end when one training step runs longer; 0 disables.
        first_step_timeout_s: the same for the first step this watch times (at least
            `step_timeout_s`); 0: that step is not timed.
        collective_timeout_s: named in the error line of a timed-out collective.
        dump_on_usr1: False where USR1 is a preemption signal (`checkpoint.signals`).
        on_dump: called after each USR1 dump is written (the rank's watcher waits for it).
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        *,
        step_timeout_s: float = 0.0,
        first_step_timeout_s: float = 0.0,
        collective_timeout_s: float = 0.0,
        dump_on_usr1: bool = True,
        on_dump: Callable[[], None] | None = None,
    ) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.step_timeout_s = step_timeout_s
        self.first_step_timeout_s = first_step_timeout_s and max(
            first_step_timeout_s, step_timeout_s
        )
        self._steps_timed = 0
        self._deadline_s = step_timeout_s  # of the running step (the first has its own)
        self.collective_timeout_s = collective_timeout_s
        self.dump_on_usr1 = dump_on_usr1
        self.on_dump = on_dump
        self._step = 0
        self._step_start: float | None = None  # monotonic start of the running step
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_handler: Any = None
        self._previous_fd = -1

    # ------------------------------------------------------------ the loop's hooks
    def step(self, number: int) -> HangWatch:
        """`with watch.step(n):` around training step n: the deadline runs inside."""
        self._step = number
        return self

    def __enter__(self) -> HangWatch:
        self._steps_timed += 1
        if self._steps_timed == 1:
            if not self.first_step_timeout_s:
                return self  # not timed
            self._deadline_s = self.first_step_timeout_s
        else:
            self._deadline_s = self.step_timeout_s
        self._step_start = time.monotonic()  # the whole per-step cost: a few stores
        return self

    def __exit__(self, *exc: object) -> None:
        self._step_start = None

    # ------------------------------------------------------------ install / uninstall
    def install(self) -> None:
        """Start the watcher thread (USR1's handler only from the main thread, where signal
        handlers live: a trainer run in another thread keeps the step deadline alone)."""
        if not self.dump_on_usr1:
            log.info("SIGUSR1 is a preemption signal (checkpoint.signals): no stack dumps on it")
        self.dump_on_usr1 &= threading.current_thread() is threading.main_thread()
        if not self.dump_on_usr1 and not self.step_timeout_s:
            return
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._sockets = (reader, writer)
        if self.dump_on_usr1:
            # A Python handler is needed for the C handler to write to the wakeup fd; it does
            # nothing itself (it runs only once the main thread is back in Python).
            self._previous_handler = signal.signal(signal.SIGUSR1, _ignore)
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-hangs", daemon=True)
        self._thread.start()

    @property
    def dump_signal(self) -> int:
        """The signal that makes this rank write its stacks now (0: none: not installed)."""
        return int(signal.SIGUSR1) if self.dump_on_usr1 and self._thread is not None else 0

    def uninstall(self) -> None:
        if self._thread is None or self._sockets is None:
            return
        if self.dump_on_usr1:
            signal.set_wakeup_fd(self._previous_fd)
            signal.signal(signal.SIGUSR1, self._previous_handler)
        self._stop.set()
        self._sockets[1].send(b"\0")  # wake the thread
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()
        self._thread = self._sockets = None

    def _watch(self) -> None:
        assert self._sockets is not None
        reader = self._sockets[0]
        poll_s = min(1.0, self.step_timeout_s / 10) if self.step_timeout_s else None
        while not self._stop.is_set():
            ready, _, _ = select.select([reader], [], [], poll_s)
            if ready:
                signals = reader.recv(256)
                if self.dump_on_usr1 and signal.SIGUSR1 in signals and not self._stop.is_set():
                    folder = write_dump(
                        self.run_dir, self.rank, "SIGUSR1 received: training goes on"
                    )
                    print(
                        f"SIGUSR1: Python stacks of rank {self.rank} in {folder}",
                        file=sys.stderr,
                        flush=True,
                    )
                    if self.on_dump is not None:
                        self.on_dump()
            start, deadline_s = self._step_start, self._deadline_s
            if self.step_timeout_s and start is not None:
                ran_s = time.monotonic() - start
                if ran_s > deadline_s:
                    self._end_the_hung_step(ran_s, deadline_s)

    def _end_the_hung_step(self, ran_s: float, deadline_s: float) -> None:
        key = "first_step_timeout_s" if self._steps_timed == 1 else "step_timeout_s"
        first = ", the first of this process," if self._steps_timed == 1 else ""
        reason = (
            f"no training step finished within train.{key}={deadline_s:g} s "
            f"(step {self._step}{first} ran {ran_s:.0f} s)"
        )
        folder = write_dump(self.run_dir, self.rank, reason)
        # One write: the line stays whole where ranks share a stderr (hpctrain.errors).
        sys.stderr.write(
            f"hpctrain train{rank_tag()}: hang error: {reason}: "
            f"Python stacks of every thread in {folder}\n"
        )
        sys.stderr.flush()
        # The main thread is stuck (that is the point): end the process from here. Loader
        # workers die with it (PR_SET_PDEATHSIG), the run lock is taken over as a dead one's.
        os._exit(STEP_TIMEOUT_EXIT_CODE)

    # ------------------------------------------------------------ collective timeouts
    def report_timeout(self, error: BaseException) -> None:
        """After `error` ended the loop: a timed-out collective raises `CollectiveTimeout`
        naming the dump folder (the cause chained); anything else returns unchanged."""
        if not is_collective_timeout(error):
            return
        timeout = f"train.collective_timeout_s={self.collective_timeout_s:g} s"
        folder = write_dump(self.run_dir, self.rank, f"a collective timed out ({timeout})", error)
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CollectiveTimeout(
            f"a collective waited {timeout} for a peer rank (hung, stopped or dead): "
            f"Python stacks of every thread in {folder} ({cause})"
        ) from error


def _ignore(signum: int, frame: FrameType | None) -> None:
    """USR1's Python handler: the watcher thread does the work (woken by the wakeup fd)."""


__all__ = [
    "HANGS_DIR",
    "CollectiveTimeout",
    "HangWatch",
    "dump_folder",
    "is_collective_timeout",
    "newest_dump",
    "write_dump",
]
