"""Faults of a whole run on the real SLURM dev cluster (FAULTS.md).

A hung rank: srun's `--kill-on-bad-exit=1` (in the rendered script) ends every task once the
rank whose collective timed out exits, instead of the stopped one holding the allocation; the
job script then trains again in the same allocation from the newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.slurm_kit import (
    DEMO,
    REPO,
    attempts,
    hpctrain,
    log_text,
    train_overrides,
    trainer_pid,
    wait_finished,
    wait_for,
    wait_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def test_hung_rank_costs_a_restart_within_the_collective_timeout(
    tiny_shards: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    overrides = train_overrides(
        tiny_shards, run_dir, "train.max_steps=40", "train.collective_timeout_s=10",
        "train.heartbeat_timeout_s=0",  # the collective timeout alone (the watcher's: R::)
        "checkpoint.every_steps=2", "task=tests.support.slow_tasks:SlowImageClassification",
        "task_options.step_s=0.1",
    )  # fmt: skip
    hpctrain("sbatch", DEMO, *overrides, "-o", str(script))
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True, text=True, check=True, timeout=30, cwd=REPO,
    ).stdout.strip()  # fmt: skip
    try:
        wait_step(run_dir, 3, 120)
        os.kill(wait_for("rank 1's process", lambda: trainer_pid(job_id, 1), 30), signal.SIGSTOP)
        # 10 s of collective timeout, then srun ends the step and the script starts another
        # attempt; the bound only proves that the stopped rank does not hold the allocation
        # (the default timeout is 600 s).
        status = wait_finished(run_dir, 240)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert status.state == "COMPLETED" and status.requeues == 0, status
    log = log_text(run_dir)
    # gloo words its timeout after 10 s in two ways, depending on where rank 0 waited
    timed_out = ("Timed out waiting 10000ms", "Application timeout caused pair closure")
    assert any(text in log for text in timed_out), log[-3000:]
    assert "task 0: Exited with exit code 7" in log, log[-3000:]  # a distributed error
    first, second = attempts(run_dir)
    # srun wakes the stopped rank (SIGCONT) as it ends the step, and it dies of its peer's
    # exit; its watcher saw it stopped before: the hang is named, not a distributed error
    assert (first["kind"], first["decision"]) == ("hang", "restart"), first
    assert first["first_failure"]["rank"] == 1, first
    assert second["kind"] == "completed"


def test_a_user_error_in_a_submitit_job_is_one_line_its_exit_code_and_in_status(
    tiny_shards: Path, tmp_path: Path
) -> None:
    """A data error in every rank of a `hpctrain submit` job: each task's log ends with the
    CLI's one line (no traceback), sacct shows exit code 3 (data), and `hpctrain status` lists
    the job and that line."""
    run_dir = tmp_path / "run"
    missing = tmp_path / "nowhere" / "index.json"
    out = hpctrain(
        "submit", DEMO, *train_overrides(tiny_shards, run_dir, f"data.train={missing}"),
        "--no-preflight",
    ).stdout  # fmt: skip
    job_id = out.split()[1]
    try:
        status = wait_finished(run_dir, 180)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert status.state == "FAILED" and status.exit_code == "3:0", status
    log = log_text(run_dir)
    assert f"hpctrain train [rank 0]: data error: {missing}" in log
    assert "Traceback" not in log
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "status", str(run_dir)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "FAILED       exit 3:0" in proc.stdout
    assert "error:     hpctrain train [rank " in proc.stdout and str(missing) in proc.stdout
