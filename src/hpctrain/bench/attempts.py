"""`hpctrain bench attempts`: the records of one attempt at scale, written as the watchers
write them, then the decision `attempts end` makes from them; per node against per rank.

No SLURM: `--nodes` x `--tasks-per-node` ranks are played in this process, on a folder of
this machine's disk (`--dir`, else a temporary one) standing for the attempt's folder on the
shared file system, and a folder of node-local memory (/dev/shm) for each node's notes. Each
rank starts, then ends as in a failed attempt (one rank killed by SIGKILL, every other one
exiting 7: a peer went away), through `resilience/node_records.NodeGather`, exactly as its
watcher would; then the decision is timed: `read_ranks`, `classify`, `decide`.

Beside it, the per-rank records of attempts begun before (#50): one durable file per rank,
written at start and at the end. Their decision is timed on the same ranks; their durable
writes are timed on `--per-rank-sample` files (writing all 32,768 at 2,048 x 8 takes minutes
on a local disk), and the figure for all of them is that time scaled, and labelled so.

Also the cost of a rank's heartbeat per training step (`observe/heartbeat.Progress`: a step
begun, its batch ready, the step done), with the record in memory and without a watcher.

Goals (issue #50): <= 1 file per node per attempt, <= 2 s to decide at 16,384 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from hpctrain.files import write_atomic
from hpctrain.observe.heartbeat import Progress
from hpctrain.resilience.node_records import NodeGather, local_base, rank_file
from hpctrain.resilience.rank_ends import read_ranks
from hpctrain.resilience.restart_policy import Policy, classify, decide

HELP = "records of one attempt at scale (per node vs per rank): files, bytes, seconds to decide"
GOAL_FILES_PER_NODE = 1
GOAL_DECIDE_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2048, help="nodes (default 2048)")
    parser.add_argument("--tasks-per-node", type=int, default=8, help="ranks per node (8)")
    parser.add_argument("--dir", default="", help="the attempts' folder (default: a temp one)")
    parser.add_argument(
        "--per-rank-sample", type=int, default=512,
        help="per-rank records written durably to time them (default 512)",
    )  # fmt: skip
    parser.add_argument(
        "--beat-steps", type=int, default=200_000, help="steps timed for the heartbeat"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def rank_record(rank: int, node: str, *, ended: bool, killed: int = -1) -> dict[str, Any]:
    """A watcher's record of one rank of a failed attempt (rank `killed` died of SIGKILL)."""
    record: dict[str, Any] = {"rank": rank, "node": node, "host": node, "pid": -1,
                              "started": 1000.0 + rank * 1e-6, "ended": None}  # fmt: skip
    if ended:
        dead = rank == killed
        record.update(
            ended=1100.0 + rank * 1e-6, exit_code=None if dead else 7,
            signal=int(signal.SIGKILL) if dead else None, received=[] if dead else ["SIGTERM"],
            progress={"step": 40, "phase": "step", "beats": 120, "last_progress": 1099.0},
        )  # fmt: skip
    return record


def node_names(count: int) -> list[str]:
    return [f"n{i + 1:04d}" for i in range(count)]


def killed_rank(nodes: list[str], per_node: int) -> int:
    """The rank that fails on its own: the second of the second node (or the last one)."""
    return min(per_node + 1, len(nodes) * per_node - 1)


def write_node_records(folder: Path, shm: Path, nodes: list[str], per_node: int) -> dict:
    """Every rank's start then end, through its node's gatherer, as the watchers do."""
    killed = killed_rank(nodes, per_node)
    start = time.perf_counter()
    total_writes = total_bytes = 0
    for index, node in enumerate(nodes):
        ranks = range(index * per_node, (index + 1) * per_node)
        gather = NodeGather(folder, node, shm / node, per_node)
        for rank in ranks:
            gather.started(rank, rank_record(rank, node, ended=False))
        for rank in ranks:
            gather.ended(rank, rank_record(rank, node, ended=True, killed=killed),
                         own_failure=rank == killed)  # fmt: skip
        total_writes += gather.writes
        total_bytes += gather.bytes_written
    return {
        "files": sum(1 for _ in folder.iterdir()),
        "durable_writes": total_writes,
        "bytes_written": total_bytes,
        "write_s": time.perf_counter() - start,
    }


def write_rank_records(folder: Path, nodes: list[str], per_node: int, sample: int) -> dict:
    """The per-rank records: the files themselves without fsync (for the decision), and
    `sample` of them written durably twice (start, end) to time what that costs."""
    ranks, killed = len(nodes) * per_node, killed_rank(nodes, per_node)
    total = 0
    for rank in range(ranks):
        record = rank_record(rank, nodes[rank // per_node], ended=True, killed=killed)
        data = (json.dumps(record) + "\n").encode()
        start_data = json.dumps(rank_record(rank, nodes[rank // per_node], ended=False)) + "\n"
        total += len(data) + len(start_data)
        write_atomic(rank_file(folder, rank), data, durable=False)
    timed = folder.parent / "per-rank-sample"
    timed.mkdir()
    sample = max(1, min(sample, ranks))
    start = time.perf_counter()
    for rank in range(sample):
        for ended in (False, True):
            record = rank_record(rank, nodes[rank // per_node], ended=ended)
            write_atomic(rank_file(timed, rank), (json.dumps(record) + "\n").encode())
    seconds = time.perf_counter() - start
    shutil.rmtree(timed)
    return {
        "files": ranks,
        "durable_writes": 2 * ranks,
        "bytes_written": total,
        "write_s_scaled": seconds * ranks / sample,
        "write_sample": sample,
    }


def time_decision(folder: Path, nodes: list[str], per_node: int) -> dict:
    """`attempts end`'s reading and deciding, timed."""
    start = time.perf_counter()
    ranks = read_ranks(folder, nodes, per_node)
    failure = classify(ranks, srun_status=137)
    verdict = decide(
        failure, history=[], policy=Policy(nodes=len(nodes)), step_reached=40,
        committed_start=30, committed_end=40, restarts_here=0, requeues=0, job_running=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    return {"decide_s": seconds, "kind": failure.kind, "line": verdict.line}


def heartbeat_cost(path: Path, steps: int) -> dict[str, float]:
    """Microseconds a training step spends on its beats: with the watcher's record, and a
    `Progress` without one (what a step costs without a watcher), side by side."""
    out: dict[str, float] = {}
    for name, progress in (("with_record_us", Progress(path)), ("no_watcher_us", Progress(None))):
        start = time.perf_counter()
        for step in range(1, steps + 1):
            with progress.step(step):
                progress.data_ready()
        out[name] = (time.perf_counter() - start) / steps * 1e6
    return out


def run_bench(workdir: Path, ns: argparse.Namespace) -> dict[str, Any]:
    nodes, per_node = node_names(ns.nodes), ns.tasks_per_node
    shm = Path(tempfile.mkdtemp(prefix="hpctrain-bench-attempts-", dir=local_base()))
    try:
        new, old = workdir / "per-node", workdir / "per-rank" / "attempt"
        new.mkdir(parents=True)
        old.mkdir(parents=True)
        per_node_result = {
            **write_node_records(new, shm, nodes, per_node),
            **time_decision(new, nodes, per_node),
        }
        per_rank_result = {
            **write_rank_records(old, nodes, per_node, ns.per_rank_sample),
            **time_decision(old, nodes, per_node),
        }
        beat = heartbeat_cost(shm / "beat", ns.beat_steps)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {
        "nodes": ns.nodes,
        "tasks_per_node": per_node,
        "ranks": ns.nodes * per_node,
        "per_node": per_node_result,
        "per_rank": per_rank_result,
        "heartbeat": beat,
        "goals": {"files_per_node": GOAL_FILES_PER_NODE, "decide_s": GOAL_DECIDE_S},
    }


def format_results(r: dict[str, Any]) -> str:
    new, old, beat = r["per_node"], r["per_rank"], r["heartbeat"]
    files_goal = new["files"] <= GOAL_FILES_PER_NODE * r["nodes"]
    decide_goal = new["decide_s"] <= GOAL_DECIDE_S
    lines = [
        f"attempts: {r['nodes']} nodes x {r['tasks_per_node']} ranks = {r['ranks']} ranks, "
        "one failed attempt (a rank killed, the others exit 7)",
        f"  per node:  {new['files']} files, {new['durable_writes']} durable writes, "
        f"{new['bytes_written'] / 1e6:.2f} MB, written in {new['write_s']:.1f} s; "
        f"decided in {new['decide_s']:.3f} s ({new['kind']})",
        f"  per rank:  {old['files']} files, {old['durable_writes']} durable writes, "
        f"{old['bytes_written'] / 1e6:.2f} MB, written in ~{old['write_s_scaled']:.0f} s "
        f"(timed on {old['write_sample']} ranks, scaled); decided in {old['decide_s']:.3f} s "
        f"({old['kind']})",
        f"  per rank / per node: files {old['files'] / new['files']:.1f}x, durable writes "
        f"{old['durable_writes'] / new['durable_writes']:.1f}x, decision "
        f"{old['decide_s'] / new['decide_s']:.2f}x",
        f"  goals: <= {GOAL_FILES_PER_NODE} file per node per attempt: "
        f"{'met' if files_goal else 'MISSED'} ({new['files'] / r['nodes']:.2f}); "
        f"<= {GOAL_DECIDE_S:g} s to decide: {'met' if decide_goal else 'MISSED'}",
        f"heartbeat per training step: {beat['with_record_us']:.2f} us with the watcher's record, "
        f"{beat['no_watcher_us']:.2f} us without a watcher",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hpctrain-"))
    work = workdir / f"bench-attempts-{os.getpid()}"
    try:
        results = run_bench(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results, indent=1) if args.json else format_results(results))
    return 0
