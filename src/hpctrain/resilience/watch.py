"""Run one task of an attempt and record how it ended: `python -m hpctrain.resilience.watch DIR -- ARGS`.

The job script starts every task of an attempt through this watcher (`srun ... python -m
hpctrain.resilience.watch ATTEMPT_DIR -- train CONFIG ...`): it runs `python -m hpctrain ARGS` as
its child, writes `ATTEMPT_DIR/rank-<R>.json` when the child starts and again when it ends
(its exit code, or the signal that killed it: a SIGKILL from the OOM killer or `kill -9`
leaves no word from the rank itself), and exits with the child's status (128 + N for a
signal, as a shell does). `resilience/attempts.py end` reads the records to tell which rank failed
first, on which node, and how (`resilience/restart_policy.py`).

The watcher is small (stdlib only, no torch) and stays out of the way: SLURM signals every
process of a step (`--signal`, `scancel --signal`, the TERM of a step being ended), so the
child gets them directly; the watcher only notes them (a rank that ends after a TERM was
stopped, it did not fail) and keeps waiting. A watcher killed with its rank (its node lost,
or the SIGKILL srun sends a step that did not end after its TERM) leaves the start record
alone: the rank never ended. A rank forked by the node's fork server (`resilience/forkserver.py`)
is not a process of the step: `start` forwards to it the signals noted here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from hpctrain.files import write_atomic
from hpctrain.resilience.forked import start

# What SLURM may send the step; noted, never acted on (the child got them too).
NOTED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def rank_file(attempt_dir: Path, rank: int) -> Path:
    return attempt_dir / f"rank-{rank}.json"


def node_name(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The node as SLURM names it (SLURMD_NODENAME: what --nodelist and ExcNodeList take)."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class Watcher:
    """The child process of one rank (`command`) and its record."""

    def __init__(self, attempt_dir: Path, command: list[str]) -> None:
        self.rank = int(os.environ.get("SLURM_PROCID", "0"))
        self.path = rank_file(attempt_dir, self.rank)
        self.command = command
        self.received: list[str] = []
        self.record: dict[str, Any] = {
            "rank": self.rank,
            "node": node_name(),
            "host": socket.gethostname(),
            "started": None,
            "ended": None,
        }

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)

    def _write(self) -> None:
        try:
            write_atomic(self.path, (json.dumps(self.record) + "\n").encode())
        except OSError as exc:  # the rank trains on; its attempt is judged without this record
            print(f"hpctrain watch: cannot write {self.path}: {exc}", file=sys.stderr, flush=True)

    def run(self) -> int:
        for sig in NOTED_SIGNALS:
            signal.signal(sig, self._note)  # the child starts with the default handlers again
        child = start(self.command)  # forked by the node's warm process, else a subprocess
        self.record.update(started=time.time(), pid=child.pid)
        self._write()
        status = child.wait()  # retried by Python across our signal handlers (PEP 475)
        self.record.update(
            ended=time.time(),
            exit_code=status if status >= 0 else None,
            signal=-status if status < 0 else None,
            received=self.received,
        )
        self._write()
        return status if status >= 0 else 128 - status


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
