"""The job's signals, and the helper processes a rank starts that must outlive them.

SLURM sends its signals to every process of a job step, not to the ranks alone: the
pre-timeout signal (`--signal`, USR2 by default here), TERM at the time limit and on
preemption, and the `scancel --signal=USR1` a user sends for stack dumps. A rank handles
them (a preemption flag, a dump). Its helpers must not die of them:

- multiprocessing's forkserver, which starts the loader workers once CUDA is up
  (`data/transport.py`), ignores only SIGINT (CPython's `multiprocessing/forkserver.py`,
  `main`: the handlers it installs are SIGCHLD's and SIGINT's). Killed by USR2, it takes its
  children with it: the workers die of their parent-death signal, and the loader raises
  "worker died" a few steps later, before the rank reaches the step boundary where it saves.
- multiprocessing's resource tracker (started with the forkserver: it unlinks the named
  semaphores of forkserver workers) ignores SIGINT and SIGTERM only (`resource_tracker.py`):
  USR1/USR2 kill it, and its relaunch warns of leaked semaphores.
- inductor's compile sidecar (`torch/_inductor/compile_worker/subproc_pool.py`, a
  `subprocess.Popen` of `compile_worker/__main__.py`) and the compile workers it forks ignore
  only SIGINT (`compile_worker/utils.py`, `_async_compile_initializer`): a dead sidecar fails
  every pending compile ("Inductor compile worker sidecar ... exited unexpectedly").

None of them offers a setting for this, and a process cannot change another's handlers, so
they are started here with the job's signals *blocked* in the starting thread: a blocked
signal mask is inherited through fork and exec (CPython's resource tracker starts itself the
same way, `resource_tracker.ensure_running`), so the helper never receives them, and nothing
is lost for the rank: a signal that arrives meanwhile stays pending and is delivered to it
when the mask is restored. The helpers still die with the rank: the forkserver and the
resource tracker exit when the last process holding their pipe is gone, the compile sidecar
when its pipe to the rank closes, and hpctrain's loader workers watch the rank itself
(`data/transport.py`). A forkserver's children inherit the blocked mask: the loader workers
set their own handling, then unblock (`ignore_job_signals`); a user's code that starts
processes from the same forkserver gets them with the job's signals blocked (SIGKILL still
ends them). With `TORCHINDUCTOR_WORKER_START=fork` or `spawn` inductor starts its workers
from the rank itself, later, unprotected; the default (`subprocess`) is covered.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from hpctrain.compat_torch import start_compile_workers as _start_compile_workers

# SLURM's and the user's: preemption (USR2, TERM), stack dumps (USR1), ^C (INT).
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

_compile_workers_started = False


@contextlib.contextmanager
def job_signals_blocked() -> Iterator[None]:
    """Block the job's signals in this thread while the body runs; what arrives meanwhile
    is delivered once they are unblocked (to this thread or another)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_job_signals() -> None:
    """In a process started with them blocked: take them back (after setting their handling:
    one pending since the start is delivered now)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)


def start_forkserver() -> None:
    """Start multiprocessing's forkserver (and its resource tracker) deaf to the job's
    signals, unless it runs already (then whoever started it decided)."""
    from multiprocessing import forkserver, resource_tracker

    # The tracker first, on its own: its start unblocks SIGINT and SIGTERM in this thread
    # once it is spawned (it ignores them itself), which would leave the forkserver open to
    # TERM. Started, it is not started again (nor are signals touched) by the forkserver's.
    with job_signals_blocked():
        resource_tracker.ensure_running()
    with job_signals_blocked():
        forkserver.ensure_running()


def start_compile_workers() -> None:
    """Start inductor's compile worker pool now, deaf to the job's signals (torch would
    start it at the first compile, from the training loop, where they reach it). Once per
    process; a no-op where inductor compiles in the process itself (one compile thread)."""
    global _compile_workers_started
    if _compile_workers_started:
        return
    with job_signals_blocked():
        _start_compile_workers()
    _compile_workers_started = True
