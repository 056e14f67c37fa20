"""The batch transport: hpctrain's own worker processes, and how batches come back from them.

**Workers.** Each worker reads its own stream of the epoch plan, so it needs no indices from
the training process: a pass is one order ("run pass g"), then batches come back on the
worker's own pipe, and a semaphore per worker bounds the batches in flight (`prefetch`). The
training process takes them round-robin, worker 0 first, skipping workers whose stream has
ended: the order a DataLoader gives an IterableDataset, which the plan's resume arithmetic
relies on.

Why not DataLoader: for every batch it sends an index through one queue and the batch back
through another, each `put` handing the message to a feeder thread: four thread wake-ups per
batch, on machines whose cores are all busy decoding (the paired figure against the same
dataset code under DataLoader is in BENCHMARKS.md, "Figures behind the code"). Beyond that: the pooled buffers serve
pinned (GPU) batches too, and workers are stopped at the end of a multiprocessing child as
well, where DataLoader's daemonic workers, which ignore SIGTERM here, hung it.

A worker that dies is noticed at once (its process sentinel is polled with its pipe); an
exception in a worker is re-raised in the training process with the worker's traceback as its
cause; a worker that sends nothing for `timeout_s` (stuck in a read, a transform that loops)
fails the wait with `WorkerTimeoutError`, naming the shard it was reading. Workers die with
the training process even while busy (see `die_with_parent`); they ignore job signals (see
`ignore_job_signals`), so the pool stops them itself, at the latest when the process exits.
Forkserver workers (once CUDA is up) come from a forkserver started deaf to those signals
(`hpctrain.distributed.signals`): SLURM sends them to every process of the step, and a dead
forkserver would take its workers with it.

Batches travel in the pooled shared-memory buffers of `hpctrain.data.buffers`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from hpctrain.compat_torch import set_worker_info
from hpctrain.data.buffers import BatchBuffers, MappedBuffers, PooledBatch
from hpctrain.distributed.signals import (
    JOB_SIGNALS,
    job_signals_blocked,
    start_forkserver,
    unblock_job_signals,
)
from hpctrain.errors import TransientDataError

_DONE = object()
POLL_S = 1.0  # how often a waiting worker checks that the training process is alive
STOP_TIMEOUT_S = 5.0  # a polite stop's wait before SIGKILL
ACTIVITY_BYTES = 512  # a worker's "what I am reading" text, shared with the training process
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerDiedError(TransientDataError, RuntimeError):
    """A loader worker process ended without being asked to (killed, crashed, out of memory).

    Transient (exit 8, retried by the job script): the OOM killer's likeliest victim on a node
    is a loader worker, and a new attempt starts new workers. A worker that keeps dying at the
    same place stops the run by `slurm.max_no_progress`.
    """


class WorkerTimeoutError(WorkerDiedError):
    """A loader worker that sent nothing for `data.timeout_s` (names it and its shard): stuck
    on a hung file system or a stalled read; transient like a death."""


# In a worker: its shared activity text (None in the training process).
_activity: Any = None


def report_activity(text: str) -> None:
    """Tell the training process what this worker is reading (shown if it dies or stalls).

    A no-op outside loader workers. One small write to shared memory: cheap enough per shard.
    """
    if _activity is not None:
        data = text.encode("utf-8", "replace")[: ACTIVITY_BYTES - 1]
        _activity[: len(data) + 1] = data + b"\0"


def _read_activity(array: Any) -> str:
    return bytes(array[:]).split(b"\0", 1)[0].decode("utf-8", "replace")


class _End(NamedTuple):
    """A worker's last message of pass `generation`."""

    generation: int


class _Failure(NamedTuple):
    """An exception raised in a worker: pickled if it can be, and its traceback as text."""

    worker: int
    pid: int
    exception: bytes | None
    text: str

    def error(self) -> BaseException:
        where = f"in loader worker {self.worker} (pid {self.pid})"
        exc: BaseException | None = None
        if self.exception is not None:
            try:
                exc = pickle.loads(self.exception)
            except Exception:
                exc = None
        if exc is None:
            return RuntimeError(f"{where}:\n{self.text}")
        # shown above the re-raised exception, as concurrent.futures does for its processes
        exc.__cause__ = WorkerTraceback(f"raised {where}:\n{self.text}")
        return exc


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a loader worker (its `__cause__` here)."""


def _failure(worker: int, exc: BaseException) -> _Failure:
    text = "".join(traceback.format_exception(exc))
    data: bytes | None = None
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # an exception whose constructor takes other arguments fails here
    except Exception:
        data = None
    return _Failure(worker, os.getpid(), data, text)


def ignore_job_signals() -> None:
    """Loader workers leave job signals to the training process.

    SLURM delivers the pre-timeout/preemption signal (and scancel's TERM) to every process of
    the step, workers included; a worker killed by it takes the loader down before the
    training process can reach its step boundary and save. The training process owns the
    preemption flag and stops the workers itself; a real kill still ends them (SIGKILL, or
    the training process's death, which workers watch for). Every worker starts with these
    signals blocked (a forked one inherits the mask `WorkerPool` holds around its start, a
    forkserver's from the forkserver): a signal sent before the worker reaches this line
    waits instead of killing it; ignored first, then unblocked, so that what the programs a
    worker runs (`pipe:` commands) inherit is what a signal-free start gives.
    """
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    unblock_job_signals()


def worker_start_method() -> str:
    """'fork' unless CUDA is initialised; then 'forkserver'.

    Fork is the cheapest start (no re-import of torch, seconds per worker) and is safe on
    Linux CPU processes; a forked child of a process with an initialised CUDA context cannot
    use CUDA and may deadlock in the driver, so then workers start from a clean server.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "forkserver"
    return "fork"


def owner_watch(owner: int) -> Callable[[], bool]:
    """A test of whether the training process `owner` (the pool's maker) is gone.

    A forked worker's parent is the owner: the kernel re-parents the worker once the owner
    dies. A forkserver worker's parent is the forkserver, which outlives the owner as long
    as any worker lives (each holds the forkserver's "alive" pipe), so that worker watches
    the owner itself: through a pidfd (Linux 5.3+: readable once the process has ended, and
    never confused with a later process that reuses the pid), else by its pid.
    """
    if os.getppid() == owner:
        return lambda: os.getppid() != owner
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        return lambda: True
    except (AttributeError, OSError):  # no pidfd here

        def gone() -> bool:
            try:
                os.kill(owner, 0)
            except OSError:  # no such process, or another user's (the pid reused)
                return True
            return False

        return gone
    # select, not a shared poll object: the watchdog thread and the worker's loop both ask
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def die_with_parent(gone: Callable[[], bool], forked_by_main_thread: bool) -> None:
    """End this worker when the training process dies (`gone()`), whatever the worker is
    doing.

    Waiting workers ask `gone()` between waits, but a busy one (a transform that loops, a
    read that never returns) would not: it would outlive a SIGKILLed training process, holding
    a core and the GPU's job for ever. So the kernel kills it: a parent-death signal
    (Linux), sent when the worker's parent ends: the training process, or the forkserver,
    which ends once the training process and its workers are gone. The kernel sends it when
    the *thread* that forked the worker ends, so it is set only for workers forked by a main
    thread (a pool made in a short-lived thread would lose its workers with that thread); a
    watchdog thread covers the rest, other systems and the forkserver's workers.
    """
    if forked_by_main_thread and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if gone():  # it died before the signal was set up
        os._exit(0)

    def watch() -> None:
        while not gone():
            time.sleep(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="hpctrain-parent-watch", daemon=True).start()


def _work(
    source: Any,
    worker: int,
    num_workers: int,
    results: Connection,
    orders: Connection,
    releases: Connection,
    keep: int,
    credits: Any,
    cancelled: Any,
    activity: Any,
    owner: int,
    forked_by_main_thread: bool,
) -> None:
    """A worker's life: wait for an order, run a pass of `source.batches(worker, memory)`,
    repeat. `memory`: the worker's pooled buffers (`keep` of them, freed through `releases`).

    `owner`: the pid of the training process that made the pool (see `owner_watch`).
    """
    global _activity
    gone = owner_watch(owner)
    die_with_parent(gone, forked_by_main_thread)
    _activity = activity
    ignore_job_signals()
    torch.set_num_threads(1)  # as DataLoader workers: one core each, no oversubscription
    # What the worker inherited (torch, the training process's objects) is never garbage:
    # out of the collector's sight, a collection scans only what the worker made (full
    # collections over torch's heap cost ~10 us per sample of tar reading here), and its
    # refcount/GC writes do not copy the parent's pages. Here, not around the fork: this
    # covers forked and forkserver workers alike.
    gc.freeze()
    set_worker_info(
        worker=worker, num_workers=num_workers, seed=getattr(source, "seed", 0), dataset=source
    )
    memory = BatchBuffers(keep, releases)
    while True:
        while not orders.poll(POLL_S):
            if gone():
                return
        try:
            generation = orders.recv()
            if generation is None:
                return
            report_activity("starting a pass")
            batches = iter(source.batches(worker, memory))
            while True:
                try:
                    batch = next(batches, _DONE)
                except Exception as exc:
                    results.send(_failure(worker, exc))
                    break
                if batch is _DONE or not _slot(credits, cancelled, generation, gone):
                    break
                results.send(batch)
            del batches  # closes the pass's files before the next order
            report_activity("waiting for the next pass")
            results.send(_End(generation))
        except (EOFError, BrokenPipeError):  # the training process is gone: so is the work
            return


def _slot(credits: Any, cancelled: Any, generation: int, gone: Callable[[], bool]) -> bool:
    """Wait for room for one more batch in flight; False once the pass is called off."""
    while cancelled.value < generation:
        if credits.acquire(timeout=POLL_S):
            if cancelled.value < generation:
                return True
            credits.release()  # called off meanwhile: the slot stays free for the next pass
            return False
        if gone():
            os._exit(0)
    return False


class _Processes:
    """What stopping a pool's workers needs, apart from the pool (so that a pool dropped
    without `close()` is still stopped, by its finalizer)."""

    def __init__(self, cancelled: Any) -> None:
        self.cancelled = cancelled
        self.processes: list[Any] = []
        self.orders: list[Connection] = []
        self.results: list[Connection] = []
        self.releases: list[Connection] = []
        self.credits: list[Any] = []
        self.activities: list[Any] = []

    def stop(self) -> None:
        """Ask every worker to stop, then SIGKILL any still alive after a while."""
        self.cancelled.value = sys.maxsize
        for orders in self.orders:
            with contextlib.suppress(OSError):
                orders.send(None)
        for credits in self.credits:
            credits.release()  # wakes a worker waiting for a slot; it sees the call-off
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for conn in (*self.results, *self.orders, *self.releases):
            conn.close()  # a batch released later finds its pipe closed: nothing is written
        self.processes, self.orders, self.results, self.credits = [], [], [], []
        self.releases = []
        self.activities = []


class WorkerPool:
    """`num_workers` processes, each running passes of `source.batches(worker, memory)`.

    `source` is copied into the workers when they start (forked, or pickled for
    forkserver); `source.batches(worker, memory)` yields that worker's batches of the current
    pass, whatever shared state tells it which, with their tensors in `memory` (the worker's
    `BatchBuffers`: `prefetch + 3` buffers kept). `run()` yields them as dicts of lent
    tensors (see `MappedBuffers`); other messages pass as they are. `discard(message)` is
    called on batches of an abandoned pass that arrive after it was called off (default:
    their buffers go back). `timeout_s` (0: none) bounds the wait for a worker's next message.
    `held`: batches the consumer keeps at once (a step's micro-batches under gradient
    accumulation); each worker keeps buffers for its share of them too, so that holding
    them never makes a worker allocate a new buffer.
    """

    def __init__(
        self,
        source: Any,
        num_workers: int,
        *,
        prefetch: int,
        context: str,
        discard: Callable[[Any], None] | None = None,
        timeout_s: float = 0.0,
        held: int = 1,
    ) -> None:
        if context == "forkserver":
            start_forkserver()  # before any semaphore: those start the resource tracker
        ctx: Any = mp.get_context(context)
        self.buffers = MappedBuffers()
        self.discard = discard if discard is not None else self.buffers.drop
        self.timeout_s = timeout_s
        owner = os.getpid()
        main_thread = threading.current_thread() is threading.main_thread()
        self.generation = 0
        self.unfinished: set[int] = set()  # workers that have not ended the last pass
        self.broken = False
        self.pollers: list[select.poll] = []
        self.workers = workers = _Processes(ctx.RawValue("q", 0))  # cancelled: passes <= it
        # Stops the workers when the pool is dropped, and at exit before multiprocessing
        # stops daemonic children: it sends SIGTERM, which workers ignore (see
        # `ignore_job_signals`), then waits for them for ever. Finalizers with an exit
        # priority run first, at interpreter exit and at the end of a multiprocessing child
        # (where atexit hooks do not run): a loader alive then (a module global, the
        # traceback of a crash, a rank process of mp.spawn) would hang the process.
        mp_util.Finalize(self, workers.stop, exitpriority=100)
        for worker in range(num_workers):
            results_in, results_out = ctx.Pipe(duplex=False)
            orders_in, orders_out = ctx.Pipe(duplex=False)
            releases_in, releases_out = ctx.Pipe(duplex=False)
            # a release is written from a finalizer: it must never block (see `buffers.release`)
            os.set_blocking(releases_out.fileno(), False)
            credits = ctx.Semaphore(prefetch)
            activity = ctx.RawArray("c", ACTIVITY_BYTES)
            process = ctx.Process(
                target=_work,
                args=(
                    source,
                    worker,
                    num_workers,
                    results_out,
                    orders_in,
                    releases_in,
                    # in use at once: `prefetch` in flight, the batches the training process
                    # holds (its share of `held`), the one it is receiving (its credit is
                    # back before a held one is dropped), and the one this worker fills
                    prefetch + 2 + -(-held // num_workers),
                    credits,
                    workers.cancelled,
                    activity,
                    owner,
                    main_thread or context != "fork",  # a forkserver forks in its main thread
                ),
                name=f"hpctrain-loader-{worker}",
                daemon=True,
            )
            workers.results.append(results_in)
            workers.orders.append(orders_out)
            workers.releases.append(releases_out)
            workers.credits.append(credits)
            workers.activities.append(activity)
            try:
                with job_signals_blocked():  # the child starts deaf (`ignore_job_signals`)
                    process.start()
            finally:
                results_out.close()  # the worker's ends: its pipe reads EOF once it is gone
                orders_in.close()
                releases_in.close()
            workers.processes.append(process)
            self.buffers.releases[process.pid] = releases_out
            poller = select.poll()
            poller.register(results_in.fileno(), select.POLLIN)
            poller.register(process.sentinel, select.POLLIN)
            self.pollers.append(poller)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.workers.processes]

    def run(self) -> Iterator[Any]:
        """One pass: every worker's batches, round-robin from worker 0, until all have ended.

        A pass left unfinished (the consumer stopped) is called off when the next one starts.
        """
        self._settle()
        self.generation += 1
        generation = self.generation
        for worker, orders in enumerate(self.workers.orders):
            try:
                orders.send(generation)
            except OSError:  # no reader: the worker died between passes (the OOM killer)
                raise self._died(worker) from None
        count = len(self.workers.processes)
        self.unfinished = set(range(count))
        worker = 0
        while True:
            if self.generation != generation:
                raise RuntimeError("this loader pass was called off (a newer one, or close())")
            if not self.unfinished:
                return
            if worker in self.unfinished:
                message = self._receive(worker)
                if isinstance(message, _End):
                    self.unfinished.discard(worker)
                elif isinstance(message, _Failure):
                    raise message.error()
                elif isinstance(message, PooledBatch):
                    yield self.buffers.receive(message)
                else:
                    yield message
            worker = (worker + 1) % count

    def _receive(self, worker: int) -> Any:
        """The worker's next message; a worker that died or stalled instead fails the pool."""
        results = self.workers.results[worker]
        try:
            # one wait for a message or the process's end; a message left by a worker that
            # then died is still read first
            events = self.pollers[worker].poll(
                int(self.timeout_s * 1000) if self.timeout_s > 0 else None
            )
            if not events:
                self.broken = True  # the stuck worker is stopped (killed) with the pool
                raise WorkerTimeoutError(
                    f"loader worker {worker} (pid {self.workers.processes[worker].pid}) sent "
                    f"no batch for {self.timeout_s:g} s (data.timeout_s){self._doing(worker)}"
                )
            ready = {fd for fd, _event in events}
            if results.fileno() in ready:
                message = results.recv()
                if not isinstance(message, (_End, _Failure)):
                    self.workers.credits[worker].release()
                return message
        except (EOFError, OSError):
            pass
        raise self._died(worker)

    def _died(self, worker: int) -> WorkerDiedError:
        """The error of a worker found gone; the pool cannot run again."""
        self.broken = True
        process = self.workers.processes[worker]
        process.join(timeout=1)
        return WorkerDiedError(
            f"loader worker {worker} (pid {process.pid}) exited unexpectedly "
            f"({_describe_exit(process.exitcode)}){self._doing(worker)}"
        )

    def _doing(self, worker: int) -> str:
        """`; it was reading URL`: what the worker last reported."""
        text = _read_activity(self.workers.activities[worker])
        return f"; it was {text}" if text else ""

    def _settle(self) -> None:
        """Call off the pass in progress, if any: drain each worker up to its end."""
        if self.broken:
            raise WorkerDiedError("this pool's workers died or were stopped; it cannot run again")
        if not self.unfinished:
            return
        self.workers.cancelled.value = self.generation
        for worker in sorted(self.unfinished):
            while True:
                message = self._receive(worker)
                if isinstance(message, _End):
                    break
                if not isinstance(message, _Failure):
                    self.discard(message)
        self.unfinished = set()

    def close(self) -> None:
        """Stop the workers (see `_Processes.stop`); a pass still being read ends with an
        error."""
        self.generation += 1
        self.broken = True
        self.workers.stop()
        self.buffers.clear()
        self.unfinished = set()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def seed_worker_globals(seed: int) -> None:
    """Seed Python's and NumPy's global RNGs in a worker (a user's transform may draw from
    them): forked workers would otherwise all repeat the training process's draws."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def run_ahead(
    items: Iterable[Any], work: Callable[[Any], Any], depth: int, name: str
) -> Iterator[Any]:
    """`work(item)` for each item in a thread of its own, up to `depth` items ahead of the
    consumer, in order. For copies that release the GIL (pinning batches), so they overlap
    the training step instead of adding to it."""
    pending: deque[Future[Any]] = deque()
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        try:
            for item in items:
                pending.append(pool.submit(work, item))
                if len(pending) > depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
