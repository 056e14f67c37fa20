"""How long a restart took, phase by phase: from a failure to the next attempt's first step.

A restart inside the allocation (docs/clusters.md) goes through these phases, one after
another; each is the time between two instants the job already records:

| phase | from | to |
|---|---|---|
| `detection` | the failure (`first_failure.time`: the watcher saw its rank end) | `attempts end` started (srun returned: the step ended; squeue asked) |
| `decision` | `attempts end` started | the next attempt began (`attempts end`, the job shell, sinfo, `attempts begin`) |
| `probe` | the next attempt began | it was placed (the probe's srun, `attempts place`) |
| `launch` | placed | rank 0's trainer process started (srun of the step, the watcher, a fork or exec) |
| `interpreter_and_imports` ... `other` | the trainer's start-up phases (`timeline.jsonl`: `startup`) | |
| `first_step` | the first step started (the `startup` record) | it ended (`first_step`) |

`recovery(...)` puts them together for one restart; the record of the attempt that restarted
keeps them (`attempts.jsonl`: `recovery`, written by `attempts end`), and `hpctrain status
--goodput` shows them. Pure functions: no file is read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpctrain.resilience.restart_policy import AttemptRecord

TRAINER_PHASES = (
    "interpreter_and_imports",
    "process_group",
    "index",
    "model_build",
    "checkpoint_load",
    "other",
)
PHASES = ("detection", "decision", "probe", "launch", *TRAINER_PHASES, "first_step")


def _time(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def trainer_records(
    timeline: Sequence[Mapping[str, Any]], attempt: int
) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """Rank 0's `startup` record of attempt `attempt` (timeline.jsonl) and the `first_step`
    record that followed it (None: not written yet, or the trainer never got there)."""
    startup = first = None
    for record in timeline:
        kind = record.get("kind")
        if kind == "startup":
            if startup is not None:  # a second process of the attempt: never, but stop there
                break
            if int(record.get("attempt") or 0) == attempt:
                startup = record
        elif kind == "first_step" and startup is not None:
            first = record
            break
    return startup, first


def recovery(
    failed: AttemptRecord,
    begun: Mapping[str, Any],
    placed: Mapping[str, Any],
    startup: Mapping[str, Any] | None,
    first_step: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The phases of the restart after `failed`, from the next attempt's `begin.json` and
    `place.json` and its rank 0's `startup` and `first_step` timeline records.

    A phase whose end (or start) is not known is None, and so is `total_s` unless every
    phase is known; `total_s` is their sum: the failure to the end of the first step, each
    phase at least 0 (the failure's time comes from its node's clock, the others from the
    batch node's and rank 0's: a clock behind by a few ms must not make a phase negative).
    `to`: how far the restart got (`first_step`, `started`, `placed`, `begun`).
    """
    failure = _time((failed.first_failure or {}).get("time"))
    step_end = _time(failed.step_end)
    begin = _time(begun.get("start"))
    place = _time(placed.get("time"))
    process = _time((startup or {}).get("process_start"))
    first_start = _time((startup or {}).get("time"))
    first_end = _time((first_step or {}).get("time"))
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    phases.update(
        detection=_span(failure, step_end),
        decision=_span(step_end, begin),
        probe=_span(begin, place),
        launch=_span(place, process),
        first_step=_span(first_start, first_end),
    )
    if process is not None and first_start is not None:
        # The trainer's own phases, cut to its start-up span as the goodput does: the last
        # one, `other`, takes what the others leave (the clock's marks are a few ms apart).
        budget = max(0.0, first_start - process)
        recorded = 0.0
        for name, seconds in ((startup or {}).get("phases") or {}).items():
            if name in TRAINER_PHASES and name != "other" and isinstance(seconds, (int, float)):
                share = max(0.0, min(float(seconds), budget - recorded))
                phases[name] = (phases[name] or 0.0) + share
                recorded += share
        for name in TRAINER_PHASES:
            phases[name] = phases[name] or 0.0
        phases["other"] = budget - recorded
    reached = (
        "first_step" if first_end else "started" if startup else "placed" if place else "begun"
    )
    known = [v for v in phases.values() if v is not None]
    total = sum(known) if len(known) == len(PHASES) else None
    return {
        "after_attempt": failed.attempt,
        "kind": failed.kind,
        "failure": failure,
        "to": reached,
        "step": (first_step or {}).get("step"),
        "total_s": total,
        "phases": phases,
    }


def describe_recovery(attempt: int, found: Mapping[str, Any]) -> list[str]:
    """Lines for `hpctrain status --goodput`: the restart's seconds, phase by phase."""
    total = found.get("total_s")
    head = f"{total:.1f} s" if isinstance(total, (int, float)) else "incomplete"
    lines = [
        f"  restart after attempt {found.get('after_attempt')} ({found.get('kind')}): "
        f"{head} from the failure to attempt {attempt}'s first step"
    ]
    phases = found.get("phases") or {}
    for name in PHASES:
        seconds = phases.get(name)
        shown = f"{seconds:8.2f} s" if isinstance(seconds, (int, float)) else "       - "
        lines.append(f"    {PHASE_LABELS[name]:<30} {shown}")
    return lines


PHASE_LABELS = {
    "detection": "detection",
    "decision": "decision",
    "probe": "probe",
    "launch": "launch",
    "interpreter_and_imports": "interpreter and imports",
    "process_group": "process group",
    "index": "data index",
    "model_build": "model build",
    "checkpoint_load": "checkpoint load",
    "other": "other start-up",
    "first_step": "first step",
}
