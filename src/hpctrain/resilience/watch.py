"""Run one task of an attempt, watch its progress, record how it ended:
`python -m hpctrain.resilience.watch DIR -- ARGS`.

The job script starts every task of an attempt through this watcher (`srun ... python -m
hpctrain.resilience.watch ATTEMPT_DIR -- train CONFIG ...`): it runs `python -m hpctrain ARGS`
as its child and exits with the child's status (128 + N for a signal, as a shell does).

**How it ended.** The watcher notes the child's start and end (its exit code, or the signal
that killed it: a SIGKILL from the OOM killer or `kill -9` leaves no word from the rank
itself) in node-local memory; the node's watchers write one record per node to the
attempt's folder (`resilience/node_records.py`), which `resilience/attempts.py end` reads to
tell which rank failed first, on which node, and how (`resilience/restart_policy.py`).

**Whether it progresses.** The child beats into a node-local record the watcher names in
`HPCTRAIN_HEARTBEAT` (`observe/heartbeat.py`: step, phase, and the allowance the trainer
learnt for what it does now). When the child makes no progress for longer than its
allowance, the watcher notes where it stopped (its step, phase, last beat, and whether the
process was stopped: `kill -STOP`, a frozen process), asks for its Python stacks with the
signal the trainer armed (a stopped process runs no handler: it gets SIGCONT first; the
stacks land in RUN_DIR/hangs/ as for `kill -USR1`), waits a few seconds for them, and kills
it. The record then says the rank hung, and the attempt is a `hang` naming it. Its peers,
stuck in a collective waiting for it, stop beating too and their watchers end them alike:
the rank that was stopped, or that got least far, is the one blamed.

The watcher is small (stdlib only, no torch) and stays out of the way: SLURM signals every
process of a step (`--signal`, `scancel --signal`, the TERM of a step being ended), so the
child gets them directly; the watcher only notes them (a rank that ends after a TERM was
stopped, it did not fail), marks its node's ranks still running as alive at that TERM, and
keeps waiting. A watcher killed with its rank (its node lost, or the SIGKILL srun sends a
step that did not end after its TERM) leaves the start record alone: the rank never ended.
A rank forked by the node's fork server (`resilience/forkserver.py`) is not a process of the
step: `start_child` forwards to it the signals noted here.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from hpctrain.observe.heartbeat import HEARTBEAT_ENV, Beat, read_beat
from hpctrain.resilience.forked import Child, start
from hpctrain.resilience.node_records import (
    NodeGather,
    local_base,
    local_folder,
    rank_file,
    tasks_on_node,
)

# What SLURM may send the step; noted, never acted on (the child got them too).
NOTED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
SLURM_SENT = frozenset(s.value for s in NOTED_SIGNALS) | {signal.SIGCONT.value}
POLL_S = 1.0  # how often the watcher reads the heartbeat
DUMP_WAIT_S = 5.0  # how long it waits for a hung rank's stacks (srun's KillWait is longer)
EXIT_DISTRIBUTED, EXIT_REQUEUE = 7, 75  # hpctrain.errors', hpctrain.train.preemption's

__all__ = ["Watcher", "main", "node_name", "rank_file", "start_child"]


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """The node as SLURM names it (SLURMD_NODENAME: what --nodelist and ExcNodeList take)."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def start_child(command: list[str], env: Mapping[str, str]) -> Child:
    """The rank's process: forked by the node's warm process when the job runs one, else a
    subprocess (`resilience/forked.py`)."""
    return start(command, env=env)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (`T`: stopped); "" when unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text.rpartition(")")[2].split()[0] if ")" in text else ""


class Watcher:
    """The child process of one rank (`command`), its progress and its record."""

    def __init__(self, attempt_dir: Path, command: list[str]) -> None:
        self.rank = int(os.environ.get("SLURM_PROCID", "0"))
        self.node = node_name()
        self.command = command
        self.received: list[str] = []
        self.handled_term = False
        self.stopped_polls = 0
        local = local_folder(attempt_dir, self.node, local_base())
        self.gather = NodeGather(attempt_dir, self.node, local, tasks_on_node(os.environ))
        self.heartbeat = local / f"beat-{self.rank}"
        self.record: dict[str, Any] = {
            "rank": self.rank,
            "node": self.node,
            "host": socket.gethostname(),
            "started": None,
            "ended": None,
        }

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)

    def _say(self, line: str) -> None:
        sys.stderr.write(f"hpctrain watch: {line}\n")  # one write: the line stays whole
        sys.stderr.flush()

    def run(self) -> int:
        for sig in NOTED_SIGNALS:
            signal.signal(sig, self._note)  # the child starts with the default handlers again
        env = dict(os.environ)
        try:
            self.gather.local.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.heartbeat.write_bytes(b"")
            env[HEARTBEAT_ENV] = str(self.heartbeat)
        except OSError as exc:  # no node-local memory: the rank trains unwatched
            self._say(f"cannot make {self.heartbeat}: {exc}; progress not watched")
        child = start_child(self.command, env)
        self.record.update(started=time.time(), pid=child.pid)
        self.gather.started(self.rank, self.record)
        status = self.wait(child)
        beat = read_beat(self.heartbeat)
        if beat is not None:  # how far it got: the hang's culprit is the one that got least far
            self.record["progress"] = {
                "step": beat.step, "phase": beat.phase, "beats": beat.beats,
                "last_progress": beat.wall,
            }  # fmt: skip
        self.record.update(
            ended=time.time(),
            exit_code=status if status >= 0 else None,
            signal=-status if status < 0 else None,
            received=self.received,
        )
        self.gather.ended(self.rank, self.record, own_failure=self.failed_on_its_own(status))
        return status if status >= 0 else 128 - status

    def failed_on_its_own(self, status: int) -> bool:
        """An end that may be the attempt's first failure (its node writes it at once)."""
        if self.record.get("hung") or "SIGTERM" in self.received:
            return False
        if status < 0:
            return -status not in SLURM_SENT
        return status not in (0, EXIT_DISTRIBUTED, EXIT_REQUEUE)

    def wait(self, child: Child) -> int:
        """The child's status, watching its heartbeat meanwhile."""
        try:
            ready = os.pidfd_open(child.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): poll
            ready = -1
        try:
            while True:
                if ready >= 0:
                    select.select([ready], [], [], POLL_S)  # retried across signals (PEP 475)
                    status = child.poll()
                else:
                    try:
                        status = child.wait(timeout=POLL_S)
                    except subprocess.TimeoutExpired:
                        status = None
                if status is not None:
                    return status
                if "SIGTERM" in self.received and not self.handled_term:
                    self.handled_term = True
                    self.gather.term(self.rank, {**self.record, "term_alive": time.time()})
                self.look_at(child.pid)
                beat = read_beat(self.heartbeat)
                if beat is not None and beat.allowance_s > 0:
                    idle = time.monotonic() - beat.monotonic
                    if idle > beat.allowance_s:
                        return self.end_hung(child, beat, idle)
        finally:
            if ready >= 0:
                os.close(ready)

    def look_at(self, pid: int) -> None:
        """Note a process seen stopped on two polls in a row (`kill -STOP`, a frozen
        process): srun's SIGCONT, as it ends the step, would hide it later."""
        if process_state(pid) in ("T", "t"):
            self.stopped_polls += 1
            if self.stopped_polls >= 2 and not self.record.get("stopped"):
                self.record.update(stopped=True, stopped_seen=time.time())
        else:
            self.stopped_polls = 0

    def end_hung(self, child: Child, beat: Beat, idle: float) -> int:
        """Note where the rank stopped, ask for its stacks, kill it; its status."""
        stopped = process_state(child.pid) in ("T", "t") or bool(self.record.get("stopped"))
        if stopped:
            self.record.setdefault("stopped_seen", time.time())
            self.record["stopped"] = True
        self.record["hung"] = {
            "step": beat.step, "phase": beat.phase, "beats": beat.beats,
            "last_progress": beat.wall, "idle_s": round(idle, 1),
            "allowance_s": beat.allowance_s, "stopped": stopped, "stacks": False,
        }  # fmt: skip
        where = f"rank {self.rank} on {self.node}"
        state = " (the process was stopped)" if stopped else ""
        self._say(
            f"{where} made no progress for {idle:.0f} s{state}: step {beat.step}, {beat.phase}, "
            f"allowance {beat.allowance_s:g} s (docs/clusters.md, timeouts); ending it as hung"
        )
        if beat.dump_signal:
            with contextlib.suppress(ProcessLookupError):
                if stopped:
                    os.kill(child.pid, signal.SIGCONT)  # a stopped process runs no handler
                os.kill(child.pid, beat.dump_signal)
            deadline = time.monotonic() + DUMP_WAIT_S
            while time.monotonic() < deadline and child.poll() is None:
                now = read_beat(self.heartbeat)
                if now is not None and now.dumps > beat.dumps:
                    self.record["hung"]["stacks"] = True
                    break
                time.sleep(0.05)
        if not self.record["hung"]["stacks"]:
            self._say(f"{where}: no Python stacks (the rank does not dump in {beat.phase})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        return child.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m hpctrain.resilience.watch ATTEMPT_DIR -- HPCTRAIN_ARGS...",
            file=sys.stderr,
        )
        return 2
    return Watcher(Path(argv[0]), [sys.executable, "-m", "hpctrain", *argv[2:]]).run()


if __name__ == "__main__":
    sys.exit(main())
