"""`hpctrain status RUN_DIR`: the job's state (sacct), requeue count, attempts, last step, log tail.

The attempts (restarts inside an allocation, requeues) come from RUN_DIR/slurm/attempts.jsonl,
written by the job script (`resilience/attempts.py`). The job id comes from RUN_DIR/slurm/job.json (written by `hpctrain submit`) or
RUN_DIR/slurm/job_id (written by the sbatch script when it starts). The sbatch script's log is
`<slurm.folder>/<job id>.out`, with `slurm.folder` read from the run's config.yaml
(RUN_DIR/slurm when it is empty).
"""

from __future__ import annotations

import re
import subprocess
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.observe.hangs import newest_dump
from hpctrain.resilience.job_records import (
    SACCT_TIMEOUT_S,
    log_folder,
    read_job_record,
    recorded_job_ids,
)
from hpctrain.resilience.records import read_records, steps_logged_since

# States after which the job will not run again by itself.
DONE_STATES = frozenset({"COMPLETED"})
FAILED_STATES = frozenset(
    {"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
     "PREEMPTED", "REVOKED"}
)  # fmt: skip


@dataclass(frozen=True)
class JobRow:
    """One run of one job as sacct lists it with -D (a requeued job has a row per run)."""

    job_id: str
    state: str
    exit_code: str
    start: str = ""
    end: str = ""


@dataclass
class RunStatus:
    """What `hpctrain status` reports."""

    run_dir: str
    job_id: str = ""
    state: str = "UNKNOWN"
    exit_code: str = ""
    requeues: int = 0
    last_step: int | None = None
    log_path: str = ""
    log_tail: list[str] = field(default_factory=list)
    jobs: list[JobRow] = field(default_factory=list)  # every job, requeue and array task
    error_line: str = ""  # the last error line a rank wrote, when one failed
    error_path: str = ""  # the log it is in
    hangs_path: str = ""  # the newest RUN_DIR/hangs/<time> folder of Python stacks
    straggler_line: str = ""  # the last "straggler: rank R on HOST ..." warning of the logs
    attempts: list[dict[str, Any]] = field(default_factory=list)  # attempts.jsonl, oldest first
    stopped: str = ""  # why the job script stopped for good ("stopped: no progress ..."), if it did

    @property
    def failed(self) -> bool:
        return self.state in FAILED_STATES

    @property
    def finished(self) -> bool:
        return self.state in DONE_STATES or self.failed


def parse_sacct(text: str) -> tuple[str, str, int]:
    """`sacct -D -X -n -P -o JobID,State,ExitCode` lines → (state, exit code, requeue count).

    With -D every requeue leaves a row (state REQUEUED, or PREEMPTED/NODE_FAIL before a
    requeue); the last row is the current run.
    """
    rows = [line.split("|") for line in text.splitlines() if line.strip()]
    if not rows:
        return "UNKNOWN", "", 0
    states = [row[1].split()[0] if len(row) > 1 and row[1] else "UNKNOWN" for row in rows]
    exit_code = rows[-1][2] if len(rows[-1]) > 2 else ""
    return states[-1], exit_code, len(rows) - 1


def query_state(job_id: str) -> tuple[str, str, int]:
    """(state, exit code, requeues) from sacct, else from scontrol; UNKNOWN when neither knows."""
    try:
        done = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"],
            capture_output=True,
            text=True,
            timeout=SACCT_TIMEOUT_S,
        )
        if done.returncode == 0 and done.stdout.strip():
            return parse_sacct(done.stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        done = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=SACCT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN", "", 0
    fields = dict(part.split("=", 1) for part in done.stdout.split() if "=" in part)
    return (
        fields.get("JobState", "UNKNOWN"),
        fields.get("ExitCode", ""),
        int(fields.get("Restarts", "0") or 0),
    )


def last_step(run_dir: Path) -> int | None:
    """The highest training step in the run's metrics.jsonl (None: none yet)."""
    return steps_logged_since(run_dir, 0)


def tail(path: Path, num_lines: int) -> list[str]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=num_lines)]


def parse_sacct_rows(text: str) -> list[JobRow]:
    """`sacct -D -X -n -P -o JobID,State,ExitCode,Start,End` lines → one row per line."""
    rows = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        state = parts[1].split()[0] if parts[1] else "UNKNOWN"
        start, end = (parts[3], parts[4]) if len(parts) >= 5 else ("", "")
        rows.append(JobRow(parts[0], state, parts[2], start, end))
    return rows


def query_jobs(job_ids: list[str]) -> list[JobRow]:
    """Every run of these jobs from sacct (-D: requeues too); [] when sacct does not answer."""
    if not job_ids:
        return []
    try:
        done = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-j", ",".join(job_ids),
             "-o", "JobID,State,ExitCode,Start,End"],
            capture_output=True, text=True, timeout=SACCT_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_sacct_rows(done.stdout) if done.returncode == 0 else []


# What a failed rank leaves as its last word: hpctrain's one-line error (`hpctrain train
# [rank 1]: data error: ...`) or the last line of a Python traceback; failing those, SLURM's
# own complaint (`srun: error: n1: task 1: Exited with exit code 3`), which names no cause.
_RANK_ERROR = re.compile(
    r"^(?:hpctrain \w+(?: \[rank \d+\])?: .*error: .*"
    r"|[A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit)\b.*)$"
)
_SLURM_ERROR = re.compile(r"^(?:srun|slurmstepd): error: .*$")


def last_error_line(paths: list[Path]) -> tuple[str, str]:
    """(line, path) of the last error line in the newest of these logs that has one.

    A rank's own line (hpctrain's error, an exception) wins over SLURM's in the same log.
    """
    existing = [p for p in paths if p.is_file()]
    for path in sorted(existing, key=lambda p: p.stat().st_mtime, reverse=True):
        rank_line = slurm_line = ""
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                line = raw.strip()
                if _RANK_ERROR.match(line):
                    rank_line = line
                elif _SLURM_ERROR.match(line):
                    slurm_line = line
        if rank_line or slurm_line:
            return rank_line or slurm_line, str(path)
    return "", ""


def last_straggler_line(paths: list[Path]) -> str:
    """The last straggler warning (`hpctrain.observe.metrics.StragglerWatch`) in the newest
    log that has one."""
    existing = [p for p in paths if p.is_file()]
    for path in sorted(existing, key=lambda p: p.stat().st_mtime, reverse=True):
        found = ""
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                if "straggler: rank " in raw:
                    found = raw.strip()
        if found:
            return found
    return ""


def task_logs(run_dir: Path, record: dict[str, str], job_ids: list[str]) -> list[Path]:
    """The logs the jobs of this run folder wrote: submitit's per-task files, the sbatch log."""
    paths: list[Path] = []
    folders = {Path(record[k]).parent for k in ("stdout", "stderr") if record.get(k)}
    folders.add(log_folder(run_dir))
    for folder in folders:
        for job_id in job_ids:
            paths += folder.glob(f"{job_id}_*_log.err") if folder.is_dir() else []
            paths += folder.glob(f"{job_id}_*_log.out") if folder.is_dir() else []
            paths.append(folder / f"{job_id}.out")
    return paths


def run_status(run_dir: str, *, num_lines: int = 10) -> RunStatus:
    """The status of the job that trains into `run_dir`."""
    folder = Path(run_dir)
    record = read_job_record(folder)
    status = RunStatus(run_dir=run_dir, last_step=last_step(folder))
    attempts = read_records(folder)
    status.attempts = [a.to_json() for a in attempts]
    if attempts and attempts[-1].decision == "stop":
        reason = attempts[-1].reason
        status.stopped = reason if reason.startswith("stopped:") else f"stopped: {reason}"
    dumps = newest_dump(folder)
    status.hangs_path = str(dumps) if dumps is not None else ""
    if not record.get("job_id"):
        return status
    status.job_id = record["job_id"]
    status.state, status.exit_code, status.requeues = query_state(status.job_id)
    job_ids = recorded_job_ids(folder, record)
    status.jobs = query_jobs(job_ids)
    logs = task_logs(folder, record, job_ids)
    status.straggler_line = last_straggler_line(logs)
    if status.failed or any(row.state in FAILED_STATES for row in status.jobs):
        status.error_line, status.error_path = last_error_line(logs)
    for key in ("stderr", "stdout"):
        lines = tail(Path(record.get(key, "")), num_lines) if record.get(key) else []
        if lines:
            status.log_path, status.log_tail = record[key], lines
            break
    return status
