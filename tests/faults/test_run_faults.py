"""Faults of a whole run (FAULTS.md): killed, stopped and orphaned ranks; two runs on one folder.

Each test starts real `hpctrain train --nproc 2` runs (gloo on CPU) on tiny shards and injects
the fault from outside, as it happens on a cluster: a signal to one rank or to the launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.checkpoint import committed_steps
from hpctrain.checkpoint.storage import open_store
from tests.train.helpers import REPO, run_hpctrain, train_args

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
        "task=tests.slow_task:SlowImageClassification",
        "task_options.step_s=0.2",
        "train.max_steps=100000",
        "data.val=",
        "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
        "checkpoint.keep_best=0",
        *overrides,
    )


@contextlib.contextmanager
def training(run_dir: Path, shards: Path, *overrides: str) -> Iterator[subprocess.Popen[str]]:
    """A 2-rank run of slow steps (never finishing by itself), yielded once it has trained 2
    steps; every process it started is killed on the way out."""
    args = slow_run_args(run_dir, shards, *overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", *args, "--nproc", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


def test_killed_rank_fails_the_job_in_seconds_naming_it(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    with training(run_dir, shapes_shards) as proc:
        os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # seconds in practice; the bound proves no hang
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "hpctrain train: rank 1 killed by SIGKILL" in err, err[-3000:]


def test_stopped_rank_ends_the_job_within_the_collective_timeout(shapes_shards, tmp_path):
    run_dir = tmp_path / "run"
    with training(run_dir, shapes_shards, "train.collective_timeout_s=10") as proc:
        os.kill(rank_pids(proc.pid)[1], signal.SIGSTOP)
        stopped = time.monotonic()
        # 10 s of timeout + the launcher's 5 s grace; the bound only proves it does not hang
        # for the default 600 s (nor for gloo's 30 min on the extra groups).
        _, err = proc.communicate(timeout=150)
        took = time.monotonic() - stopped
    assert proc.returncode not in (0, None), err[-3000:]
    assert "rank 1 was stopped (hung, not running): killed by the launcher" in err, err[-3000:]
    assert took < 150


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
