"""The rank watcher's two jobs without SLURM: seeing a rank make no progress (its heartbeat,
`observe/heartbeat.py`), and one record per node (`resilience/node_records.py`).

The whole loop with the real watcher under a stubbed srun: test_attempt_loop.py; a stopped
rank on the dev cluster: tests/launch/test_slurm_restarts.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpctrain.resilience.node_records import NodeGather, read_rank_records, tasks_on_node
from hpctrain.resilience.rank_ends import read_ranks
from hpctrain.resilience.restart_policy import classify
from tests.support.train_kit import REPO, train_args


def node_record(folder: Path, node: str) -> dict:
    return json.loads((folder / f"node-{node}.json").read_text())


# ------------------------------------------------------------------------------ a stall
def watched(tmp_path: Path, script: str, *, rank: int = 0, node: str = "n1") -> subprocess.Popen:
    """A watcher whose rank runs `script` (Python, with `progress`: its heartbeat)."""
    child = "from hpctrain.observe.heartbeat import Progress\n" + textwrap.dedent(script)
    runner = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from hpctrain.resilience.watch import Watcher
        sys.exit(Watcher(Path({str(tmp_path)!r}), [sys.executable, "-c", {child!r}]).run())
    """)
    env = {**os.environ, "SLURM_PROCID": str(rank), "SLURMD_NODENAME": node,
           "HPCTRAIN_WATCH_DIR": str(tmp_path / "shm")}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", runner], env=env, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


@pytest.mark.slow  # a few seconds: the allowance of 1 s must pass
def test_a_stopped_rank_is_ended_by_its_watcher_after_its_stacks(tmp_path: Path) -> None:
    """`kill -STOP`: the rank runs no handler of its own. Its watcher sees no progress for
    longer than the allowance, sees the process stopped, wakes it for its stacks (the
    signal the rank armed), and kills it."""
    proc = watched(tmp_path, """
        import os, signal, time
        progress = Progress.from_environ(floor_s=1, factor=5, first_s=1)
        signal.signal(signal.SIGUSR1, lambda *a: progress.dumped())  # "the stacks, written"
        progress.arm_dumps(signal.SIGUSR1)
        for step in range(1, 4):
            with progress.step(step):
                time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    """)  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err
    (rank,) = node_record(tmp_path, "n1")["ranks"]
    hung = rank["hung"]
    assert (hung["step"], hung["phase"], hung["stopped"], hung["stacks"]) == (3, "step", True, True)
    assert hung["idle_s"] > hung["allowance_s"] == 1
    assert "hpctrain watch: rank 0 on n1 made no progress for" in err
    assert "(the process was stopped)" in err
    end = read_ranks(tmp_path, ["n1"], 1)
    failure = classify(end, srun_status=137)
    assert (failure.kind, failure.suspect_node) == ("hang", "n1")
    assert failure.time == hung["last_progress"]


@pytest.mark.slow  # a few seconds
def test_a_rank_that_beats_is_left_alone_and_one_that_does_not_is_ended(tmp_path: Path) -> None:
    """Steps slower than the floor but steady are progress; a rank stuck in Python (no
    stop, no handler for the stacks) is ended all the same, and says it has no stacks."""
    proc = watched(tmp_path / "steady", """
        import time
        progress = Progress.from_environ(floor_s=1, factor=5, first_s=5)
        for step in range(1, 5):
            with progress.step(step):
                time.sleep(0.3 if step > 1 else 1.5)  # the first step: compiling
        progress.ending()
        time.sleep(2)  # tearing down: not watched
    """)  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    proc = watched(tmp_path / "stuck", """
        import time
        progress = Progress.from_environ(floor_s=1, factor=5, first_s=1)
        with progress.step(1):
            pass
        with progress.step(2):
            time.sleep(600)
    """)  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, err
    (rank,) = node_record(tmp_path / "stuck", "n1")["ranks"]
    assert (rank["hung"]["step"], rank["hung"]["stopped"], rank["hung"]["stacks"]) == (
        2, False, False,
    )  # fmt: skip
    assert "no Python stacks" in err


@pytest.mark.slow  # a training process under its watcher (imports: seconds)
def test_a_stopped_trainer_is_ended_by_its_watcher_with_its_stacks(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """The real trainer beats every step and dumps its stacks on the watcher's signal."""
    run_dir, attempt = tmp_path / "run", tmp_path / "attempt"
    attempt.mkdir()
    args = train_args(
        shapes_shards, run_dir, "task=tests.support.slow_tasks:SlowImageClassification",
        "task_options.step_s=0.05", "train.max_steps=2000", "train.heartbeat_timeout_s=2",
        "data.val=", "checkpoint.monitor=", "checkpoint.keep_best=0", "data.workers_per_rank=0",
    )  # fmt: skip
    env = {**os.environ, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n1",
           "HPCTRAIN_WATCH_DIR": str(tmp_path / "shm")}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain.resilience.watch", str(attempt), "--", "train", *args],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (
                run_dir / "metrics.jsonl"
            ).exists() else []  # fmt: skip
            if sum('"kind": "train"' in line for line in lines) >= 5:
                break
            time.sleep(0.2)
        (rank,) = node_record(attempt, "n1")["ranks"]
        os.kill(rank["pid"], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    (rank,) = node_record(attempt, "n1")["ranks"]
    assert rank["hung"]["stopped"] and rank["hung"]["stacks"], rank
    assert rank["hung"]["phase"] == "step" and rank["hung"]["step"] >= 5
    (dump,) = (run_dir / "hangs").glob("*/rank-0.txt")
    assert "Python stacks of all threads" in dump.read_text()
    assert "timeouts: heartbeat max(2 s, 5 x slowest recent step) < collective 600 s" in err


# ------------------------------------------------------------------------------ node records
def rank_note(rank: int, node: str, **ended: object) -> dict:
    note = {"rank": rank, "node": node, "started": 1.0, "ended": None, "pid": -1}
    return {**note, **ended}


def gatherers(tmp_path: Path, node: str, ranks: range) -> dict[int, NodeGather]:
    local = tmp_path / "shm" / node
    return {r: NodeGather(tmp_path, node, local, len(ranks)) for r in ranks}


def test_a_nodes_watchers_write_one_record_at_start_and_one_at_the_end(tmp_path: Path) -> None:
    watchers = gatherers(tmp_path, "n1", range(4))
    for rank, gather in watchers.items():
        gather.started(rank, rank_note(rank, "n1"))
    record = node_record(tmp_path, "n1")
    assert [r["rank"] for r in record["ranks"]] == [0, 1, 2, 3] and not record["complete"]
    for rank, gather in watchers.items():
        gather.ended(rank, rank_note(rank, "n1", ended=2.0 + rank, exit_code=0),
                     own_failure=False)  # fmt: skip
    record = node_record(tmp_path, "n1")
    assert record["complete"] and [r["ended"] for r in record["ranks"]] == [2.0, 3.0, 4.0, 5.0]
    assert sum(g.writes for g in watchers.values()) == 2  # once at start, once at the end
    assert not (tmp_path / "shm" / "n1").exists()  # the node-local notes are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-n1.json", "shm"]


def test_no_end_the_per_rank_records_kept_is_lost_in_any_death_order(tmp_path: Path) -> None:
    """Each way a node's ranks and watchers may die, against what per-rank records kept."""
    # 1. a rank dies of its own while the others run on, then the node is lost: its end
    #    was written at once
    watchers = gatherers(tmp_path / "a", "n1", range(2))
    for rank, gather in watchers.items():
        gather.started(rank, rank_note(rank, "n1"))
    watchers[1].ended(1, rank_note(1, "n1", ended=5.0, signal=9), own_failure=True)
    ranks = read_rank_records(tmp_path / "a", ["n1"], 2)
    assert ranks[1]["signal"] == 9 and ranks[0]["ended"] is None
    # 2. the gathering watcher's own rank ends first (a peer's exit 7), then srun's TERM,
    #    then KILL takes the other with its watcher: the first end and the TERM stay
    watchers = gatherers(tmp_path / "b", "n1", range(2))
    pid = os.getpid()  # "still running" (alive) when the TERM comes
    for rank, gather in watchers.items():
        gather.started(rank, {**rank_note(rank, "n1"), "pid": pid})
    watchers[0].ended(0, rank_note(0, "n1", ended=5.0, exit_code=7), own_failure=False)
    watchers[1].term(1, {**rank_note(1, "n1"), "pid": pid, "term_alive": 6.0})
    ranks = read_rank_records(tmp_path / "b", ["n1"], 2)
    assert ranks[0]["exit_code"] == 7 and ranks[1]["term_alive"] == 6.0
    ends = read_ranks(tmp_path / "b", ["n1"], 2)
    assert ends[1].alive_at_term and classify(ends, srun_status=137).kind == "hang"
    # 3. srun's TERM reaches every watcher at once: one write for the node, every running
    #    rank marked alive at it, then each end as it comes
    watchers = gatherers(tmp_path / "c", "n1", range(3))
    for rank, gather in watchers.items():
        gather.started(rank, {**rank_note(rank, "n1"), "pid": pid})
    for rank, gather in watchers.items():
        gather.term(rank, {**rank_note(rank, "n1"), "pid": pid, "term_alive": 6.0})
    assert sum(g.writes for g in watchers.values()) == 2  # start, the first TERM
    for rank, gather in watchers.items():
        gather.ended(rank, rank_note(rank, "n1", ended=7.0, signal=15), own_failure=False)
    ranks = read_rank_records(tmp_path / "c", ["n1"], 3)
    assert all(r["signal"] == 15 and r["term_alive"] for r in ranks.values())
    # 4. the node lost before any end: starts only, as before
    watchers = gatherers(tmp_path / "d", "n2", range(2))
    for rank, gather in watchers.items():
        gather.started(rank + 2, rank_note(rank + 2, "n2"))
    ends = read_ranks(tmp_path / "d", ["n1", "n2"], 2)
    assert [(e.started, e.ended) for e in ends] == [(None, None)] * 2 + [(1.0, None)] * 2


def test_attempts_begun_before_node_records_are_still_read(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json").write_text(json.dumps(rank_note(0, "n1", ended=3.0, exit_code=0)))
    watchers = gatherers(tmp_path, "n2", range(1))
    watchers[0].started(1, rank_note(1, "n2"))
    ends = read_ranks(tmp_path, ["n1", "n2"], 1)
    assert [(e.rank, e.node, e.ended) for e in ends] == [(0, "n1", 3.0), (1, "n2", None)]


def test_the_tasks_of_this_node_come_from_sruns_variables() -> None:
    assert tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "8(x2048)", "SLURM_NODEID": "7"}) == 8
    assert tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2"}) == 1
    assert tasks_on_node({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert tasks_on_node({}) == 1
