"""Where a process's time went outside its steps: `RUN_DIR/timeline.jsonl`.

Rank 0 appends one JSON object a line, each with its wall time (`time`, seconds since the
epoch) and `kind`:
- `startup`: written as the first step starts: when the process started (`process_start`),
  the seconds each start-up phase took (`phases`: interpreter and imports, process group,
  index, model build, checkpoint load, other), the step it starts from, the job, attempt and
  world size;
- `first_step`: when the process's first optimizer step ended (its step): with the
  `startup` record, the end of a restart (`hpctrain.resilience.recovery`);
- `checkpoint`: after each save: its step and the seconds training was blocked (`blocking_s`;
  with `checkpoint.async` only the staging), and with `checkpoint.every_minutes: auto` the
  interval chosen next and its inputs;
- `end`: when the loop ends (finished, preempted or failed): the step, and the seconds spent
  waiting for background saves at the end (`save_wait_s`).

The steps themselves are in `metrics.jsonl` (step time and data wait summed per logged
interval, evaluation time per evaluation). `hpctrain status RUN_DIR --goodput` puts both
together with the job's attempts and SLURM's accounting (`hpctrain.resilience.goodput`).

A few records per process, each one small write: nothing here runs per step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TIMELINE = "timeline.jsonl"
log = logging.getLogger("hpctrain")
_IMPORTED = time.time()  # the fallback process start where /proc is missing


def process_start_time() -> float:
    """Wall time (s since the epoch) this process started: Linux's /proc, to the clock tick;
    elsewhere the time this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    # The process's age from the boot clock both share; the wall clock only now.
    age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - max(0.0, age)


class StartupClock:
    """The phases of a process's start-up, each the time since the previous `mark`.

    Made when the work starts (`run_training`): the time before it, since the process
    started, is the interpreter and the imports.
    """

    def __init__(self) -> None:
        self.process_start = process_start_time()
        self.last = time.time()
        self.phases: dict[str, float] = {
            "interpreter_and_imports": max(0.0, self.last - self.process_start)
        }

    def mark(self, phase: str) -> None:
        """The time since the last mark was spent in `phase` (added to it)."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self.last)
        self.last = now


def job_fields(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The SLURM job, its requeue count and the job script's attempt this process belongs
    to (empty and 0 outside a job): they tie a start-up record to `attempts.jsonl`."""
    return {
        "job_id": environ.get("SLURM_JOB_ID", ""),
        "restart": int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "attempt": int(environ.get("HPCTRAIN_ATTEMPT", "0") or 0),
    }


class Timeline:
    """Appends the records above to RUN_DIR/timeline.jsonl (rank 0; a no-op elsewhere)."""

    def __init__(self, run_dir: Path, *, enabled: bool) -> None:
        self.path = run_dir / TIMELINE
        self.enabled = enabled

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)  # one write of one line: a kill leaves whole lines before it
        except OSError as exc:  # a full disk ends no training for the sake of its accounting
            log.warning("%s: cannot write (%s); no more timeline records", self.path, exc)
            self.enabled = False


def read_timeline(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/timeline.jsonl, oldest first (a line cut by a kill is skipped)."""
    path = run_dir / TIMELINE
    records = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
            records.append(record)
    return records


def last_save_cost(run_dir: Path) -> float | None:
    """The blocking time of the run's newest recorded save, if any."""
    for record in reversed(read_timeline(run_dir)):
        if record.get("kind") == "checkpoint" and isinstance(
            record.get("blocking_s"), (int, float)
        ):
            return float(record["blocking_s"])
    return None
