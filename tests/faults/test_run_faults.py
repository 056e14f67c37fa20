"""Faults of a whole run (FAULTS.md): killed, stopped and orphaned ranks; two runs on one folder.

Each test starts real `hpctrain train --nproc 2` runs (gloo on CPU) on tiny shards and injects
the fault from outside, as it happens on a cluster: a signal to one rank or to the launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.checkpoint import committed_steps
from hpctrain.checkpoint.storage import open_store
from tests.support.train_kit import REPO, run_hpctrain, train_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/stat (field 4 is the parent's pid)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                pids.append(int(stat.parent.name))
    return pids


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; not gone and not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def rank_pids(launcher: int, nproc: int = 2) -> dict[int, int]:
    """rank → pid of the ranks the launcher started (from their RANK variable)."""
    ranks = {}
    for pid in children(launcher):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for item in environ:
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = pid
    assert sorted(ranks) == list(range(nproc)), ranks
    return ranks


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"kind": "train"') if metrics.exists() else 0


def slow_run_args(run_dir: Path, shards: Path, *overrides: str) -> list[str]:
    """`hpctrain train` arguments of a run whose steps last 0.2 s and that never ends by itself."""
    return train_args(
        shards,
        run_dir,
        "task=tests.support.slow_tasks:SlowImageClassification",
        "task_options.step_s=0.2",
        "train.max_steps=100000",
        "data.val=",
        "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
        "checkpoint.keep_best=0",
        *overrides,
    )


@contextlib.contextmanager
def training(
    run_dir: Path, shards: Path, *overrides: str, own_group: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """A 2-rank run of slow steps (never finishing by itself), yielded once it has trained 2
    steps; every process it started is killed on the way out. `own_group`: the launcher
    leads a process group of its own (with the ranks and their helpers), as a job step's
    processes are, for `os.killpg`."""
    args = slow_run_args(run_dir, shards, *overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", *args, "--nproc", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while logged_steps(run_dir) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)
        started.update(descendants(proc.pid))
        yield proc
    finally:
        started.update(descendants(proc.pid))
        for pid in [proc.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)


def loader_workers(trainer: int) -> list[int]:
    """The loader workers of a training process: its descendants running the same command
    (forked), not the helpers multiprocessing starts with commands of their own."""
    command = Path(f"/proc/{trainer}/cmdline").read_bytes()
    found = []
    for pid in descendants(trainer):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == command:
                found.append(pid)
    return found


def test_a_loader_worker_killed_mid_training_is_a_transient_exit_that_is_restarted(
    shapes_shards, tmp_path
):
    """The OOM killer's likeliest victim on a node: SIGKILL of a loader worker of one
    training process, run as the job script runs each rank (under the attempt's watcher).
    The rank leaves exit 8 (srun's status, and the rank's record), one line naming the worker
    and the signal; `attempts end` names it `transient` and restarts (it was exit 3, the
    user's data error, and the job stopped)."""
    from hpctrain.resilience.rank_ends import read_ranks
    from hpctrain.resilience.restart_policy import Policy, classify, decide

    run_dir, attempt = tmp_path / "run", tmp_path / "attempt"
    attempt.mkdir()
    env = {**os.environ, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain.resilience.watch", str(attempt), "--", "train",
         *slow_run_args(run_dir, shapes_shards)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while logged_steps(run_dir) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)
        (trainer,) = children(proc.pid)
        (worker,) = loader_workers(trainer)  # data.workers_per_rank=1
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 8, err[-3000:]  # what srun returns the job script
    assert (
        f"hpctrain train: data error (transient): loader worker 0 (pid {worker}) exited "
        "unexpectedly (killed by SIGKILL)"
    ) in err, err[-3000:]
    ranks = read_ranks(attempt, ["n1"], 1)
    assert (ranks[0].exit_code, ranks[0].signal) == (8, None)
    failure = classify(ranks, srun_status=8)
    verdict = decide(failure, history=[], policy=Policy(nodes=1), step_reached=3,
                     committed_start=None, committed_end=2, restarts_here=0, requeues=0,
                     job_running=True)  # fmt: skip
    assert (failure.kind, verdict.action, verdict.exclude) == ("transient", "restart", ())


def test_killed_rank_fails_the_job_in_seconds_naming_it(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    with training(run_dir, shapes_shards) as proc:
        os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # seconds in practice; the bound proves no hang
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "hpctrain train: rank 1 killed by SIGKILL" in err, err[-3000:]


def test_stopped_rank_ends_the_job_within_the_collective_timeout(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    # no watcher here (a local run): the collective timeout is what ends it (a heartbeat
    # floor above it would be refused: docs/clusters.md, timeouts)
    timeouts = ("train.collective_timeout_s=10", "train.heartbeat_timeout_s=0")
    with training(run_dir, shapes_shards, *timeouts) as proc:
        os.kill(rank_pids(proc.pid)[1], signal.SIGSTOP)
        stopped = time.monotonic()
        # 10 s of timeout + the launcher's 5 s grace; the bound only proves it does not hang
        # for the default 600 s (nor for gloo's 30 min on the extra groups).
        _, err = proc.communicate(timeout=150)
        took = time.monotonic() - stopped
    assert proc.returncode not in (0, None), err[-3000:]
    assert "rank 1 was stopped (hung, not running): killed by the launcher" in err, err[-3000:]
    assert took < 150
    # Rank 0 wrote where it waited before giving up; its error and the launcher name the folder.
    (folder,) = (run_dir / "hangs").glob("*Z")
    text = (folder / "rank-0.txt").read_text()
    assert "a collective timed out (train.collective_timeout_s=10 s)" in text, text
    assert "The call that timed out" in text and "trainer.py" in text, text
    # Waiting in DDP's forward or backward, or in the flags' all-reduce: torch.distributed.
    assert any(f"in {name}" in text for name in ("train_step", "agree_on_flags")), text
    assert "site-packages/torch/" in text and "distributed" in text, text
    assert "Python stacks of all threads" in text, text
    assert "hang error: a collective waited train.collective_timeout_s=10 s" in err, err[-3000:]
    launcher_line = err.strip().splitlines()[-1]
    # exit 7: a distributed error, retried by the job script (docs/errors.md)
    assert launcher_line.startswith("hpctrain train: rank 0 exited with code 7"), launcher_line
    assert launcher_line.endswith(f"Python stacks in {folder} (rank-0.txt)"), launcher_line


def test_sigusr1_writes_every_ranks_stacks_and_training_goes_on(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    with training(run_dir, shapes_shards) as proc:
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher forwards it to every rank
        folders = lambda: list((run_dir / "hangs").glob("*Z"))  # noqa: E731
        wait_for(
            lambda: len(folders()) == 1 and len(list(folders()[0].glob("rank-*.txt"))) == 2,
            "both ranks' stacks in one folder",
        )
        steps = logged_steps(run_dir)
        wait_for(lambda: logged_steps(run_dir) >= steps + 2, "training to go on")
        assert proc.poll() is None
    for rank in (0, 1):
        text = (folders()[0] / f"rank-{rank}.txt").read_text()
        assert text.startswith(f"rank {rank} on ") and "SIGUSR1 received" in text, text
        assert "in fit" in text, text  # the main thread's frames, mid-training


def test_a_step_over_step_timeout_s_writes_the_stacks_and_ends_the_run(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(
        shapes_shards,
        run_dir,
        "task=tests.support.hang_tasks:StuckImageClassification",
        "train.max_steps=20",
        "train.step_timeout_s=3",
        "train.collective_timeout_s=2",  # below the step's deadline (docs/clusters.md, timeouts)
        "train.heartbeat_timeout_s=0",
        "data.val=",
        "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
        "checkpoint.keep_best=0",
    )
    started = time.monotonic()
    done = run_hpctrain("train", *args, check=False, timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - started < 240
    (folder,) = (run_dir / "hangs").glob("*Z")
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "hpctrain train: hang error: no training step finished within train.step_timeout_s=3 s "
        "(step 3 ran 3 s)"
    ), line
    assert line.endswith(f"Python stacks of every thread in {folder}"), line
    text = (folder / "rank-0.txt").read_text()
    assert "in wait_for_a_file_that_never_comes" in text, text  # where it hung
    assert logged_steps(run_dir) == 2


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_straggling_rank_is_named_in_the_metrics_and_the_log(
    shapes_shards: Path, tmp_path: Path, where: str
) -> None:
    """Rank 1 sleeps 0.15 s per step before or after its forward (issue #38 item 7: before
    it, a time taken up to the backward was the same on both ranks)."""
    run_dir = tmp_path / "run"
    args = train_args(
        shapes_shards,
        run_dir,
        "task=tests.support.hang_tasks:StragglingImageClassification",
        "task_options.sleep_s=0.15",
        f"task_options.where={where}",
        "train.max_steps=10",
        "data.val=",
        "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
        "checkpoint.keep_best=0",
    )
    done = run_hpctrain("train", *args, "--nproc", "2", timeout=240)
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in line
    ]
    assert len(records) == 10
    # From the third logged step (the arrivals of a step after the first boundary) on
    named = [r for r in records if "wait_for_slowest_s" in r]
    seen = [(r["step"], r["slowest_rank"], round(r["wait_for_slowest_s"], 3)) for r in named]
    assert len(named) >= 7, records
    assert [rank for _, rank, _ in seen].count(1) >= 0.8 * len(named), seen
    # the earliest rank waits for the 0.15 s (one process's scheduling noise aside)
    assert statistics.median(wait for _, rank, wait in seen if rank == 1) >= 0.1, seen
    warnings = [line for line in done.stderr.splitlines() if "straggler: rank" in line]
    # Once per occurrence (a busy machine may cut one in two: test_step_metrics.py pins it).
    assert 1 <= len(warnings) <= 2, done.stderr[-3000:]
    assert all(
        f"straggler: rank 1 on {socket.gethostname()} holds the others" in w for w in warnings
    )


def test_slurm_signals_to_every_process_of_a_run_leave_its_loader_working(shapes_shards, tmp_path):
    """What SLURM does: the signal goes to every process of the step (here, the run's
    process group), forkserver and loader workers included. USR1 dumps stacks and training
    goes on; USR2 saves and exits with the requeue code. Before, the forkserver died of
    either and its workers with it: "worker died" before the save."""
    run_dir = tmp_path / "run"
    task = "task=tests.support.slow_tasks:ForkserverSlowImageClassification"
    with training(run_dir, shapes_shards, task, own_group=True) as proc:
        servers = [  # one per rank: the loader's workers come from there
            pid
            for rank in rank_pids(proc.pid).values()
            for pid in children(rank)
            if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(servers) == 2, servers
        os.killpg(proc.pid, signal.SIGUSR1)
        wait_for(lambda: len(list((run_dir / "hangs").glob("*Z/rank-*.txt"))) == 2, "dumps")
        steps = logged_steps(run_dir)
        wait_for(lambda: logged_steps(run_dir) >= steps + 3, "training to go on")
        assert all(alive(pid) for pid in servers)
        os.killpg(proc.pid, signal.SIGUSR2)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "exited unexpectedly" not in err, err[-3000:]  # no WorkerDiedError
    assert committed_steps(open_store(str(run_dir / "checkpoints")))


def test_ranks_and_their_workers_die_with_a_killed_launcher(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    with training(run_dir, shapes_shards) as proc:
        family = descendants(proc.pid)
        assert len(family) >= 4, family  # 2 ranks, 1 loader worker each
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = [pid for pid in family if alive(pid)]
        steps = logged_steps(run_dir)
        time.sleep(1.0)
        assert not orphans and logged_steps(run_dir) == steps, f"still training: {orphans}"


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_second_run_on_the_same_folder_fails_at_once_then_takes_over_a_dead_holder(
    shapes_shards, tmp_path
):
    run_dir = tmp_path / "run"
    args = slow_run_args(run_dir, shapes_shards, "checkpoint.every_steps=2")
    with training(run_dir, shapes_shards, "checkpoint.every_steps=2") as first:
        holder = rank_pids(first.pid)[0]  # rank 0 holds the lock
        second = run_hpctrain("train", *args, "--nproc", "2", check=False, timeout=240)
        assert second.returncode == 5, second.stderr[-3000:]
        line = next(x for x in second.stderr.splitlines() if "run folder locked" in x)
        assert str(run_dir / "checkpoints" / ".lock") in line, line
        assert f"pid {holder}, SLURM job none, since " in line, line
        # The first run goes on undisturbed: it trains and commits checkpoints.
        steps = logged_steps(run_dir)
        wait_for(lambda: logged_steps(run_dir) >= steps + 3, "the first run to go on")
        assert first.poll() is None
        family = descendants(first.pid)
        os.kill(first.pid, signal.SIGKILL)  # the holder dies (its ranks with it)
        first.wait()
        wait_for(lambda: not any(alive(pid) for pid in family), "the first run's ranks to die")
    # A new run (a requeued job, a manual restart) takes over the folder and resumes.
    saved = committed_steps(open_store(str(run_dir / "checkpoints")))[-1]
    third = run_hpctrain(
        "train",
        *args,
        f"train.max_steps={saved + 1}",
        "task_options.step_s=0",
        "--nproc",
        "2",
        timeout=240,
    )
    assert f"resumed from step {saved}" in third.stderr, third.stderr[-3000:]


def test_a_rank_whose_peer_died_exits_7_though_sruns_term_comes_while_it_unwinds(
    shapes_shards, tmp_path
):
    """Under srun, once a rank has died the others get TERM (`--kill-on-bad-exit`) while they
    unwind from the distributed error. The trainer used to give TERM back its default action
    there: the survivor died of SIGTERM one run and exited 7 another, and the attempt was
    `lost` or `hang` by chance (#47). It keeps noting TERM until it exits: always 7."""
    from hpctrain.launch.local import free_port

    run_dir, port = tmp_path / "run", free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpctrain", "train", *slow_run_args(run_dir, shapes_shards)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while logged_steps(run_dir) < 2:
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)
        procs[1].kill()
        procs[1].wait(timeout=60)
        while procs[0].poll() is None:  # srun's TERM, from now until it is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[0].pid, signal.SIGTERM)
            time.sleep(0.01)
        err = procs[0].communicate(timeout=60)[1]
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode == 7, err[-3000:]
    assert "distributed error: a peer rank went away" in err, err[-3000:]
