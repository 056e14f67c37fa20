"""QoS and time limits as the live cluster states them (`sacctmgr`, `scontrol`).

A profile's QoS table is what the documentation said when it was written; sites rename QoS
and change limits. When the SLURM commands answer (on a login node), the job's QoS, wall time
and partition are checked against the cluster itself, so a renamed QoS fails here and not
after `sbatch` (or, worse, after a queue wait when the job is refused at start). When they do
not answer, the profile's table was the only check, and the preflight says so.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from hpctrain.launch.checks import Check
from hpctrain.launch.profiles import JobSpec, LaunchError, format_minutes, parse_time

QUERY_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class PartitionLimits:
    name: str
    max_minutes: int | None  # None: UNLIMITED
    allowed_qos: tuple[str, ...] | None  # None: ALL


def _run(argv: list[str]) -> str | None:
    """stdout of a SLURM query, or None when the command is missing, fails or hangs."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _minutes(text: str) -> int | None:
    """A SLURM time limit → minutes; None for no limit (empty, UNLIMITED, INFINITE)."""
    text = text.strip()
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    try:
        return parse_time(text, "limit")
    except LaunchError:
        return None


def parse_qos_table(text: str) -> dict[str, int | None]:
    """`sacctmgr -n -P show qos format=Name,MaxWall` → {name: max minutes or None}."""
    table: dict[str, int | None] = {}
    for line in text.splitlines():
        name, _, max_wall = line.partition("|")
        if name.strip():
            table[name.strip()] = _minutes(max_wall)
    return table


def parse_partition(text: str) -> PartitionLimits | None:
    """`scontrol show partition -o NAME` (one line of KEY=VALUE) → its limits."""
    fields = dict(word.split("=", 1) for word in text.split() if "=" in word)
    if "PartitionName" not in fields:
        return None
    allow = fields.get("AllowQos", "ALL")
    return PartitionLimits(
        name=fields["PartitionName"],
        max_minutes=_minutes(fields.get("MaxTime", "")),
        allowed_qos=None if allow == "ALL" else tuple(q for q in allow.split(",") if q),
    )


def query_qos_table() -> dict[str, int | None] | None:
    out = _run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxWall"])
    return None if out is None else parse_qos_table(out)


def query_partition(name: str) -> tuple[bool, PartitionLimits | None]:
    """(answered, limits): limits None with answered True means no such partition."""
    out = _run(["scontrol", "show", "partition", "-o", name])
    if out is None:
        # scontrol exits 1 for an unknown partition; tell that apart from no cluster at all
        ping = _run(["scontrol", "ping"])
        return (ping is not None and "UP" in ping), None
    return True, parse_partition(out)


def check_live_limits(job: JobSpec) -> list[Check]:
    """The job's QoS, wall time and partition against the live cluster (see module docstring)."""
    checks: list[Check] = []
    qos_table = query_qos_table()
    answered = qos_table is not None
    if qos_table is not None and job.qos:
        if job.qos not in qos_table:
            known = ", ".join(sorted(qos_table)) or "none"
            checks.append(
                Check(
                    "qos",
                    False,
                    f"slurm.qos={job.qos!r}: the cluster has no such QoS (sacctmgr lists: {known}); fix: set slurm.qos to one of them and update the profile {job.profile}",
                )
            )
        elif (limit := qos_table[job.qos]) is not None and job.time_minutes > limit:
            checks.append(
                Check(
                    "qos",
                    False,
                    f"slurm.time={job.time}: above the live MaxWall {format_minutes(limit)} of QoS {job.qos} (sacctmgr); fix: lower slurm.time or pick another QoS",
                )
            )
        else:
            checks.append(Check("qos", True, f"{job.qos} exists on the cluster (sacctmgr)"))
    if job.partition:
        part_answered, part = query_partition(job.partition)
        answered = answered or part_answered
        if part_answered and part is None:
            checks.append(
                Check(
                    "partition",
                    False,
                    f"slurm.partition={job.partition!r}: the cluster has no such partition (scontrol); fix: set slurm.partition and update the profile {job.profile}",
                )
            )
        elif part is not None:
            checks += _partition_checks(job, part)
    if not answered:
        checks.append(
            Check(
                "cluster limits",
                True,
                "sacctmgr/scontrol did not answer here: QoS and time checked against the profile's table only",
                warning=True,
            )
        )
    return checks


def _partition_checks(job: JobSpec, part: PartitionLimits) -> list[Check]:
    if part.max_minutes is not None and job.time_minutes > part.max_minutes:
        return [
            Check(
                "partition",
                False,
                f"slurm.time={job.time}: above partition {part.name}'s MaxTime {format_minutes(part.max_minutes)} (scontrol); fix: lower slurm.time",
            )
        ]
    if job.qos and part.allowed_qos is not None and job.qos not in part.allowed_qos:
        return [
            Check(
                "partition",
                False,
                f"slurm.qos={job.qos!r}: partition {part.name} allows only {', '.join(part.allowed_qos)} (scontrol); fix: pick one of them",
            )
        ]
    return [Check("partition", True, f"{part.name} takes {job.time} (scontrol)")]
