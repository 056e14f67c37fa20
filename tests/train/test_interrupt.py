"""Ctrl-C during `hpctrain train`: a real SIGINT to the process group, as a terminal sends it.

The run saves the step it is at, says so in one line and exits 130; the same command then
resumes from that step. A second Ctrl-C stops at once, without a traceback. One process and
`--nproc 2` (whose launcher forwards the signal to ranks in process groups of their own).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.train_kit import REPO, train_args

pytestmark = pytest.mark.slow

SAVED = re.compile(
    r"^hpctrain train: interrupted at step (\d+): saved; run the same command to resume$", re.M
)


def logged_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max((int(r.get("step", 0)) for r in lines if "loss" in r), default=0)


def interrupt(args: list[str], run_dir: Path, *, times: int = 1) -> tuple[int, str]:
    """Start `hpctrain train ARGS` in a process group of its own, send SIGINT to the whole
    group once it logged a step (`times` times, back to back); its exit code and stderr."""
    before = logged_steps(run_dir)  # a resumed run's folder holds the earlier steps
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a job at a terminal
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and logged_steps(run_dir) <= before:
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.05)
    for _ in range(times):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


def slow_run(shards: Path, run_dir: Path) -> list[str]:
    return train_args(
        shards,
        run_dir,
        "train.max_steps=1000",  # never reached: the test interrupts it
        "task=tests.support.slow_tasks:SlowImageClassification",
        "task_options.step_s=0.2",
        "data.val=",
        "checkpoint.monitor=",
        "checkpoint.keep_best=0",
    )


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.distributed)], ids=["one", "two-ranks"]
)
def test_ctrl_c_saves_the_step_says_one_line_and_exits_130(
    shapes_shards: Path, tmp_path: Path, nproc: int
) -> None:
    run_dir = tmp_path / "run"
    args = [*slow_run(shapes_shards, run_dir), "--nproc", str(nproc)]
    code, err = interrupt(args, run_dir)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    saved = SAVED.findall(err)
    assert len(saved) == 1, err[-3000:]  # one line, from rank 0 only
    step = int(saved[0])
    assert (run_dir / "checkpoints" / f"step-{step}").is_dir()
    if nproc > 1:
        return  # the resume below is the same for any number of ranks
    # "run the same command to resume": it starts at the saved step
    code, err = interrupt(args, run_dir)
    assert code == 130, err[-3000:]
    assert f"resumed from step {step}" in err or f"step-{step}" in err, err[-3000:]
    assert int(SAVED.findall(err)[0]) > step


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(
    shapes_shards: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # a step of 3 s: the second Ctrl-C lands before the step ends, so before any save
    args = [*slow_run(shapes_shards, run_dir), "task_options.step_s=3"]
    code, err = interrupt(args, run_dir, times=2)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.rstrip().endswith(
        "hpctrain train: interrupted again: stopped at once (committed checkpoints are kept)"
    ), err[-3000:]
    assert not SAVED.search(err)
