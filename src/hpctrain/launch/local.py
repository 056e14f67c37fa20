"""Local runs: one process, or N processes on this machine through the same `env://`
rendezvous a SLURM job uses (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, like torchrun)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_local(argv: Sequence[str], nproc: int, *, poll_s: float = 0.2) -> int:
    """Run `python -m hpctrain train <argv>` as `nproc` ranks on this machine.

    Signals the launcher receives (TERM, INT, USR1, USR2) are forwarded to every rank, so a
    local run exercises the same preemption path as a SLURM job. When one rank fails, the
    others are stopped instead of waiting forever in a collective.

    Returns:
        0 when every rank succeeded, the requeue code when every rank asked for it, otherwise
        the first non-zero exit code.
    """
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "hpctrain", "train", *argv], env=env))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {
        s: signal.signal(s, forward)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    }
    try:
        codes: list[int | None] = [None] * nproc
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                codes[i] = p.poll()
            failed = [c for c in codes if c not in (None, 0)]
            if failed and any(c is None for c in codes):
                time.sleep(
                    5.0
                )  # let the others finish a save of their own / exit with the same code
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for i, p in enumerate(procs):
                    try:
                        codes[i] = p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        codes[i] = p.wait()
                break
            time.sleep(poll_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    final = [int(c) for c in codes if c is not None]
    if all(c == 0 for c in final):
        return 0
    if len(set(final)) == 1:
        return final[0]
    return next(c for c in final if c != 0)
