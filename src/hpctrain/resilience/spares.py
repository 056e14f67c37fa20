"""How many spare nodes a job should ask for (`slurm.spare_nodes: auto`), and what a spare
would have saved or cost a run that ran (`hpctrain status --goodput`).

The model (docs/clusters.md, "How many spares"): a job trains on N nodes for allocations of
T hours; each node fails at the profile's rate 1/`mtbf_node_hours`, so an allocation expects
m = N x T / MTBF node failures (Poisson). A failed node is set aside; while a spare stands by
the job restarts in place on it, otherwise it requeues (a fresh allocation, with its spares
again) and waits W hours in the queue. With K spares, an allocation requeues at its (K+1)-th
failure, so per T hours of training the job requeues

    q(K) = m x P(X >= K+1) / sum_{j=0..K} P(X >= j+1),  X ~ Poisson(m)

times (q(0) = m: every failure; the expected segment between two requeues is a renewal
process cut at T). A spare costs its idle node-hours (K x T per T of training, charged);
what it saves is the requeues' queue wait and fresh start at the job's size. Expected goodput
is the training node-hours over everything they cost:

    G(K) = N x T / ((N + K) x (T + m x r + q(K) x (W + s)))

with r a restart in place and s what a new allocation adds before the same restart (its job
script and probe). `choose_spares` takes the K with the highest G (the fewest on a tie). Idle
spares failing, and a bigger job waiting longer, are left out: both are small beside the
terms kept.

The queue wait W is measured where it can be (`measured_queue_wait`: sacct's submit and start
of the run's own earlier jobs, else of the user's recent ones), else the profile's
`queue_wait_hours`.
"""

from __future__ import annotations

import getpass
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hpctrain.resilience.restart_policy import AttemptRecord

RESTART_S = 60.0  # a restart in place: detection, probe, launch, imports, load (docs/clusters.md)
REQUEUE_EXTRA_S = 60.0  # a new allocation's prolog, job script and probe before that restart
MAX_SPARES = 64  # searched up to this many (or slurm.nodes)
RECENT_DAYS = 14  # the user's jobs whose queue wait stands for the site's
SACCT_TIMEOUT_S = 30


def poisson_at_least(m: float, k: int) -> float:
    """P(X >= k) for X ~ Poisson(m)."""
    if k <= 0:
        return 1.0
    if m <= 0:
        return 0.0
    term = math.exp(-m)  # P(X = 0); Python's floats reach m ~ 700 before it is 0
    below = 0.0
    for j in range(k):
        below += term
        term *= m / (j + 1)
    return min(1.0, max(0.0, 1.0 - below))


def requeues_per_allocation(m: float, spares: int) -> float:
    """q(K): requeues per allocation-length of training with `spares` spares and `m`
    expected node failures per allocation (see the module docstring)."""
    if m <= 0:
        return 0.0
    cut = poisson_at_least(m, spares + 1)
    segment = sum(poisson_at_least(m, j + 1) for j in range(spares + 1))
    return m * cut / segment if segment > 0 else 0.0


@dataclass(frozen=True)
class SpareModel:
    """The inputs of the spare arithmetic."""

    nodes: int  # N: nodes an attempt trains on
    hours: float  # T: the allocation's wall time
    mtbf_node_hours: float  # one node's mean hours between failures (the profile's)
    queue_wait_hours: float  # W: a requeue's wait in the queue
    restart_s: float = RESTART_S  # r
    requeue_extra_s: float = REQUEUE_EXTRA_S  # s

    @property
    def failures(self) -> float:
        """m: node failures an allocation expects."""
        return self.nodes * self.hours / self.mtbf_node_hours

    def goodput(self, spares: int) -> float:
        """G(K): the expected share of the node-hours paid for (allocated, and waited in the
        queue at the job's size) that train."""
        m = self.failures
        overhead = m * self.restart_s / 3600 + requeues_per_allocation(m, spares) * (
            self.queue_wait_hours + self.requeue_extra_s / 3600
        )
        return self.nodes * self.hours / ((self.nodes + spares) * (self.hours + overhead))


@dataclass(frozen=True)
class SpareChoice:
    spares: int
    goodput: dict[int, float]  # K → G(K) for the counts weighed
    line: str  # why, in one line


def choose_spares(model: SpareModel, wait_source: str) -> SpareChoice:
    """The number of spares with the highest expected goodput, and why in one line.

    `wait_source` says where `model.queue_wait_hours` comes from (sacct, the profile).
    """
    goodput: dict[int, float] = {}
    best = 0
    for spares in range(min(MAX_SPARES, model.nodes) + 1):
        goodput[spares] = model.goodput(spares)
        if goodput[spares] > goodput[best]:
            best = spares
        elif spares > best + 1:
            break  # G falls past its peak: each further spare saves less and costs the same
    shown = sorted({0, best - 1, best + 1} & set(goodput) - {best})
    others = ", ".join(f"{k}: {100 * goodput[k]:.1f} %" for k in shown)
    line = (
        f"slurm.spare_nodes=auto: {best} spare node(s), expected goodput "
        f"{100 * goodput[best]:.1f} % ({others}): {model.nodes} node(s) x "
        f"{_hours(model.hours)} at a node MTBF of {model.mtbf_node_hours:g} h expect "
        f"{model.failures:.3g} node failure(s) per allocation; a spare idles "
        f"{model.hours:.3g} node-hours, a requeue waits {_hours(model.queue_wait_hours)} "
        f"({wait_source})"
    )
    return SpareChoice(best, goodput, line)


def _hours(hours: float) -> str:
    return f"{hours:.3g} h" if hours >= 1 else f"{hours * 60:.3g} min"


# ------------------------------------------------------------------------------ queue wait
def queue_waits(text: str) -> list[float]:
    """Seconds from submit to start of sacct's `Submit|Start` lines (jobs that started)."""
    waits = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 2:
            continue
        submit, start = _sacct_time(parts[0]), _sacct_time(parts[1])
        if submit is not None and start is not None and start >= submit:
            waits.append(start - submit)
    return waits


def _sacct_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def sacct(arguments: Sequence[str]) -> str | None:
    """sacct's `Submit|Start` lines for these selection arguments; None: no answer."""
    try:
        done = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-o", "Submit,Start", *arguments],
            capture_output=True, text=True, timeout=SACCT_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def measured_queue_wait(
    job_ids: Sequence[str],
    *,
    query: Callable[[Sequence[str]], str | None] = sacct,
    user: str | None = None,
    now: float | None = None,
) -> tuple[float, str] | None:
    """(hours, where from): the median queue wait of the run's own earlier jobs (`job_ids`,
    their requeues included), else of the user's jobs of the last `RECENT_DAYS` days; None
    when sacct does not answer (no accounting, not on a cluster) or knows no started job."""
    if job_ids:
        waits = queue_waits(query(["-D", "-j", ",".join(job_ids)]) or "")
        if waits:
            return statistics.median(waits) / 3600, _median_of(waits, "this run's earlier jobs")
    since = time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.localtime((now or time.time()) - RECENT_DAYS * 86400)
    )
    try:
        who = user or getpass.getuser()
    except (KeyError, OSError):
        return None
    waits = queue_waits(query(["-u", who, "-S", since]) or "")
    if waits:
        return statistics.median(waits) / 3600, _median_of(
            waits, f"your jobs of the last {RECENT_DAYS} days"
        )
    return None


def _median_of(waits: Sequence[float], whose: str) -> str:
    return f"median of {len(waits)} of {whose}, sacct"


# ------------------------------------------------------------------------------ hindsight
@dataclass(frozen=True)
class SpareAllocation:
    """What the hindsight needs of one allocation (from `goodput.Allocation`)."""

    job_id: str
    restart: int
    hours: float  # its elapsed wall time
    nodes: int  # nodes allocated
    units_per_node: float  # GPUs (CPUs) per node: the report's unit
    queue_wait_s: float | None  # its submit (or requeue) to start


def spare_hindsight(
    allocations: Sequence[SpareAllocation], records: Sequence[AttemptRecord], unit: str
) -> dict[str, Any] | None:
    """What a spare node saved or cost the run (it had some), or would have (it had none):
    the cost is a node's idle hours over its allocations; the saving, the queue wait of each
    requeue a spare avoided (a node set aside while the job restarted in place) or would have
    avoided (a requeue to set a node aside), at the job's size. None: nothing to say (no
    allocation, or no attempt that trained)."""
    trained = {(r.job_id, r.restart): len(r.nodes) for r in records if r.nodes and r.num_tasks}
    if not allocations or not trained:
        return None
    spares = max(
        (a.nodes - trained.get((a.job_id, a.restart), a.nodes) for a in allocations), default=0
    )
    waits = [a.queue_wait_s for a in allocations if a.queue_wait_s is not None]
    wait_s = statistics.median(waits) if waits else None
    had = spares > 0
    per = max(1, spares)
    cost = sum(a.hours * a.units_per_node * per for a in allocations)
    if had:  # restarts in place with a node set aside: a spare took its place
        events = [r for r in records if r.decision == "restart" and r.set_aside]
    else:  # requeues to set a node aside: a spare would have restarted in place
        events = [r for r in records if r.decision == "requeue" and r.set_aside]
    size = max(a.nodes * a.units_per_node for a in allocations)
    saved = None if wait_s is None else len(events) * wait_s / 3600 * size
    return {
        "spares": spares,
        "had_spares": had,
        "cost_hours": cost,
        "requeues_avoided": len(events),
        "queue_wait_s": wait_s,
        "saved_hours": saved,
        "unit": unit,
    }


def describe_hindsight(spare: dict[str, Any]) -> str:
    """The report's line for `spare_hindsight`'s answer."""
    unit, count = spare["unit"], spare["requeues_avoided"]
    if spare["saved_hours"] is None:
        saving = f"{count} requeue(s), queue wait unknown"
    else:
        saving = (
            f"{spare['saved_hours']:.4f} {unit} ({count} requeue(s) x "
            f"{spare['queue_wait_s']:.0f} s of queue wait at the job's size)"
        )
    if spare["had_spares"]:
        return (
            f"  spare nodes: {spare['spares']} cost {spare['cost_hours']:.4f} {unit} idle, "
            f"saved {saving}"
        )
    return (
        f"  spare nodes: none; one would have cost {spare['cost_hours']:.4f} {unit} idle "
        f"and saved {saving}"
    )
