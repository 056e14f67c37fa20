"""One record per node and attempt: `ATTEMPT_DIR/node-<name>.json`, gathered on the node.

Every rank's watcher (`resilience/watch.py`) notes its rank's start and end in a node-local
folder (under /dev/shm: memory, not the shared file system, and never fsync'd); one of
them writes the node's record to the attempt's folder, durably, from what that folder holds:

- at start, the watcher whose rank completes the node's set of starts;
- at the end, the watcher whose rank completes the set of ends (then the local folder goes);
- at once, a watcher whose rank failed on its own (killed by a signal SLURM does not send,
  an exit of its own) while others of the node still run: the node may not live to write
  the rest (the old per-rank records kept that end too);
- at srun's TERM (the step being ended), the first watcher of the node that gets it, with
  every rank of the node still running marked as alive then: one that outlives the TERM
  and is killed with its watcher after KillWait hung; one whose node never answered is
  lost (`restart_policy.classify`).

So a node's watchers write its record two to four times an attempt (two when nothing
fails), into one file; at 2,048 nodes x 8 ranks that is 2,048 files instead of 32,768, and
`attempts end` reads at most one per node. Every write is the union of what the local
folder and the record already hold, under a lock of the node (`fcntl.flock`): a write
never drops a rank another wrote. A node lost with its watchers writes nothing more: its
ranks read as never ended, as before.

Records of attempts begun before this (one `rank-<R>.json` per rank) are still read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctrain.files import read_json_object, write_atomic

LOCAL_BASE_ENV = "HPCTRAIN_WATCH_DIR"  # where node-local folders go (default /dev/shm)
NODE_PREFIX = "node-"


def node_file(attempt_dir: Path, node: str) -> Path:
    return attempt_dir / f"{NODE_PREFIX}{node}.json"


def rank_file(attempt_dir: Path, rank: int) -> Path:
    """The record of one rank, as watchers wrote it before node records (still read)."""
    return attempt_dir / f"rank-{rank}.json"


def local_base(environ: Mapping[str, str] | None = None) -> Path:
    """Node-local memory for the watchers' notes: /dev/shm, else the temp folder."""
    env = os.environ if environ is None else environ
    if env.get(LOCAL_BASE_ENV):
        return Path(env[LOCAL_BASE_ENV])
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def local_folder(attempt_dir: Path, node: str, base: Path) -> Path:
    """The node-local folder of one attempt on one node (a name from both)."""
    key = hashlib.sha1(f"{os.path.abspath(attempt_dir)}\0{node}".encode()).hexdigest()[:16]
    return base / f"hpctrain-watch-{os.getuid()}-{key}"


def tasks_on_node(environ: Mapping[str, str]) -> int:
    """The tasks srun runs on this node: `SLURM_STEP_TASKS_PER_NODE` ("8(x2048)", "2,1")
    at this node's index, else `SLURM_NTASKS_PER_NODE`, else 1."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            counts = []
            break
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(environ.get("SLURM_NODEID", "0") or 0)
    if 0 <= node < len(counts):
        return counts[node]
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(per_node) if per_node.isdigit() and int(per_node) > 0 else 1


class NodeGather:
    """The notes of one node's watchers for one attempt, and the node's record.

    Args:
        attempt_dir: the attempt's folder (shared file system): the record goes there.
        node: this node's name.
        local: the node-local folder (`local_folder`).
        expected: the ranks srun runs on this node (`tasks_on_node`).
    """

    def __init__(self, attempt_dir: Path, node: str, local: Path, expected: int) -> None:
        self.attempt_dir, self.node, self.local = attempt_dir, node, local
        self.expected = max(1, expected)
        self.writes = self.bytes_written = 0  # durable writes (the benchmark counts them)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.local.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.local / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _note(self, rank: int, record: Mapping[str, Any]) -> None:
        path = self.local / f"rank-{rank}.json"
        temp = path.with_name(f".{path.name}.tmp")
        temp.write_text(json.dumps(record))  # memory: no fsync, the rename keeps it whole
        os.replace(temp, path)

    def notes(self) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for path in self.local.glob("rank-*.json"):
            data = read_json_object(path)
            if isinstance(data.get("rank"), int):
                found[data["rank"]] = data
        return found

    def _marked(self, what: str) -> bool:
        return (self.local / f".wrote-{what}").exists()

    def _mark(self, what: str) -> None:
        (self.local / f".wrote-{what}").touch()

    def _publish(self, notes: Mapping[int, Mapping[str, Any]], complete: bool) -> None:
        """The node's record: the union of the one written so far and the notes."""
        path = node_file(self.attempt_dir, self.node)
        ranks = {int(r["rank"]): r for r in read_json_object(path).get("ranks", []) if "rank" in r}
        for rank, note in notes.items():
            ranks[rank] = {**ranks.get(rank, {}), **note}
        record = {
            "node": self.node,
            "written": time.time(),
            "complete": complete,
            "ranks": [ranks[r] for r in sorted(ranks)],
        }
        data = (json.dumps(record) + "\n").encode()
        try:
            write_atomic(path, data)
            self.writes += 1
            self.bytes_written += len(data)
        except OSError as exc:  # the rank trains on; the attempt is judged without it
            print(f"hpctrain watch: cannot write {path}: {exc}", flush=True)

    # ------------------------------------------------------------ the watchers' calls
    def started(self, rank: int, record: Mapping[str, Any]) -> None:
        with self._locked():
            self._note(rank, record)
            notes = self.notes()
            if len(notes) >= self.expected and not self._marked("start"):
                self._publish(notes, complete=False)
                self._mark("start")

    def ended(self, rank: int, record: Mapping[str, Any], *, own_failure: bool) -> None:
        done = False
        with self._locked():
            self._note(rank, record)
            notes = self.notes()
            ended = [n for n in notes.values() if n.get("ended") is not None]
            if len(ended) >= self.expected and len(ended) == len(notes):
                self._publish(notes, complete=True)
                done = True
            elif own_failure and not self._marked("failure"):
                self._publish(notes, complete=False)
                self._mark("failure")
        if done:
            shutil.rmtree(self.local, ignore_errors=True)

    def term(self, rank: int, record: Mapping[str, Any]) -> None:
        """srun's TERM reached this rank's watcher while its rank runs."""
        with self._locked():
            self._note(rank, record)
            if self._marked("term"):
                return
            notes = self.notes()
            now = time.time()
            for note in notes.values():
                running = note.get("ended") is None and note.get("term_alive") is None
                if running and _alive(note.get("pid")):
                    note["term_alive"] = now
                    self._note(int(note["rank"]), note)
            self._publish(notes, complete=False)
            self._mark("term")


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------ reading
def read_rank_records(
    attempt_dir: Path, nodes: Sequence[str], tasks_per_node: int
) -> dict[int, dict[str, Any]]:
    """Every rank record of an attempt: from the node records (one file a node), and from
    per-rank records where an attempt has those (begun before node records)."""
    try:
        names = {entry.name for entry in os.scandir(attempt_dir)}
    except OSError:
        names = set()
    found: dict[int, dict[str, Any]] = {}
    for node in nodes:
        name = f"{NODE_PREFIX}{node}.json"
        if name in names:
            for record in read_json_object(attempt_dir / name).get("ranks", []):
                if isinstance(record, dict) and isinstance(record.get("rank"), int):
                    found[record["rank"]] = {"node": node, **record}
    for rank in range(len(nodes) * tasks_per_node):
        if rank not in found and f"rank-{rank}.json" in names:
            data = read_json_object(rank_file(attempt_dir, rank))
            if data:
                found[rank] = data
    return found


__all__ = [
    "LOCAL_BASE_ENV",
    "NodeGather",
    "local_base",
    "local_folder",
    "node_file",
    "rank_file",
    "read_rank_records",
    "tasks_on_node",
]
