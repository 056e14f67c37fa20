"""Local runs: one process, or N processes on this machine through the same `env://`
rendezvous a SLURM job uses (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, like torchrun)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpctrain.observe.hangs import newest_dump

# Set in every rank the launcher starts: the launcher's pid, so the rank dies with it.
LAUNCHER_PID_ENV = "HPCTRAIN_LAUNCHER_PID"
# Set in every rank too: how it was started, for its first log line (read by train/entry.py).
LAUNCHER_ENV = "HPCTRAIN_LAUNCHER"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_with_launcher() -> None:
    """In a rank started by `run_local`: get SIGKILL when the launcher dies, however it dies.

    Without this, a launcher killed with SIGKILL (no chance to stop its ranks) leaves them
    training as orphans, writing checkpoints into the run folder. Linux only: the kernel
    sends the signal when the parent exits (PR_SET_PDEATHSIG); elsewhere a no-op.
    """
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")  # not inherited by this rank's children
    if not launcher or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != int(launcher):  # the launcher died before the prctl above
        os._exit(128 + signal.SIGKILL)


def describe_exit(rank: int, code: int) -> str:
    """`rank 1 killed by SIGKILL` or `rank 0 exited with code 1`."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} killed by {name}"
    return f"rank {rank} exited with code {code}"


def shell_code(code: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a process killed by signal N."""
    return 128 - code if code < 0 else code


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): state T/t in /proc (Linux only)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def run_local(
    argv: Sequence[str],
    nproc: int,
    *,
    verb: str = "train",
    poll_s: float = 0.2,
    grace_s: float = 5.0,
    term_wait_s: float = 30.0,
    run_dir: str = "",
    per_node: int = 0,
) -> int:
    """Run `python -m hpctrain <verb> <argv>` as `nproc` ranks on this machine.

    `per_node`: ranks per pretended node (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`; 0: all on one),
    as `hpctrain bench mesh` lays out two nodes of two on one machine.

    Signals the launcher receives (TERM, INT, USR1, USR2) are forwarded to every rank, so a
    local run exercises the same preemption path as a SLURM job, and Ctrl-C reaches each rank
    once (the ranks run in process groups of their own). When one rank fails, the
    others get `grace_s` to exit on their own (e.g. after the same save), then SIGTERM, then
    SIGKILL after `term_wait_s`; a stopped rank (hung in SIGSTOP) is killed at once. Failures
    are reported on stderr, one line naming each rank and how it ended, and the folder of
    the Python stacks the ranks wrote meanwhile (`run_dir`/hangs, `train.hangs`). Ranks die
    with the launcher, even when it is killed with SIGKILL (`exit_with_launcher`).

    Returns:
        0 when every rank succeeded, the common code when every rank ended with the same
        code (the requeue code after a preemption save), otherwise the code of the rank that
        failed first, as a shell gives it (128 + N for a rank killed by signal N).
    """
    port = free_port()
    started = time.time()
    procs: list[subprocess.Popen[bytes]] = []
    per_node = per_node or nproc
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank % per_node),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        env[LAUNCHER_ENV] = f"local spawn: hpctrain {verb} --nproc {nproc}"
        # Each rank in a process group of its own: Ctrl-C at a terminal signals the foreground
        # group, the launcher alone, which forwards it once. Were the ranks in that group too,
        # each would get it twice (the terminal's and the forwarded one), and a second Ctrl-C
        # means "stop at once, without saving" (`train/preemption.py`).
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "hpctrain", verb, *argv], env=env, start_new_session=True
            )
        )

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {
        s: signal.signal(s, forward)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    }
    codes: list[int | None] = [None] * nproc
    first_failed: int | None = None  # the rank whose failure was seen first: the cause
    notes: dict[int, str] = {}  # ranks the launcher had to stop, and why
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed and first_failed is None:
                # Seen in the same poll: a rank killed by a signal is the likelier cause
                # (its peers then fail in their collectives).
                first_failed = min(failed, key=lambda i: (int(codes[i] or 0) >= 0, i))
            if failed and any(c is None for c in codes):
                _stop_the_others(procs, codes, notes, grace_s, term_wait_s, poll_s)
                break
            time.sleep(poll_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    final = [int(c) for c in codes if c is not None]
    if all(c == 0 for c in final):
        return 0
    if len(set(final)) == 1 and not notes:
        return shell_code(final[0])
    assert first_failed is not None
    report = [describe_exit(first_failed, final[first_failed])]
    for rank, code in enumerate(final):
        if rank != first_failed and code != 0:
            report.append(notes.get(rank) or describe_exit(rank, code))
    dumps = newest_dump(Path(run_dir), since=started) if run_dir else None
    if dumps is not None:
        ranks = ", ".join(sorted(p.name for p in dumps.glob("rank-*.txt")))
        report.append(f"Python stacks in {dumps} ({ranks})")
    print(f"hpctrain {verb}: {'; '.join(report)}", file=sys.stderr, flush=True)
    return shell_code(final[first_failed])


def _stop_the_others(
    procs: list[subprocess.Popen[bytes]],
    codes: list[int | None],
    notes: dict[int, str],
    grace_s: float,
    term_wait_s: float,
    poll_s: float,
) -> None:
    """After a rank failed: stop the rest, so none waits forever in a collective."""
    deadline = time.monotonic() + grace_s  # let them finish a save of their own / exit alike
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(poll_s)
    for rank, p in enumerate(procs):
        if p.poll() is not None:
            continue
        if is_stopped(p.pid):  # SIGTERM stays pending in a stopped process: kill it now
            notes[rank] = f"rank {rank} was stopped (hung, not running): killed by the launcher"
            p.kill()
        else:
            p.terminate()
    for rank, p in enumerate(procs):
        try:
            codes[rank] = p.wait(timeout=max(0.0, deadline + term_wait_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            notes[rank] = f"rank {rank} did not exit after SIGTERM: killed by the launcher"
            p.kill()
            codes[rank] = p.wait()
