"""The loader's worker pool: order, errors, dead workers, abandoned passes, parent death.

Real forked worker processes throughout. `pytest.mark.timeout` values are hang detectors
(a leaked slot or a missed death would block for ever), not speed checks.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, ShardReadError, WorkerDiedError, open_index
from hpctrain.data import loader as loader_module
from hpctrain.data.transport import WorkerPool, WorkerTraceback, run_ahead
from tests.support.loader_kit import make_shards


class Counting:
    """Worker w yields (w, i) for i < lengths[w]; `fail` names an item that raises instead."""

    def __init__(self, lengths, fail=None, error=None, delay_s=0.0):
        self.lengths, self.fail, self.error, self.delay_s = lengths, fail, error, delay_s

    def batches(self, worker, memory):
        for i in range(self.lengths[worker]):
            if (worker, i) == self.fail:
                raise self.error
            time.sleep(self.delay_s)
            yield (worker, i)


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickling re-calls the constructor with one argument: fails
        super().__init__(f"{a}/{b}")


def make_pool(source, workers, **kw):
    return WorkerPool(source, workers, prefetch=kw.pop("prefetch", 2), context="fork", **kw)


@pytest.mark.timeout(120)
def test_round_robin_from_worker_0_skipping_workers_that_ended():
    pool = make_pool(Counting([3, 1, 2]), 3)
    try:
        expected = [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]
        assert list(pool.run()) == expected
        assert list(pool.run()) == expected  # the same workers, a second pass
    finally:
        pool.close()
    assert not pool.pids


@pytest.mark.timeout(120)
def test_a_worker_exception_is_raised_here_with_its_url_and_traceback():
    url = "https://user:secret@host/train-000003.tar"
    error = ShardReadError(url, "HTTP 403")
    pool = make_pool(Counting([4, 4], fail=(1, 2), error=error), 2)
    try:
        with pytest.raises(ShardReadError, match="https://host/train-000003.tar: HTTP 403") as e:
            list(pool.run())
        assert e.value.url == "https://host/train-000003.tar" and e.value.reason == "HTTP 403"
        assert "secret" not in str(e.value)
        assert isinstance(e.value.__cause__, WorkerTraceback)
        assert "in loader worker 1" in str(e.value.__cause__)
        assert "in batches" in str(e.value.__cause__)  # the worker's own frames
        # the pool survives a failed pass: the next one drains the old one first
        with pytest.raises(ShardReadError):
            list(pool.run())
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_an_exception_that_cannot_be_pickled_arrives_as_text():
    pool = make_pool(Counting([2], fail=(0, 1), error=Unpicklable(1, 2)), 1)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)in loader worker 0 .*Unpicklable: 1/2"):
            list(pool.run())
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_killed_worker_fails_the_pass_at_once_and_the_loader_starts_new_ones(tmp_path):
    pool = make_pool(Counting([50, 50], delay_s=0.05), 2)
    try:
        batches = pool.run()
        next(batches)
        os.kill(pool.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"loader worker 1 \(pid \d+\).*SIGKILL") as died:
            list(batches)
        assert died.value.exit_code == 8  # transient: the job script restarts the run
        assert pool.broken
        with pytest.raises(WorkerDiedError):
            list(pool.run())
    finally:
        pool.close()

    make_shards(tmp_path, [40, 40])  # 20 batches per worker: more than it sends ahead
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=0, persistent_workers=True)
    loader = ShardedLoader(open_index(str(tmp_path)), data, rank=0, world_size=1, seed=0)
    full = [b["key"] for b in loader]
    batches = iter(loader)
    next(batches)
    os.kill(loader._pool.pids[0], signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        list(batches)  # batches already sent before the kill may still come first
    done = loader.position
    assert 1 <= done < len(full)
    assert [b["key"] for b in loader] == full[done:]  # the rest of the epoch, new workers
    loader.close()


@pytest.mark.timeout(120)
def test_a_worker_killed_between_passes_fails_the_next_pass_as_a_dead_worker():
    """Persistent workers wait between epochs, and the OOM killer does not wait for a pass:
    the next pass's order to the dead worker was a BrokenPipeError, exit 1, an `error`
    (#47's chaos test on the dev cluster); it is the worker's death (exit 8, transient)."""
    pool = make_pool(Counting([2, 2]), 2)
    try:
        list(pool.run())
        os.kill(pool.pids[1], signal.SIGKILL)
        pool.workers.processes[1].join(timeout=30)
        with pytest.raises(WorkerDiedError, match=r"loader worker 1 \(pid \d+\).*SIGKILL") as died:
            list(pool.run())
        assert died.value.exit_code == 8 and pool.broken
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_pass_read_after_close_fails_clearly():
    pool = make_pool(Counting([5, 5]), 2)
    batches = pool.run()
    next(batches)
    pool.close()
    with pytest.raises(RuntimeError, match=r"called off \(a newer one, or close\(\)\)"):
        next(batches)
    with pytest.raises(WorkerDiedError, match="cannot run again"):
        next(pool.run())


@pytest.mark.timeout(180)
def test_abandoned_passes_leave_no_slot_behind():
    """Each abandoned pass is drained when the next starts; a slot lost per pass would
    leave the workers waiting for ever after `prefetch` of them."""
    dropped = []
    pool = make_pool(Counting([30, 30]), 2, prefetch=2, discard=dropped.append)
    try:
        for _ in range(6):
            batches = pool.run()
            assert next(batches) == (0, 0)
            # give the workers time to send what their slots allow, so that the next pass
            # has batches of this one to drain (under load they may not have yet)
            time.sleep(0.5)
            del batches
        assert len(list(pool.run())) == 60
        assert dropped and all(isinstance(d, tuple) for d in dropped)
    finally:
        pool.close()


PARENT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from tests.data.test_workers import Counting, make_pool

    pool = make_pool(Counting([100, 100], delay_s=0.05), 2)
    batches = pool.run()
    next(batches)
    print(*pool.pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_workers_exit_when_the_training_process_is_killed():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", PARENT, root], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)


FORKSERVER_PARENT = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.data.test_workers import Counting, _parent
    from hpctrain.data.transport import WorkerPool
    if __name__ == "__main__":
        pool = WorkerPool(Counting([100]), 1, prefetch=2, context="forkserver")
        batches = pool.run()
        next(batches)
        time.sleep(1.0)  # the worker waits for a slot (prefetch full), as in a long step
        print(*pool.pids, _parent(pool.pids[0]), flush=True)  # the worker, the forkserver
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_forkserver_workers_exit_when_the_training_process_is_killed():
    """A forkserver worker's parent is the forkserver, which stays alive while any worker
    holds its pipe: the workers must watch the training process itself (they used to wait
    for a slot for ever)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", FORKSERVER_PARENT, root], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    *pids, server = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1 and server not in (1, *pids)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(p) for p in [*pids, server]):
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)
    assert not _running(server)  # the forkserver ends once its last client is gone


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _helpers_of(pid: int, marker: str) -> list[int]:
    """Children of `pid` whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if _parent(int(entry)) != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def job_signals_mid_pass() -> None:
    """The body of the next test, run in a fresh interpreter (`SIGNALS_PARENT`)."""
    expected = [(0, i) for i in range(24)]
    pool = WorkerPool(Counting([24], delay_s=0.02), 1, prefetch=2, context="forkserver")
    try:
        batches = pool.run()
        got = [next(batches) for _ in range(3)]
        server = _parent(pool.pids[0])
        assert server != os.getpid()
        helpers = [server, *_helpers_of(os.getpid(), "resource_tracker")]
        assert len(helpers) == 2, helpers
        for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            for pid in helpers:
                os.kill(pid, signum)
        time.sleep(0.5)  # a signal's default action would have ended them by now
        got += list(batches)
        assert got == expected
        assert all(_running(pid) for pid in helpers), "a helper died of a job signal"
        assert list(pool.run()) == expected  # and the next epoch, from the same workers
    finally:
        pool.close()


SIGNALS_PARENT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from tests.data.test_workers import job_signals_mid_pass
    if __name__ == "__main__":
        job_signals_mid_pass()
        print("whole")
    """
)


@pytest.mark.timeout(300)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_job_signals_to_the_forkserver_mid_pass_leave_the_pass_whole():
    """SLURM signals every process of the step: USR2 before the time limit, TERM, USR1 for
    stack dumps. The forkserver (and its resource tracker) used to die of them, and its
    workers with it (their parent-death signal): "worker died" mid-epoch. In a fresh
    interpreter, as a training process starts them: in this one an earlier test may have
    started multiprocessing's helpers already (they are started once per process)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", SIGNALS_PARENT, root], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["whole"], proc.stderr[-3000:]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_ahead_keeps_order_and_depth_and_raises_in_order():
    started = []
    threads = set()

    def work(x):
        started.append(x)
        threads.add(threading.current_thread().name)
        if x == 5:
            raise ValueError("five")
        return x * 10

    out = run_ahead(iter(range(8)), work, depth=2, name="ahead")
    got = [next(out), next(out)]
    assert got == [0, 10]
    assert max(started) <= 4  # at most `depth` items beyond the consumer, one submitted
    with pytest.raises(ValueError, match="five"):
        for x in out:
            got.append(x)
    assert got == [0, 10, 20, 30, 40]
    assert all(name.startswith("ahead") for name in threads)


@pytest.mark.timeout(120)
def test_cuda_batches_are_pinned_in_a_thread_ahead_of_the_trainer(tmp_path, monkeypatch):
    """This machine has no GPU: `pin_memory()` needs CUDA, so pinning is replaced by a copy
    that records its thread. The loader's pipeline around it is the real one."""
    make_shards(tmp_path, [10, 6])
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=4, pin_memory=True)
    index = open_index(str(tmp_path))
    plain = [b["key"] for b in ShardedLoader(index, data, rank=0, world_size=1, seed=3)]
    pins = []

    def fake_pin(batch):
        pins.append(threading.current_thread().name)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    monkeypatch.setattr(loader_module, "pin_batch", fake_pin)
    loader = ShardedLoader(index, data, rank=0, world_size=1, seed=3, device="cuda")
    pinned = [b["key"] for b in loader]
    assert pinned == plain and len(pins) == len(plain)
    assert all(name.startswith("hpctrain-pin") for name in pins)
    assert loader.position == len(loader)
    loader.close()


def draw(sample):
    sample["label"] = random.randrange(10**9)  # a transform using Python's global RNG
    return sample


@pytest.mark.timeout(120)
def test_python_random_differs_across_workers_and_repeats_across_runs(tmp_path):
    make_shards(tmp_path, [8, 8, 8, 8])
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=0)

    def labels():
        loader = ShardedLoader(
            open_index(str(tmp_path)), data, rank=0, world_size=1, seed=5, transform=draw
        )
        out = [b["label"].tolist() for b in loader]
        loader.close()
        return out

    first = labels()
    assert first == labels()
    assert first[0] != first[1]  # worker 0's and worker 1's first batches


@pytest.mark.timeout(300)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_workers_started_from_a_forkserver(tmp_path, monkeypatch):
    """What a GPU run uses (a forked child of a CUDA process cannot use CUDA): the dataset,
    pipes and semaphores are pickled to the workers instead of inherited."""
    pool = WorkerPool(Counting([2, 1]), 2, prefetch=2, context="forkserver")
    try:
        assert list(pool.run()) == [(0, 0), (1, 0), (0, 1)]
    finally:
        pool.close()
    make_shards(tmp_path, [6, 6])
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=3)
    index = open_index(str(tmp_path))
    forked = [b["key"] for b in ShardedLoader(index, data, rank=0, world_size=1, seed=2)]
    monkeypatch.setattr(loader_module, "worker_start_method", lambda: "forkserver")
    loader = ShardedLoader(index, data, rank=0, world_size=1, seed=2)
    assert [b["key"] for b in loader] == forked
    loader.close()


def which_worker(sample):
    info = torch.utils.data.get_worker_info()  # as a user's transform might ask
    sample["label"] = -1 if info is None else info.id * 10 + info.num_workers
    return sample


@pytest.mark.timeout(120)
def test_get_worker_info_answers_in_the_workers(tmp_path):
    make_shards(tmp_path, [8, 8])
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=0)
    index = open_index(str(tmp_path))
    loader = ShardedLoader(index, data, rank=0, world_size=1, seed=5, transform=which_worker)
    labels = [b["label"].tolist() for b in loader]
    loader.close()
    assert labels[0] == [2, 2] and labels[1] == [12, 12]  # worker 0, then worker 1, of 2
