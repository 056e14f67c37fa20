"""A chaos run on the dev cluster: four failures in one allocation, recovered inside it.

One 2-node DDP job with a spare node trains with loader workers while the test injects, one
after the other and each once the run has committed a new checkpoint since the failure
before:

1. a loader worker of rank 1 killed by SIGKILL (as the OOM killer kills its likeliest
   victim): `transient`, restarted in place, no node blamed;
2. rank 1's node lost: its watcher, its rank and its slurmd killed: `lost`, the node set
   aside, the spare trains in its place (the node's slurmd is started again at once, so the
   cluster has it back for the next tests; SLURM never has to declare it down);
3. `kill -9` of rank 1 (now on the spare): `signal`, restarted in place (no spare left);
4. rank 0 stopped with `kill -STOP`, every timeout at its default: its watcher finds it
   (`hang`), restarted in place.

The node loss comes before the kill and the stop: a lost node is always set aside and
needs the spare (without one the job would requeue), while the kill and the stop on a node
without a spare restart in place, each on another node than the failure before (a node
blamed twice running is set aside by a requeue).

The job completes by itself with the weights of an uninterrupted run of the same config,
bitwise, `Restarts=0` (every recovery inside the allocation), each failure's record in
attempts.jsonl with its kind and node; the test prints each failure's recovery seconds (from
its `first_failure.time` to the next logged step). The rules behind each recovery have their
own tests: test_slurm_restarts.py, tests/resilience/.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch.test_slurm_cluster import assert_same_weights
from tests.launch.test_slurm_restarts import sbatch, scontrol_job
from tests.support.slurm_kit import (
    _parent,
    attempts,
    loader_worker_pid,
    train_overrides,
    trainer_pid,
    wait_finished,
    wait_for,
    watcher_pid,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

EVERY = 10  # checkpoint.every_steps
# Bitwise-comparable runs with a loader worker per rank; steps of at least 0.05 s, so that no
# attempt outruns the injection meant for it (70 steps: the last resumes from step 40 or 50).
SAME = ("train.max_steps=70", "train.deterministic=true", "data.workers_per_rank=1",
        f"checkpoint.every_steps={EVERY}", "data.val=", "checkpoint.monitor=",
        "checkpoint.keep_best=0", "slurm.nodes=2", "slurm.gpus_per_node=1",
        "task=tests.support.slow_tasks:SlowImageClassification", "task_options.step_s=0.05")  # fmt: skip


@pytest.fixture
def lost_nodes() -> Iterator[list[str]]:
    """Nodes whose slurmd the test killed: running and in service again afterwards."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        restore_node(node)


def slurmd_pid_file(node: str) -> Path:
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            check=True, timeout=30).stdout  # fmt: skip
    pattern = re.search(r"^SlurmdPidFile\s*=\s*(\S+)", config, re.MULTILINE)
    assert pattern, "scontrol show config names no SlurmdPidFile"
    return Path(pattern.group(1).replace("%n", node))


def lose_node(job_id: str, rank: int) -> str:
    """Kill rank `rank`'s watcher, its trainer, the node's fork server (the trainer's parent
    when the server forked it) and the node's slurmd (a node that went away: its slurmstepd
    alone is left); the node's name."""
    trainer = wait_for(f"rank {rank}'s trainer", lambda: trainer_pid(job_id, rank), 30)
    watcher = wait_for(f"rank {rank}'s watcher", lambda: watcher_pid(job_id, rank), 30)
    environ = Path(f"/proc/{watcher}/environ").read_bytes().split(b"\0")
    node = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURMD_NODENAME="))
    server = _parent(trainer)
    slurmd = int(slurmd_pid_file(node).read_text())
    # the watcher first: it must not see its rank die
    for pid in (watcher, *([server] if server != watcher else []), trainer, slurmd):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return node


def restore_node(node: str) -> None:
    """Start `node`'s slurmd again (if it is not running) and put the node back in service."""
    pid_file = slurmd_pid_file(node)
    try:  # the pid file's process, if it is still that node's slurmd (not a pid reused)
        command = Path(f"/proc/{int(pid_file.read_text())}/cmdline").read_bytes().split(b"\0")
        alive = b"-N" in command and node.encode() in command and b"slurmd" in command[0]
    except (OSError, ValueError):
        alive = False
    if not alive:
        subprocess.run(["slurmd", "-N", node], check=True, timeout=60)

    def in_service() -> bool:
        state = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True,
                               text=True, timeout=30).stdout.strip()  # fmt: skip
        if state.startswith(("down", "drain", "drng", "fail")):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                           capture_output=True, timeout=30)  # fmt: skip
            return False
        return bool(state) and not state.endswith("*")  # `*`: not responding

    wait_for(f"{node} back in service", in_service, 60, poll=1.0)


def logged_steps(run_dir: Path) -> list[dict]:
    """The training steps logged so far (metrics.jsonl; a line being written is left out)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return [m for m in found if m.get("kind") == "train"]


def newest_committed(run_dir: Path) -> int:
    """The step of the run's `latest` checkpoint (0 before the first)."""
    try:
        return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def wait_past_a_new_checkpoint(run_dir: Path, since: float, resumed: int) -> int:
    """Wait until the attempt begun after `since` (wall time) has committed the checkpoint
    after `resumed` and logged two steps past it; the step it reached."""

    def reached() -> int | None:
        steps = [m["step"] for m in logged_steps(run_dir) if m["time"] > since]
        goal = resumed + EVERY
        past = newest_committed(run_dir) >= goal and steps and max(steps) >= goal + 2
        return max(steps) if past else None

    return wait_for(f"a checkpoint past step {resumed} in {run_dir}", reached, 240)


def wait_record(run_dir: Path, count: int, timeout: float) -> dict:
    """The `count`-th attempt record, once the job has decided on it."""
    found = wait_for(f"attempt {count}'s decision", lambda: attempts(run_dir)[count - 1 :], timeout)
    return found[0]


def recovery_lines(run_dir: Path, records: list[dict]) -> list[str]:
    """For each failed attempt: from its failure to the next logged step, in seconds."""
    metrics = logged_steps(run_dir)
    lines = []
    for record in records:
        if record["decision"] != "restart":
            continue
        failure = record["first_failure"] or {}
        at = failure.get("time") or record["end"]
        later = [m["time"] for m in metrics if m["time"] > record["end"]]
        again = f"training again {min(later) - at:5.1f} s after it" if later else "no step since"
        lines.append(
            f"chaos: {record['kind']:<9} rank {failure.get('rank')} on {failure.get('node')}: "
            f"decided {record['end'] - at:5.1f} s after the failure, {again}"
        )
    return lines


def test_four_failures_in_one_allocation_complete_to_the_same_weights(
    tiny_shards: Path,
    tmp_path: Path,
    jobs: list[str],
    lost_nodes: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    began = time.monotonic()
    chaos, straight = tmp_path / "chaos", tmp_path / "straight"
    # no preflight: it builds the task to check it (15-30 s of CI here), and checks nothing
    # these runs need; the uninterrupted run trains meanwhile on two nodes whose slurmd stays
    job_id = sbatch(tmp_path, *train_overrides(tiny_shards, chaos, *SAME, "slurm.spare_nodes=1"),
                    "--no-preflight")  # fmt: skip
    jobs.append(job_id)
    jobs.append(sbatch(tmp_path, *train_overrides(tiny_shards, straight, *SAME), "--no-preflight",
                       options=("--exclude=n2",)))  # fmt: skip

    # 1. a loader worker of rank 1 (on n2) killed by SIGKILL
    wait_past_a_new_checkpoint(chaos, 0.0, 0)
    worker = wait_for("rank 1's loader worker", lambda: loader_worker_pid(job_id, 1), 30)
    os.kill(worker, signal.SIGKILL)
    first = wait_record(chaos, 1, 120)
    assert (first["kind"], first["decision"], first["set_aside"]) == ("transient", "restart", {})
    assert (first["first_failure"]["rank"], first["first_failure"]["node"]) == (1, "n2"), first
    assert first["first_failure"]["exit_code"] == 8

    # 2. rank 1's node lost: its watcher, its rank and its slurmd killed
    wait_past_a_new_checkpoint(chaos, first["end"], first["committed"])
    lost_nodes.append(lose_node(job_id, 1))
    second = wait_record(chaos, 2, 120)
    restore_node(lost_nodes[-1])  # the job has set it aside; the cluster gets it back
    assert lost_nodes == ["n2"]
    assert (second["kind"], second["decision"]) == ("lost", "restart"), second
    assert (second["first_failure"]["rank"], second["first_failure"]["node"]) == (1, "n2")
    assert list(second["set_aside"]) == ["n2"]

    # 3. kill -9 of rank 1, now on the spare (n3)
    wait_past_a_new_checkpoint(chaos, second["end"], second["committed"])
    os.kill(wait_for("rank 1's trainer", lambda: trainer_pid(job_id, 1), 30), signal.SIGKILL)
    third = wait_record(chaos, 3, 120)
    assert (third["kind"], third["decision"], third["nodes"]) == ("signal", "restart", ["n1", "n3"])
    failure = third["first_failure"]
    assert (failure["rank"], failure["node"], failure["signal"]) == (1, "n3", "SIGKILL"), third

    # 4. rank 0 (on n1) stopped, every timeout at its default: its watcher finds it
    wait_past_a_new_checkpoint(chaos, third["end"], third["committed"])
    os.kill(wait_for("rank 0's trainer", lambda: trainer_pid(job_id, 0), 30), signal.SIGSTOP)
    fourth = wait_record(chaos, 4, 150)  # the bound only proves it is not the 600 s collective
    assert (fourth["kind"], fourth["decision"]) == ("hang", "restart"), fourth
    failure = fourth["first_failure"]
    assert (failure["rank"], failure["node"], failure["stopped"]) == (0, "n1", True), fourth
    assert list((chaos / "hangs").glob("*/rank-0.txt")), "no stacks of the stopped rank"

    status = wait_finished(chaos, 300)
    records = attempts(chaos)
    with capsys.disabled():  # for the reader of the test log, passed or not
        print("", *recovery_lines(chaos, records), sep="\n")
    assert status.state == "COMPLETED" and status.requeues == 0, status
    assert re.search(r"\bRestarts=0\b", scontrol_job(job_id)), scontrol_job(job_id)
    assert [(r["kind"], r["decision"]) for r in records] == [
        ("transient", "restart"), ("lost", "restart"), ("signal", "restart"),
        ("hang", "restart"), ("completed", "done"),
    ], records  # fmt: skip
    assert {r["job_id"] for r in records} == {job_id}
    assert [r["nodes"] for r in records] == [["n1", "n2"]] * 2 + [["n1", "n3"]] * 3
    # each attempt resumed from the checkpoint the one before committed, a newer one each time
    resumed = [r["resumed_from"] for r in records]
    assert resumed == [None] + [r["committed"] for r in records[:-1]], records
    assert all(a < b for a, b in itertools.pairwise(resumed[1:])), resumed

    assert wait_finished(straight, 240).state == "COMPLETED"
    assert_same_weights(chaos / "checkpoints" / "step-70", straight / "checkpoints" / "step-70",
                        tmp_path)  # fmt: skip
    with capsys.disabled():
        print(f"chaos: the whole test took {time.monotonic() - began:.0f} s")
