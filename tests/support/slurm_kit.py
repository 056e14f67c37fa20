"""Helpers of the SLURM tier: submit like a user, wait with a bound, clean up."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpctrain.launch.status import RunStatus, run_status
from tests.support.train_kit import tiny_run_overrides

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")
T = TypeVar("T")


def train_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny CPU run of the demo config on `shards` (fp32, one loader worker)."""
    return tiny_run_overrides(
        shards,
        run_dir,
        "train.precision=fp32",
        "checkpoint.every_steps=0",
        "slurm.profile=local-dev",
        *extra,
    )


def hpctrain(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`hpctrain ARGS` run from the repository root: jobs start there too (SLURM's default
    working directory), so test tasks (`tests.support.slow_tasks`) are importable in them."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"hpctrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def submit(*args: str) -> list[str]:
    """`hpctrain submit` → the job ids it printed."""
    out = hpctrain("submit", DEMO, *args).stdout
    return re.findall(r"^job (\S+)$", out, re.MULTILINE)


def wait_for(what: str, check: Callable[[], T | None], timeout: float, poll: float = 0.5) -> T:
    """Poll `check` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_finished(run_dir: Path, timeout: float) -> RunStatus:
    def finished() -> RunStatus | None:
        status = run_status(str(run_dir), num_lines=40)
        return status if status.finished else None

    try:
        return wait_for(f"the job of {run_dir} to finish", finished, timeout, poll=1.0)
    except AssertionError:
        status = run_status(str(run_dir), num_lines=40)
        raise AssertionError(
            f"job {status.job_id} of {run_dir} still {status.state} after {timeout:.0f} s (step {status.last_step})\n"
            + "\n".join(status.log_tail)
        ) from None


def wait_step(run_dir: Path, at_least: int, timeout: float) -> int:
    def reached() -> int | None:
        step = run_status(str(run_dir)).last_step
        return step if step is not None and step >= at_least else None

    return wait_for(f"step {at_least} in {run_dir}", reached, timeout)


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        m for m in (json.loads(line) for line in lines if line.strip()) if m.get("kind") == kind
    ]


def log_text(run_dir: Path) -> str:
    """Everything the job wrote (submitit's per-task logs, or the sbatch script's log)."""
    texts = [p.read_text(errors="replace") for p in sorted((run_dir / "slurm").rglob("*.out"))]
    texts += [p.read_text(errors="replace") for p in sorted((run_dir / "slurm").rglob("*.err"))]
    return "\n".join(texts)


def scancel(*args: str) -> None:
    subprocess.run(["scancel", *args], check=True, timeout=30)


def sacct_nodes(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "NodeList"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return out.strip().splitlines()[-1] if out.strip() else ""


def trainer_pid(job_id: str, rank: int) -> int | None:
    """The pid of rank `rank`'s `hpctrain train` process in the job (not its watcher, not its
    loader workers): the one process of the job's task whose command is `-m hpctrain train`,
    or, for a rank the node's fork server forked (its command line and first environment
    are the server's), the pid its watcher recorded."""
    parents, watchers = _task_processes(job_id, rank)
    # loader workers started by fork share the command line: the trainer is their parent
    trainers = [pid for pid, parent in parents.items() if parent not in parents]
    if trainers:
        return trainers[0] if len(trainers) == 1 else None
    if len(watchers) == 1:  # python -m hpctrain.resilience.watch DIR -- ...
        return _recorded_pid(watchers[0], rank)
    return None


def loader_worker_pid(job_id: str, rank: int) -> int | None:
    """The pid of a loader worker of rank `rank`'s trainer (forked: the trainer's command
    line, the trainer its parent), or None before it has one."""
    trainer = trainer_pid(job_id, rank)
    if trainer is None:
        return None
    with contextlib.suppress(OSError):
        command = Path(f"/proc/{trainer}/cmdline").read_bytes()
        workers = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                pid = int(proc.name)
                if _parent(pid) == trainer and (proc / "cmdline").read_bytes() == command:
                    workers.append(pid)
        return min(workers) if workers else None
    return None


def _task_processes(job_id: str, rank: int) -> tuple[dict[int, int], list[list[bytes]]]:
    """pid → parent pid of every `-m hpctrain train` process of the job's task `rank`, and
    the command lines of its watchers."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}
    found, watchers = {}, []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if not wanted <= set((proc / "environ").read_bytes().split(b"\0")):
                continue
            command = (proc / "cmdline").read_bytes()
            if b"\0-m\0hpctrain\0train\0" in command:
                found[int(proc.name)] = _parent(int(proc.name))
            elif b"\0-m\0hpctrain.resilience.watch\0" in command:
                watchers.append(command.split(b"\0"))
    return found, watchers


def _recorded_pid(watcher: list[bytes], rank: int) -> int | None:
    """The pid the watcher recorded for `rank`: in its node's record (`node-<name>.json`),
    or its own (`rank-<R>.json`, attempts begun before node records)."""
    folder = Path(watcher[watcher.index(b"hpctrain.resilience.watch") + 1].decode())
    for path in [*sorted(folder.glob("node-*.json")), folder / f"rank-{rank}.json"]:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads(path.read_text())
            for record in data.get("ranks", [data]):
                if record.get("rank") == rank and record.get("pid"):
                    pid = int(record["pid"])
                    return pid if Path(f"/proc/{pid}").exists() else None
    return None


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def attempts(run_dir: Path) -> list[dict]:
    """RUN_DIR/slurm/attempts.jsonl, oldest first."""
    path = run_dir / "slurm" / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
