"""`hpctrain bench probe`: the health probe's collective with many peers, on loopback.

The hub of `resilience/probe.py` (the first probed node) gathers every other node of the job,
one TCP connection each, and answers them all once all have come. The question at 2,048 nodes
is whether it finishes within the probe's budget (`RENDEZVOUS_TIMEOUT_S`; the job script gives
the whole probe 3 minutes). Here every peer is a thread of a few processes on this machine,
started before the hub publishes its address, so that they all connect within the same tenth
of a second, as the nodes of a job do; the hub runs in a process of its own whose soft limit of
open files is the clusters' usual default (`--open-files`, 1,024). Side by side, in one run:
the hub as shipped (one selector: every peer accepted and read at once) and the serial hub it
replaced (accept one peer, read its name, then the next), kept here as the baseline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from hpctrain.files import write_atomic
from hpctrain.resilience.probe import (
    ADDRESS_FILE,
    RENDEZVOUS_TIMEOUT_S,
    CheckFailed,
    Gathered,
    join_collective,
    serve_collective,
)

HELP = "the health probe's gather of N peers on loopback: seconds of the hub, serial vs concurrent"
HUB = "localhost"  # the hub's node name: what the peers connect to


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2047, help="nodes besides the hub (2047)")
    parser.add_argument(
        "--processes", type=int, default=8, help="processes the peers' threads run in (8)"
    )
    parser.add_argument(
        "--open-files",
        type=int,
        default=1024,
        help="the hub's soft limit of open files, as on many clusters (1024; 0: this shell's)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="gathers of each hub (3)")
    parser.add_argument(
        "--timeout", type=float, default=RENDEZVOUS_TIMEOUT_S, help="the probe's budget, s (60)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def serial_serve(attempt_dir: Path, node: str, peers: int, timeout_s: float) -> Gathered:
    """The hub before #50: accept a peer, read its name, then the next (the baseline)."""
    server = socket.create_server(("", 0))
    write_atomic(attempt_dir / ADDRESS_FILE, f"{node} {node} {server.getsockname()[1]}\n".encode())
    started = time.monotonic()
    conns: list[socket.socket] = []
    try:
        while len(conns) < peers:
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                break
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            conn.settimeout(timeout_s)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    break
                data += chunk
            conns.append(conn)
        for conn in conns:
            conn.sendall(b"ok\n")
    finally:
        for conn in conns:
            conn.close()
        server.close()
    return Gathered(time.monotonic() - started, tuple(str(i) for i in range(len(conns))))


HUBS: dict[str, Callable[[Path, str, int, float], Gathered]] = {
    "serial": serial_serve,
    "concurrent": serve_collective,
}


def _hub(kind: str, folder: str, peers: int, timeout_s: float, open_files: int, out: Queue) -> None:
    if open_files:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hard_cap = open_files if hard == resource.RLIM_INFINITY else min(open_files, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard_cap, hard))
    try:
        gathered = HUBS[kind](Path(folder), HUB, peers, timeout_s)
        out.put({"seconds": gathered.seconds, "reached": len(gathered.reached), "error": ""})
    except (OSError, CheckFailed) as exc:
        out.put({"seconds": None, "reached": 0, "error": f"{type(exc).__name__}: {exc}"})


def _peers(folder: str, first: int, count: int, timeout_s: float, ready: Any, out: Queue) -> None:
    """`count` peers, one thread each, waiting for the hub's address (as the probe's peers)."""
    threading.stack_size(256 << 10)
    failures: list[str] = []
    seconds: list[float] = []

    def peer(i: int) -> None:
        try:
            seconds.append(join_collective(Path(folder), f"p{i}", timeout_s))
        except CheckFailed as exc:
            failures.append(exc.message)

    threads = [threading.Thread(target=peer, args=(first + i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    ready.wait()
    for thread in threads:
        thread.join()
    out.put({"ok": len(seconds), "failed": len(failures), "first_failure": failures[:1]})


def gather_once(
    kind: str, *, peers: int, processes: int, timeout_s: float, open_files: int
) -> dict[str, Any]:
    """One gather of `peers` peers by the `kind` hub; its seconds and what the peers saw."""
    folder = tempfile.mkdtemp(prefix="hpctrain-probe-bench-")
    ctx = multiprocessing.get_context("fork")  # no torch here: a fork is instant
    out: Queue = ctx.Queue()
    ready = ctx.Barrier(processes + 1)
    shares = [peers * k // processes for k in range(processes + 1)]
    workers = [
        ctx.Process(
            target=_peers,
            args=(folder, shares[k], shares[k + 1] - shares[k], timeout_s, ready, out),
        )
        for k in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        ready.wait()  # every peer thread is started and polls for the address
        time.sleep(0.2)
        hub = ctx.Process(target=_hub, args=(kind, folder, peers, timeout_s, open_files, out))
        hub.start()
        results = [out.get(timeout=timeout_s * 3 + 60) for _ in range(processes + 1)]
        hub.join()
        for worker in workers:
            worker.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    found = next(r for r in results if "reached" in r)
    sides = [r for r in results if "ok" in r]
    return {
        **found,
        "peers_ok": sum(r["ok"] for r in sides),
        "peers_failed": sum(r["failed"] for r in sides),
        "peer_failure": next((r["first_failure"][0] for r in sides if r["first_failure"]), ""),
    }


def run_bench(ns: argparse.Namespace) -> dict[str, Any]:
    cases = [("serial", ns.open_files), ("concurrent", ns.open_files)]
    if ns.open_files:
        cases.insert(1, ("serial", 0))  # the baseline where descriptors do not run out
    rows = []
    for kind, open_files in cases:
        rounds = [
            gather_once(
                kind,
                peers=ns.peers,
                processes=ns.processes,
                timeout_s=ns.timeout,
                open_files=open_files,
            )
            for _ in range(ns.rounds)
        ]
        times = [r["seconds"] for r in rounds if r["seconds"] is not None and not r["peers_failed"]]
        rows.append(
            {
                "hub": kind,
                "open_files": open_files or resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "seconds": times,
                "median_s": statistics.median(times) if times else None,
                "reached": [r["reached"] for r in rounds],
                "peers_failed": [r["peers_failed"] for r in rounds],
                "error": next(
                    (
                        r["error"] or r["peer_failure"]
                        for r in rounds
                        if r["error"] or r["peer_failure"]
                    ),
                    "",
                ),
            }
        )
    return {"peers": ns.peers, "processes": ns.processes, "timeout_s": ns.timeout, "rows": rows}


def format_results(results: dict[str, Any]) -> str:
    lines = [
        f"probe gather: a hub and {results['peers']} peers (threads of {results['processes']} "
        f"processes) on loopback, budget {results['timeout_s']:g} s",
        f"{'hub':<12}{'open files':>11}  {'seconds (median, range)':<26}{'reached':<12}note",
    ]
    for row in results["rows"]:
        times = row["seconds"]
        shown = f"{row['median_s']:.3f} ({min(times):.3f}-{max(times):.3f})" if times else "-"
        reached = f"{min(row['reached'])}/{results['peers']}"
        lines.append(
            f"{row['hub']:<12}{row['open_files']:>11}  {shown:<26}{reached:<12}{row['error'][:90]}"
        )
    mine = results["rows"][-1]
    base = next((r for r in results["rows"] if r["hub"] == "serial" and r["median_s"]), None)
    if mine["median_s"] and base:
        lines.append(
            f"concurrent / serial ({base['open_files']} open files): "
            f"{mine['median_s'] / base['median_s']:.3f}x the seconds"
        )
    met = bool(mine["median_s"]) and max(mine["seconds"]) <= results["timeout_s"]
    lines.append(
        f"goal: the hub gathers {results['peers']} peers within the {results['timeout_s']:g} s "
        f"budget: {'met' if met else 'missed'}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results = run_bench(args)
    print(json.dumps(results, indent=1) if args.json else format_results(results))
    return 0
