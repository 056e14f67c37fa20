"""Failures SLURM does not announce, on the dev cluster: a rank killed, a bad node, a crash loop.

Each job is tiny and bounded; every job a test starts is cancelled when it ends. The rules
behind what happens are tested without SLURM in test_restart_policy.py and, with the job
script run by bash and SLURM stubbed, in test_attempt_loop.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.resilience.recovery import PHASES
from tests.launch.test_slurm_cluster import SLOW_STEPS, assert_same_weights
from tests.support.slurm_kit import (
    DEMO,
    REPO,
    attempts,
    hpctrain,
    log_text,
    submit,
    train_overrides,
    trainer_pid,
    wait_finished,
    wait_for,
    wait_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

# Bitwise-comparable runs: in-process loading, deterministic kernels, a checkpoint every 10
# steps (a restart resumes from the newest one), no evaluation.
EXACT = ("train.deterministic=true", "data.workers_per_rank=0", "checkpoint.every_steps=10",
         "data.val=", "checkpoint.monitor=", "checkpoint.keep_best=0")  # fmt: skip
CRASHING = "task=tests.support.crash_tasks:CrashingImageClassification"


def sbatch(tmp_path: Path, *overrides: str, options: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> str:  # fmt: skip
    """Render the job script with `hpctrain sbatch` and submit it with plain sbatch."""
    script = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.sbatch"
    hpctrain("sbatch", DEMO, *overrides, "-o", str(script))
    return subprocess.run(
        ["sbatch", "--parsable", *options, str(script)],
        capture_output=True, text=True, check=True, timeout=30, cwd=REPO,
        env={**os.environ, **(env or {})},
    ).stdout.strip()  # fmt: skip


def scontrol_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=30).stdout  # fmt: skip


def test_kill_9_of_a_rank_restarts_in_the_job_to_the_same_weights(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """A plain sbatch job: rank 1 dies of SIGKILL mid-run; the job trains again in its own
    allocation (same job id, no requeue) from the newest checkpoint, and ends with the weights
    of a run that was never interrupted."""
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    # 0.1 s a step at least: the 45 steps after step 15 outlast the kill's way there
    same = ("train.max_steps=60", *EXACT, *SLOW_STEPS, "task_options.step_s=0.1")
    jobs.append(sbatch(tmp_path, *train_overrides(tiny_shards, straight, *same)))
    job_id = sbatch(tmp_path, *train_overrides(tiny_shards, killed, *same))
    jobs.append(job_id)
    wait_step(killed, 15, 180)
    os.kill(wait_for("rank 1's trainer", lambda: trainer_pid(job_id, 1), 30), signal.SIGKILL)
    status = wait_finished(killed, 300)
    assert status.state == "COMPLETED" and status.requeues == 0, status
    first, second = attempts(killed)
    assert (first["job_id"], second["job_id"]) == (job_id, job_id)
    assert (first["kind"], first["decision"]) == ("signal", "restart"), first
    assert first["first_failure"]["rank"] == 1 and first["first_failure"]["signal"] == "SIGKILL"
    assert first["first_failure"]["node"] == "n1" and first["committed"] >= 10
    assert (second["kind"], second["resumed_from"]) == ("completed", first["committed"])
    # the restart's seconds, phase by phase: every one measured, and they add up
    phases = second["recovery"]["phases"]
    assert all(isinstance(phases[p], float) for p in PHASES), second["recovery"]
    assert second["recovery"]["total_s"] == pytest.approx(sum(phases.values()))
    assert not list((killed / "slurm" / "attempts" / "2").glob("probe-*.json"))  # none then
    log = log_text(killed)
    # every rank of both attempts forked by the node's fork server
    assert "fork server on n1: ready" in log and "starts afresh" not in log, log[-3000:]
    assert "hpctrain: attempt 1: rank 1 on n1 killed by SIGKILL at step" in log, log[-3000:]
    assert wait_finished(straight, 240).state == "COMPLETED"
    assert_same_weights(killed / "checkpoints" / "step-60", straight / "checkpoints" / "step-60",
                        tmp_path)  # fmt: skip
    out = hpctrain("status", str(killed)).stdout
    assert "signal      restart  rank 1 on n1 killed by SIGKILL" in out, out


def test_a_stopped_rank_is_found_by_its_watcher_with_the_default_timeouts(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """`kill -STOP` of rank 1's trainer, every timeout at its default: no collective ever
    times out for 600 s, but the rank's watcher sees its heartbeat stop, takes its stacks and
    kills it after max(30 s, 5 x the slowest step); the attempt is a `hang` naming rank 1 (not
    rank 0, stuck waiting for it), and the job trains on in its allocation (#47: 610 s)."""
    run_dir = tmp_path / "run"
    overrides = ("train.max_steps=40", *SLOW_STEPS, "task_options.step_s=0.1",
                 "checkpoint.every_steps=10", "data.val=", "checkpoint.monitor=",
                 "checkpoint.keep_best=0")  # fmt: skip
    job_id = sbatch(tmp_path, *train_overrides(tiny_shards, run_dir, *overrides))
    jobs.append(job_id)
    wait_step(run_dir, 12, 180)
    os.kill(wait_for("rank 1's trainer", lambda: trainer_pid(job_id, 1), 30), signal.SIGSTOP)
    stopped = time.time()
    # the bound only proves it is not the collective timeout (600 s); the goal is 60 s
    first = wait_for("the attempt's decision", lambda: next(iter(attempts(run_dir)), None), 150)
    print(f"stopped rank decided {first['end'] - stopped:.1f} s after kill -STOP")
    assert (first["kind"], first["decision"]) == ("hang", "restart"), first
    failure = first["first_failure"]
    assert (failure["rank"], failure["node"], failure["stopped"]) == (1, "n1", True), failure
    assert failure["time"] <= stopped + 1 < failure["detected"]  # its last beat, then found
    status = wait_finished(run_dir, 240)
    assert status.state == "COMPLETED" and status.requeues == 0, status
    assert attempts(run_dir)[-1]["kind"] == "completed"
    log = log_text(run_dir)
    assert "hpctrain watch: rank 1 on n1 made no progress for" in log, log[-3000:]
    assert list((run_dir / "hangs").glob("*/rank-1.txt")), "no stacks of the stopped rank"
    report = json.loads(hpctrain("status", str(run_dir), "--goodput", "--json").stdout)
    assert report["goodput"]["parts_hours"]["hung"] > 0  # the wait on it, not the tail


def test_a_submitit_run_killed_three_times_completes_to_the_same_weights(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """`hpctrain submit` on two nodes: a rank dies of SIGKILL in every attempt's 15th step,
    three times, on n1, n2, then n1 again (a node that fails twice running is set aside,
    through a requeue without a spare); each attempt committed a checkpoint first, so the run
    keeps going (max_no_progress counts attempts without one) and completes in its first
    allocation."""
    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    same = ("train.max_steps=60", "slurm.nodes=2", "slurm.gpus_per_node=1", *EXACT, *SLOW_STEPS)
    jobs += submit(*train_overrides(tiny_shards, straight, *same))
    jobs += submit(*train_overrides(tiny_shards, crashed, *same, CRASHING, "task_options.crash_rank=-1",
                                    "task_options.crash_after=15", "task_options.crashes=3"))  # fmt: skip
    status = wait_finished(crashed, 420)
    assert status.state == "COMPLETED" and status.requeues == 0, status
    records = attempts(crashed)
    assert [(r["kind"], r["decision"]) for r in records] == [("signal", "restart")] * 3 + [
        ("completed", "done")
    ], records
    assert {r["job_id"] for r in records} == {jobs[-1]}
    assert [(r["first_failure"]["rank"], r["first_failure"]["node"]) for r in records[:3]] == [
        (0, "n1"),
        (1, "n2"),
        (0, "n1"),
    ]
    assert [r["resumed_from"] for r in records] == [None, 10, 20, 30]
    assert wait_finished(straight, 240).state == "COMPLETED"
    assert_same_weights(crashed / "checkpoints" / "step-60", straight / "checkpoints" / "step-60",
                        tmp_path)  # fmt: skip


def probe_marker(tmp_path: Path, node: str) -> dict[str, str]:
    """The job's TMPDIR, where `node`'s probe file cannot be written (a folder in its way):
    that node alone fails its `local temp` check."""
    temp = tmp_path / "tmp"
    (temp / f"hpctrain-probe-{node}").mkdir(parents=True)
    return {"TMPDIR": str(temp)}


def test_a_spare_node_replaces_one_that_fails_its_probe(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    jobs.append(sbatch(
        tmp_path,
        *train_overrides(tiny_shards, run_dir, "train.max_steps=4", "slurm.nodes=2",
                         "slurm.spare_nodes=1", "slurm.gpus_per_node=1"),
        env=probe_marker(tmp_path, "n2"),
    ))  # fmt: skip
    status = wait_finished(run_dir, 240)
    assert status.state == "COMPLETED", status
    (only,) = attempts(run_dir)
    assert (only["nodes"], only["kind"]) == (["n1", "n3"], "completed"), only
    assert list(only["set_aside"]) == ["n2"] and only["set_aside"]["n2"].startswith("local temp: ")
    log = log_text(run_dir)
    assert "hpctrain probe: n2 failed local temp: " in log
    assert "hpctrain: attempt 1 (job " in log and "probes n1,n2,n3" in log


def test_without_a_spare_the_job_requeues_excluding_the_bad_node_and_yours(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    job_id = sbatch(
        tmp_path, *train_overrides(tiny_shards, run_dir, "train.max_steps=4"),
        options=("--exclude=n2",), env=probe_marker(tmp_path, "n1"),
    )  # fmt: skip
    jobs.append(job_id)
    status = wait_finished(run_dir, 240)
    assert status.state == "COMPLETED" and status.requeues == 1, status
    excluded = next(w for w in scontrol_job(job_id).split() if w.startswith("ExcNodeList="))
    assert set(excluded.removeprefix("ExcNodeList=").split(",")) == {"n1", "n2"}, excluded
    probe, done = attempts(run_dir)
    assert (probe["kind"], probe["decision"], probe["nodes"]) == ("probe", "requeue", [])
    assert (done["kind"], done["nodes"], done["restart"]) == ("completed", ["n3"], 1)
    assert f"hpctrain: requeueing job {job_id} without n1" in log_text(run_dir)


def test_a_config_error_is_one_attempt(tiny_shards: Path, tmp_path: Path, jobs: list[str]) -> None:
    run_dir = tmp_path / "run"
    jobs += submit(*train_overrides(tiny_shards, run_dir, "task=tests.support.no_such:Task"),
                   "--no-preflight")  # fmt: skip
    status = wait_finished(run_dir, 180)
    assert status.state == "FAILED" and status.exit_code == "2:0", status
    (only,) = attempts(run_dir)
    assert (only["kind"], only["decision"], only["exit_code"]) == ("user", "stop", 2), only


def test_a_task_that_always_crashes_stops_for_lack_of_progress(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    jobs.append(sbatch(tmp_path, *train_overrides(
        tiny_shards, run_dir, "train.max_steps=100", CRASHING, "task_options.crash_after=2",
        "checkpoint.every_steps=50",
    )))  # fmt: skip
    status = wait_finished(run_dir, 300)
    assert status.state == "FAILED", status  # sacct words the script's exit 137 as 9:0
    assert [(r["decision"], r["exit_code"]) for r in attempts(run_dir)] == [
        ("restart", 0),
        ("stop", 128 + signal.SIGKILL),
    ]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "status", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "stopped: no progress (2 attempts in a row committed no checkpoint" in proc.stdout
    assert "last failure: rank 1 on n1 killed by SIGKILL at step" in proc.stdout
