"""`hpctrain status RUN --goodput` of a real job on the dev cluster: a rank killed (a restart
inside the allocation), then a preemption (a requeue), then completion.

The accounting's rules are tested on made-up records in test_goodput.py; here the records
come from the job script, the trainer and SLURM's accounting of one tiny job.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.launch.test_slurm_restarts import CRASHING, EXACT, sbatch
from tests.support.slurm_kit import (
    attempts,
    hpctrain,
    read_metrics,
    scancel,
    train_overrides,
    wait_finished,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def sacct_elapsed_s(job_id: str) -> list[int]:
    """ElapsedRaw of every run of the job (its requeues too), as SLURM accounts them."""
    out = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "ElapsedRaw"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return [int(line) for line in out.split()]


def test_goodput_of_a_restart_and_a_preemption_adds_up_and_counts_the_lost_steps(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """Rank 1 kills itself (SIGKILL) in step 15 of the first attempt, after the checkpoint of
    step 10; the job restarts in its allocation and is preempted (USR2) past step 25, saves,
    requeues and completes (80 steps). The report's parts add up to the job's elapsed time x tasks
    within 2 %, and its lost work is the steps trained twice."""
    run_dir = tmp_path / "run"
    job_id = sbatch(tmp_path, *train_overrides(
        tiny_shards, run_dir, "train.max_steps=80", *EXACT, CRASHING, "task_options.crashes=1",
        "task_options.crash_after=15", "task_options.step_s=0.1",
    ))  # fmt: skip
    jobs.append(job_id)

    def restarted_past_25() -> bool:
        steps = (
            [m["step"] for m in read_metrics(run_dir)]
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        return len(attempts(run_dir)) == 1 and max(steps, default=0) >= 25

    wait_for("the restarted attempt past step 25", restarted_past_25, 240)
    scancel("--signal=USR2", job_id)
    status = wait_finished(run_dir, 300)
    assert status.state == "COMPLETED" and status.requeues == 1, status
    first, preempted, last = attempts(run_dir)
    assert [(r["kind"], r["decision"]) for r in (first, preempted, last)] == [
        ("signal", "restart"), ("preempted", "requeue"), ("completed", "done")
    ], attempts(run_dir)  # fmt: skip

    report = json.loads(hpctrain("status", str(run_dir), "--goodput", "--json").stdout)["goodput"]
    tasks = 2  # one node, two tasks (the local-dev profile), one CPU each
    allocated_h = sum(sacct_elapsed_s(job_id)) * tasks / 3600
    assert (report["source"], report["unit"]) == ("sacct", "CPU core-hours")
    assert report["sum_hours"] == pytest.approx(allocated_h, rel=0.02), report
    parts = report["parts_hours"]
    assert all(hours >= 0 for hours in parts.values()), parts
    assert min(parts["productive"], parts["checkpoint"], parts["startup"], parts["lost"]) > 0
    steps = [m["step"] for m in read_metrics(run_dir)]
    trained_twice = len(steps) - len(set(steps))
    assert report["lost_steps"] == trained_twice == first["step_reached"] - first["committed"] > 0
    assert report["queue_wait_s"] > 0  # the requeue went back through the queue
    assert [row["attempt"] for row in report["rows"] if row["attempt"]] == [1, 2, 3]
    text = hpctrain("status", str(run_dir), "--goodput").stdout
    assert "lost work (trained again)" in text and f"({trained_twice} steps)" in text, text
