"""Where a run's allocated hours went: the accounting behind `hpctrain status RUN --goodput`.

Every allocation of the run (one per job and requeue: SLURM's accounting) is cut into parts
along its timeline, attempt by attempt (`RUN_DIR/slurm/attempts.jsonl`), with what rank 0 of
each attempt recorded (`RUN_DIR/timeline.jsonl`: start-up phases, saves, the end;
`metrics.jsonl`: step time and data wait per logged interval, evaluation time):

    job start ─ job script ─┬─ attempt ───────────────────────────────────────────┬─ ... ─ job end
                            probe, launch, start-up │ steps, saves, evaluations │ tail
                                                     first step          last step / failure

- `startup`: the job script before, between and after attempts' decisions (`job_script`),
  each attempt's probe and launch, then the trainer's phases (interpreter and imports,
  process group, index, model build, checkpoint load, other) up to its first step; an
  attempt that never reached a step is start-up all through;
- `productive`, `data_wait`: the steps' time, less and only their wait for the loader;
- `checkpoint`: training blocked by saves (with `checkpoint.async`, the staging and the wait
  for the last save at the end);
- `evaluation`: periodic and final evaluations;
- `lost`: after a failure, everything past the newest committed checkpoint up to the failure
  (the steps the next attempt trains again; `lost_steps` counts them, up to the step the
  trainer's end record or metrics reached);
- `hung`: after a `hang` or a `lost` node, from the failure (the culprit's last progress;
  for a lost node, when its peers stopped hearing from it) to its detection (its watcher
  ended it; srun ended the step): every task waited on the one that stopped;
- `loop_overhead`: the rest of the loop's time (logging, the ranks' flag exchange, Python);
- `tail`: from the last step (or the failure, or its detection) to the attempt's end (exit,
  teardown, the decision), and from the last attempt's end to the job's end;
- `idle`: allocated nodes no task ran on (spares, nodes set aside).

The parts of one allocation add up to its elapsed time times its tasks by construction
(every instant is in one part); what is measured is how the time inside the loop splits, and
`loop_overhead` is what the trainer's own figures leave there. Amounts are task-seconds here;
`Goodput.hours` turns them into the allocation's unit (GPU-hours, CPU core-hours). Queue wait
is outside the allocations and reported beside them. Pure functions: `goodput_report.py` reads
the files and sacct.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpctrain.resilience.recovery import TRAINER_PHASES
from hpctrain.resilience.restart_policy import AttemptRecord

PARTS = (
    "productive",
    "data_wait",
    "checkpoint",
    "evaluation",
    "lost",
    "hung",
    "startup",
    "loop_overhead",
    "tail",
    "idle",
)
HUNG_KINDS = ("hang", "lost")  # failures every task waits on until they are detected
# the job script's and the launch's share of a start-up, then the trainer's own phases
STARTUP_PHASES = ("job_script", "probe_and_launch", *TRAINER_PHASES)


@dataclass(frozen=True)
class Allocation:
    """One run of one job (sacct -D: a requeued job has one per run)."""

    job_id: str
    restart: int
    start: float  # wall times, seconds since the epoch
    end: float
    tasks: int  # nodes x tasks per node
    units_per_task: float = 1.0  # GPUs (else CPUs) allocated per task
    submit: float | None = None  # when it (or its requeue) entered the queue
    running: bool = False  # still running: `end` is now


@dataclass
class Process:
    """What rank 0 of one trainer process recorded: its start-up record, the records after."""

    startup: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def first_step(self) -> float:
        return float(self.startup["time"])

    @property
    def last_record(self) -> float:
        times = [r["time"] for r in (*self.train, *self.evals, *self.saves) if "time" in r]
        if self.end is not None:
            times.append(self.end["time"])
        return max([self.first_step, *times])

    @property
    def step_reached(self) -> int:
        """The last step it trained: its end record says so before any logged interval."""
        steps = (
            int(r["step"]) for r in (*self.train, *self.saves, *([self.end] if self.end else []))
        )
        return max([int(self.startup.get("step", 0)), *steps])


def processes(
    timeline: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]]
) -> list[Process]:
    """The trainer processes of a run: each start-up record and what followed it (metrics
    records are placed by their wall time; those without one, older runs', are left out)."""
    found: list[Process] = []
    for record in timeline:
        kind = record.get("kind")
        if kind == "startup":
            found.append(Process(startup=record))
        elif found and kind == "checkpoint":
            found[-1].saves.append(record)
        elif found and kind == "end":
            found[-1].end = record
    starts = [p.first_step for p in found]  # in the order written: one process after another
    for record in metrics:
        when = record.get("time")
        if not isinstance(when, (int, float)) or not found or when < starts[0]:
            continue
        owner = found[bisect.bisect_right(starts, when) - 1]
        if record.get("kind", "train") == "train":
            owner.train.append(record)
        elif record.get("kind") == "eval":
            owner.evals.append(record)
    return found


@dataclass
class Row:
    """One attempt (or the job script's time around them) of one allocation."""

    label: str
    job_id: str
    attempt: int | None
    kind: str
    start: float
    end: float
    tasks: int
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STARTUP_PHASES, 0.0))
    lost_steps: int = 0
    units_per_task: float = 1.0

    def add(self, part: str, task_seconds: float) -> None:
        self.parts[part] += task_seconds

    def startup(self, phase: str, task_seconds: float) -> None:
        self.parts["startup"] += task_seconds
        self.phases[phase] += task_seconds


@dataclass
class Goodput:
    """The run's allocations, cut into parts (task-seconds), row by row."""

    unit: str  # "GPU-hours", "CPU core-hours" or "task-hours"
    allocations: list[Allocation]
    rows: list[Row]
    source: str  # where the allocations came from: "sacct", "attempts" or "processes"
    notes: list[str] = field(default_factory=list)
    spare: dict[str, Any] | None = None  # what a spare node saved or cost (resilience/spares.py)
    # each restart inside an allocation, phase by phase (resilience/recovery.py), with the
    # attempt it led to (`attempt`)
    recoveries: list[dict[str, Any]] = field(default_factory=list)

    def part_hours(self) -> dict[str, float]:
        """Every part in the allocation's unit (hours x GPUs or CPUs)."""
        return {
            part: sum(row.parts[part] * row.units_per_task for row in self.rows) / 3600
            for part in PARTS
        }

    def phase_hours(self) -> dict[str, float]:
        return {
            phase: sum(row.phases[phase] * row.units_per_task for row in self.rows) / 3600
            for phase in STARTUP_PHASES
        }

    @property
    def allocated_hours(self) -> float:
        return sum(a.tasks * a.units_per_task * (a.end - a.start) for a in self.allocations) / 3600

    @property
    def queue_wait_s(self) -> float | None:
        """Wall seconds the run's jobs waited in the queue (None: unknown)."""
        waits = [a.start - a.submit for a in self.allocations if a.submit is not None]
        return sum(max(0.0, w) for w in waits) if waits else None

    @property
    def queue_wait_hours(self) -> float | None:
        """The queue wait times the resources asked for: what the allocation did not get."""
        if self.queue_wait_s is None:
            return None
        return (
            sum(
                max(0.0, a.start - a.submit) * a.tasks * a.units_per_task
                for a in self.allocations
                if a.submit is not None
            )
            / 3600
        )

    @property
    def lost_steps(self) -> int:
        return sum(row.lost_steps for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        parts = self.part_hours()
        return {
            "unit": self.unit,
            "source": self.source,
            "allocated_hours": self.allocated_hours,
            "parts_hours": parts,
            "sum_hours": sum(parts.values()),
            "startup_phases_hours": self.phase_hours(),
            "lost_steps": self.lost_steps,
            "queue_wait_s": self.queue_wait_s,
            "queue_wait_hours": self.queue_wait_hours,
            "allocations": [a.__dict__ for a in self.allocations],
            "rows": [
                {
                    "label": r.label, "job_id": r.job_id, "attempt": r.attempt, "kind": r.kind,
                    "start": r.start, "end": r.end, "tasks": r.tasks, "lost_steps": r.lost_steps,
                    "parts_hours": {p: v * r.units_per_task / 3600 for p, v in r.parts.items()},
                }
                for r in self.rows
            ],
            "notes": self.notes,
            "spare": self.spare,
            "recoveries": self.recoveries,
        }  # fmt: skip


def _between(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def account_attempt(
    record: AttemptRecord,
    process: Process | None,
    allocation: Allocation,
    start: float,
    end: float,
) -> Row:
    """One attempt between `start` and `end` (its record's times, kept inside the allocation)."""
    tasks = record.num_tasks
    label = f"attempt {record.attempt}" if record.attempt else f"job {record.job_id} trainer"
    if not record.job_id:  # a run without SLURM: its trainer processes, one by one
        label = f"process {record.restart + 1}"
    row = Row(
        label=label, job_id=record.job_id, attempt=record.attempt,
        kind=record.kind, start=start, end=end, tasks=tasks,
        units_per_task=allocation.units_per_task,
    )  # fmt: skip
    if not tasks:  # the probe left too few nodes: the whole allocation probed
        row.startup("probe_and_launch", (end - start) * allocation.tasks)
        return row
    row.add("idle", (end - start) * max(0, allocation.tasks - tasks))
    if process is None:  # it never reached a step: start-up all through
        row.startup("probe_and_launch", (end - start) * tasks)
        return row
    first = _between(process.first_step, start, end)
    _count_startup(row, process, start, first)
    loop_end = _between(_loop_end(record, process, end), first, end)
    # Work past the newest committed checkpoint is lost: the next attempt trains it again.
    reached = max(record.step_reached or 0, process.step_reached)
    committed = record.committed
    lost_from = int(process.startup.get("step", 0)) if committed is None else committed
    cut = loop_end
    if reached > lost_from:
        row.lost_steps = reached - lost_from
        saved = [s["time"] for s in process.saves if s.get("step") == lost_from]
        cut = _between(saved[-1] if saved else first, first, loop_end)
    _count_loop(row, process, first, cut, lost_from if cut < loop_end else None)
    row.add("lost", (loop_end - cut) * tasks)
    found = _between(_detected(record, end), loop_end, end)
    row.add("hung", (found - loop_end) * tasks)
    row.add("tail", (end - found) * tasks)
    return row


def _detected(record: AttemptRecord, end: float) -> float:
    """When a hang or a lost node was found (the failure until then is `hung`); other
    failures are found at once."""
    failure = record.first_failure or {}
    if record.kind not in HUNG_KINDS or not isinstance(failure.get("time"), (int, float)):
        return float("-inf")
    found = failure.get("detected")
    return float(found) if isinstance(found, (int, float)) else end


def _count_startup(row: Row, process: Process, start: float, first: float) -> None:
    """From the attempt's start to its first step: probe and launch (until the process
    started), then the phases the trainer measured."""
    launched = _between(float(process.startup.get("process_start", first)), start, first)
    row.startup("probe_and_launch", (launched - start) * row.tasks)
    recorded = 0.0
    for phase, seconds in (process.startup.get("phases") or {}).items():
        name = phase if phase in STARTUP_PHASES and phase != "job_script" else "other"
        share = max(0.0, min(float(seconds), first - launched - recorded))
        row.startup(name, share * row.tasks)
        recorded += share
    row.startup("other", (first - launched - recorded) * row.tasks)


def _loop_end(record: AttemptRecord, process: Process, end: float) -> float:
    """When the attempt stopped training: at the first rank's failure (the time after it is
    the tail: the others noticing, srun ending the step), else at rank 0's end record or its
    last record; now, for an attempt still training."""
    failed_at = (record.first_failure or {}).get("time")
    if record.kind == "running":
        return end
    if not isinstance(failed_at, (int, float)):
        return process.end["time"] if process.end is not None else process.last_record
    # rank 0 ran to the failure at least (its last record may be well before it)
    return min(failed_at, process.end["time"]) if process.end is not None else failed_at


def _count_loop(
    row: Row, process: Process, first: float, cut: float, lost_from: int | None
) -> None:
    """The loop's time from its first step to `cut`: what rank 0's records say it spent on
    steps, data wait, evaluations and saves up to then, and the rest as overhead.

    `lost_from`: the step work is lost after (when `cut` is its save): a logged interval that
    holds steps on both sides counts its steps up to it.
    """
    claimed = 0.0
    for r in process.train:
        steps = max(1, int(r.get("interval_steps", 1)))
        share = 1.0 if r["time"] <= cut else 0.0
        if share == 0.0 and lost_from is not None and r["step"] - steps < lost_from < r["step"]:
            share = (lost_from - (r["step"] - steps)) / steps
        step_s = float(r.get("step_time_s", 0.0)) * steps * share
        wait_s = min(float(r.get("data_wait_s", 0.0)) * share, step_s)
        row.add("productive", (step_s - wait_s) * row.tasks)
        row.add("data_wait", wait_s * row.tasks)
        claimed += step_s
    for part, records, key in (
        ("evaluation", process.evals, "eval_time_s"),
        ("checkpoint", process.saves, "blocking_s"),
        ("checkpoint", [process.end] if process.end else [], "save_wait_s"),
    ):
        for r in records:
            if r["time"] <= cut:
                row.add(part, float(r.get(key, 0.0)) * row.tasks)
                claimed += float(r.get(key, 0.0))
    row.add("loop_overhead", (cut - first - claimed) * row.tasks)


def account(
    allocations: Sequence[Allocation],
    records: Sequence[AttemptRecord],
    trainers: Sequence[Process],
    *,
    unit: str,
    source: str,
) -> Goodput:
    """Cut every allocation into parts along its attempts (see the module docstring)."""
    rows: list[Row] = []
    by_number = {int(p.startup.get("attempt") or 0): p for p in trainers}
    by_number.pop(0, None)  # not started by a job script's attempt: placed by time below
    for allocation in allocations:
        mine = [
            r for r in records if (r.job_id, r.restart) == (allocation.job_id, allocation.restart)
        ]
        mine.sort(key=lambda r: r.start)
        script = Row(
            label=f"job {allocation.job_id}" + (f" (requeue {allocation.restart})" if allocation.restart else ""),
            job_id=allocation.job_id, attempt=None, kind="job script", start=allocation.start,
            end=allocation.end, tasks=allocation.tasks, units_per_task=allocation.units_per_task,
        )  # fmt: skip
        now = allocation.start
        for record in mine:
            start = _between(record.start, now, allocation.end)
            end = _between(record.end, start, allocation.end)
            script.startup("job_script", (start - now) * allocation.tasks)
            process = by_number.get(record.attempt) or next(
                (p for p in trainers if start <= p.first_step <= end), None
            )  # without an attempt number (no job script's attempt): placed by time
            rows.append(account_attempt(record, process, allocation, start, end))
            now = end
        # A trainer after the last record: the attempt still running, one whose job was
        # killed under it (its record comes with the next attempt), or a job script without
        # attempt records. It stands in for its attempt, to the allocation's end.
        unrecorded = [p for p in trainers if now < p.first_step <= allocation.end]
        if unrecorded or not mine:
            process = unrecorded[0] if unrecorded else None
            record = _stand_in(allocation, process, now)
            rows.append(account_attempt(record, process, allocation, now, allocation.end))
            now = allocation.end
        script.add("tail", (allocation.end - now) * allocation.tasks)
        if allocation.job_id:  # a trainer without SLURM has no job script around it
            rows.append(script)
    recoveries = [{"attempt": r.attempt, **r.recovery} for r in records if r.recovery]
    return Goodput(
        unit=unit, allocations=list(allocations), rows=rows, source=source, recoveries=recoveries
    )


def _stand_in(allocation: Allocation, process: Process | None, start: float) -> AttemptRecord:
    """A record for a trainer without one, from `start` to the allocation's end: committed up
    to its newest save (a running one has lost nothing yet)."""
    end = process.end if process is not None else None
    saves = [int(s["step"]) for s in process.saves] if process is not None else []
    committed = max(saves) if saves else None
    if process is not None and allocation.running:
        committed = process.step_reached
    kind = str(end["status"]) if end else ("running" if allocation.running else "unrecorded")
    tasks = (
        int(process.startup.get("world_size", allocation.tasks)) if process else allocation.tasks
    )
    return AttemptRecord(
        attempt=int(process.startup.get("attempt") or 0) if process else 0,
        job_id=allocation.job_id, restart=allocation.restart, start=start, end=allocation.end,
        nodes=[], excluded=[], num_tasks=min(tasks, allocation.tasks), kind=kind, decision="",
        reason="", committed=committed,
    )  # fmt: skip
