"""`hpctrain status RUN_DIR --goodput`: read a run's records and SLURM's accounting, account
for its hours (`resilience/goodput.py`) and say it in lines, JSON or a PNG (`hpctrain plot`).

The allocations come from sacct (every job and requeue of the run folder: start, end, nodes,
the GPUs or CPUs allocated, when it was queued). Without an answer from sacct (no accounting
database) they are taken from the job script's attempts (their span: the job script's own
start and the queue wait are then unknown); for a run without a SLURM job (`hpctrain train`
on a workstation) each trainer process is its own allocation.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from hpctrain.config import ConfigError
from hpctrain.files import read_json_object
from hpctrain.observe.timeline import read_timeline
from hpctrain.resilience.attempts import (
    JobFacts,
    current_folder,
    read_records,
    restart_phases,
)
from hpctrain.resilience.goodput import (
    PARTS,
    STARTUP_PHASES,
    Allocation,
    Goodput,
    Process,
    account,
    processes,
)
from hpctrain.resilience.job_records import SACCT_TIMEOUT_S, read_job_record, recorded_job_ids
from hpctrain.resilience.recovery import describe_recovery
from hpctrain.resilience.restart_policy import AttemptRecord
from hpctrain.resilience.spares import SpareAllocation, describe_hindsight, spare_hindsight

SACCT_FIELDS = "JobID,State,Submit,Start,End,NNodes,AllocTRES"
LABELS = {
    "productive": "productive steps",
    "data_wait": "data wait",
    "checkpoint": "checkpoint (blocking)",
    "evaluation": "evaluation",
    "lost": "lost work (trained again)",
    "hung": "hung (waiting on a stuck rank)",
    "startup": "start-up",
    "loop_overhead": "loop overhead",
    "tail": "tail (after the last step)",
    "idle": "idle nodes (spares, set aside)",
    "job_script": "job script",
    "probe_and_launch": "probe and launch",
    "interpreter_and_imports": "interpreter and imports",
    "process_group": "process group",
    "index": "data index",
    "model_build": "model build",
    "checkpoint_load": "checkpoint load",
    "other": "other",
}


def sacct_time(text: str) -> float | None:
    """sacct's local `2026-12-02T03:00:01` → seconds since the epoch (None: Unknown, None)."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def tres_units(text: str) -> tuple[str, float]:
    """AllocTRES `billing=4,cpu=4,gres/gpu=4,node=1` → ("GPU-hours", 4), else CPUs."""
    values = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    try:
        gpus = float(values.get("gres/gpu", 0) or 0)
        cpus = float(values.get("cpu", 0) or 0)
    except ValueError:
        return "task-hours", 0.0
    if gpus > 0:
        return "GPU-hours", gpus
    return ("CPU core-hours", cpus) if cpus > 0 else ("task-hours", 0.0)


def tasks_per_node(records: Sequence[AttemptRecord]) -> int:
    """Tasks on each node of the job: from an attempt that trained (else 1)."""
    for record in records:
        if record.num_tasks and record.nodes:
            return max(1, record.num_tasks // len(record.nodes))
    return 1


def parse_allocations(
    text: str, records: Sequence[AttemptRecord], now: float
) -> tuple[list[Allocation], str]:
    """`sacct -D -X -n -P -o JOB FIELDS` lines → the allocations that started, and the unit."""
    allocations, units = [], []
    runs: dict[str, int] = {}
    per_node = tasks_per_node(records)
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 7 or not parts[0]:
            continue
        job_id, _state, submit, start, end, nodes, tres = parts[:7]
        restart = runs.get(job_id, 0)
        runs[job_id] = restart + 1
        started = sacct_time(start)
        if started is None:  # still pending
            continue
        tasks = max(1, int(nodes or 1)) * per_node
        unit, units_allocated = tres_units(tres)
        units.append(unit)
        allocations.append(
            Allocation(
                job_id=job_id, restart=restart, start=started,
                end=sacct_time(end) or now, tasks=tasks, running=sacct_time(end) is None,
                units_per_task=units_allocated / tasks if units_allocated else 1.0,
                submit=sacct_time(submit),
            )
        )  # fmt: skip
    unit = "GPU-hours" if "GPU-hours" in units else (units[0] if units else "task-hours")
    return allocations, unit


def query_allocations(job_ids: list[str]) -> str | None:
    """sacct's lines for these jobs and their requeues; None when sacct does not answer."""
    try:
        done = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", SACCT_FIELDS],
            capture_output=True, text=True, timeout=SACCT_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def allocations_of_attempts(records: Sequence[AttemptRecord]) -> list[Allocation]:
    """Without sacct: each job run spans its attempts."""
    spans: dict[tuple[str, int], list[AttemptRecord]] = {}
    for record in records:
        spans.setdefault((record.job_id, record.restart), []).append(record)
    return [
        Allocation(
            job_id=job_id,
            restart=restart,
            start=min(r.start for r in mine),
            end=max(r.end for r in mine),
            tasks=max(1, *(r.num_tasks for r in mine)),
        )
        for (job_id, restart), mine in spans.items()
    ]


def allocations_of_processes(trainers: Sequence[Process]) -> list[Allocation]:
    """Without a SLURM job: each trainer process, from its start to its last record."""
    return [
        Allocation(
            job_id="",
            restart=number,
            start=min(float(p.startup.get("process_start", p.first_step)), p.first_step),
            end=p.last_record,
            tasks=max(1, int(p.startup.get("world_size", 1))),
        )
        for number, p in enumerate(trainers)
    ]


def read_metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    records = []
    try:
        text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def running_recovery(run_dir: Path, records: Sequence[AttemptRecord]) -> dict[str, Any] | None:
    """The restart into the attempt still under way (begun, no record yet), so far."""
    try:
        folder = current_folder(run_dir)
    except ConfigError:
        return None
    begun = read_json_object(folder / "begin.json")
    if not begun or any(r.attempt == begun.get("attempt") for r in records):
        return None
    job = JobFacts(
        job_id=str(begun.get("job_id", "")), restart=int(begun.get("restart", 0)),
        allocation=(), tasks_per_node=1, end_time=None,
    )  # fmt: skip
    found = restart_phases(run_dir, records, job, begun, read_json_object(folder / "place.json"))
    return None if found is None else {"attempt": begun["attempt"], **found}


def run_goodput(
    run_dir: str | Path, *, query: Callable[[list[str]], str | None] = query_allocations
) -> Goodput:
    """The goodput of the run in `run_dir` (`query`: asks sacct about these job ids)."""
    goodput = _run_goodput(Path(run_dir), query)
    running = running_recovery(Path(run_dir), read_records(Path(run_dir)))
    if running is not None:
        goodput.recoveries.append(running)
    return goodput


def _run_goodput(folder: Path, query: Callable[[list[str]], str | None]) -> Goodput:
    records = read_records(folder)
    trainers = processes(read_timeline(folder), read_metrics_records(folder))
    job_ids = recorded_job_ids(folder, read_job_record(folder))
    job_ids += [r.job_id for r in records if r.job_id not in job_ids]
    notes: list[str] = []
    if job_ids:
        text = query(job_ids)
        if text is not None:
            allocations, unit = parse_allocations(text, records, time.time())
            goodput = account(allocations, records, trainers, unit=unit, source="sacct")
            goodput.notes = notes
            goodput.spare = hindsight(goodput, records)
            return goodput
        notes.append(
            "sacct did not answer: each allocation is taken as the span of its attempts "
            "(the job script's own start and the queue wait are unknown)"
        )
        allocations = allocations_of_attempts(records)
        source = "attempts"
    else:
        allocations = allocations_of_processes(trainers)
        source = "processes"
        notes.append("no SLURM job: each trainer process is counted from its start")
    goodput = account(allocations, records, trainers, unit="task-hours", source=source)
    goodput.notes = notes
    goodput.spare = hindsight(goodput, records) if records else None
    return goodput


def hindsight(goodput: Goodput, records: Sequence[AttemptRecord]) -> dict[str, Any] | None:
    """What a spare node saved or cost this run (`resilience/spares.py`)."""
    per_node = tasks_per_node(records)
    return spare_hindsight(
        [
            SpareAllocation(
                job_id=a.job_id,
                restart=a.restart,
                hours=(a.end - a.start) / 3600,
                nodes=max(1, a.tasks // per_node),
                units_per_node=a.units_per_task * per_node,
                queue_wait_s=max(0.0, a.start - a.submit) if a.submit is not None else None,
            )
            for a in goodput.allocations
        ],
        records,
        goodput.unit,
    )


def describe(goodput: Goodput) -> list[str]:
    """The report's lines: every part in the allocation's unit and as a share of it."""
    total = goodput.allocated_hours
    parts, phases = goodput.part_hours(), goodput.phase_hours()
    attempts = sum(1 for r in goodput.rows if r.attempt is not None)
    lines = [
        f"goodput:   {total:.4f} {goodput.unit} allocated over {len(goodput.allocations)} "
        f"allocation(s) and {attempts} attempt(s) (from {goodput.source})"
    ]

    def row(label: str, hours: float, extra: str = "", indent: int = 2) -> str:
        share = 100 * hours / total if total else 0.0
        return f"{' ' * indent}{label:<{34 - indent}} {hours:12.4f}  {share:5.1f} %{extra}"

    for part in PARTS:
        extra = f"  ({goodput.lost_steps} steps)" if part == "lost" else ""
        lines.append(row(LABELS[part], parts[part], extra))
        if part == "startup":
            lines += [row(LABELS[p], phases[p], indent=4) for p in STARTUP_PHASES if phases[p]]
    lines.append(row("sum", sum(parts.values())))
    wait = goodput.queue_wait_s
    if wait is not None:
        lines.append(
            f"  queue wait: {wait:.0f} s in the queue, not allocated "
            f"({goodput.queue_wait_hours or 0.0:.4f} {goodput.unit} at the size asked for)"
        )
    if goodput.spare is not None:
        lines.append(describe_hindsight(goodput.spare))
    for r in goodput.rows:
        if r.attempt is None:
            continue
        hours = {p: v * r.units_per_task / 3600 for p, v in r.parts.items()}
        biggest = sorted(hours, key=lambda p: -hours[p])[:3]
        spent = sum(hours.values())
        shares = ", ".join(f"{LABELS[p]} {100 * hours[p] / spent:.0f} %" for p in biggest if spent)
        job = f" (job {r.job_id})" if r.job_id and r.attempt else ""
        lines.append(
            f"  {r.label}{job}: {r.kind}, {r.tasks} task(s), {r.end - r.start:.0f} s: {shares}"
        )
    for found in goodput.recoveries:
        lines += describe_recovery(found["attempt"], found)
    lines += [f"  note: {note}" for note in goodput.notes]
    return lines


def write_goodput_plot(run_dir: str | Path) -> Path | None:
    """RUN_DIR/goodput.png: a stacked bar per attempt (`hpctrain plot`); None when the run has
    nothing to account (no attempts, no trainer records)."""
    from hpctrain.observe.plot import plot_goodput

    goodput = run_goodput(run_dir)
    if not goodput.rows:
        return None
    bars = []
    for row in goodput.rows:
        hours = {part: v * row.units_per_task / 3600 for part, v in row.parts.items()}
        if not any(hours.values()):
            continue
        label = f"{row.label}\n{row.kind}" if row.attempt is not None else f"{row.label}\nscript"
        bars.append((label, hours))
    parts = goodput.part_hours()
    total = goodput.allocated_hours
    productive = 100 * parts["productive"] / total if total else 0.0
    title = f"{total:.3g} {goodput.unit} allocated, {productive:.0f} % productive steps"
    return plot_goodput(bars, LABELS, goodput.unit, title, Path(run_dir) / "goodput.png")
