"""Where an attempt trains after the health probe: the pure `place` of `resilience/attempts.py`.

Nodes that failed the probe (`resilience/probe.py`) are set aside when others passed; a
failure every node shares on a shared path is the path's; a hub nobody reached is blamed
alone; one probe sets aside at most a share of the nodes (`set_aside_cap`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeResult:
    """One node's health probe (`resilience/probe.py`)."""

    node: str
    failed_check: str = ""  # "" when it passed
    message: str = ""
    shared: bool = False  # the failed check reads a path every node shares (run folder, data)
    blames: str = ""  # the other node its failure names: the hub it could not reach
    peers_reached: int | None = None  # the hub's: how many other nodes reached it

    @property
    def ok(self) -> bool:
        return not self.failed_check


@dataclass(frozen=True)
class Placement:
    """Where the next attempt trains, or why it cannot."""

    nodes: tuple[str, ...]  # empty: no attempt here
    set_aside: dict[str, str]  # node → "check: why", failed the probe now
    line: str  # the log line ("" when every probed node passed)


# At most this share of the probed nodes is set aside by one probe (so excluded by one
# requeue), and at least MIN_SET_ASIDE: so many nodes failing at once is more often something
# they share (a switch, a file system, the job's own settings) than each node's fault, and
# every node set aside is one the job may never be scheduled on again.
SET_ASIDE_SHARE = 1 / 16
MIN_SET_ASIDE = 2


def set_aside_cap(num_probed: int) -> int:
    """The most nodes one probe of `num_probed` nodes sets aside: 1/16 of them, at least 2."""
    return max(MIN_SET_ASIDE, int(num_probed * SET_ASIDE_SHARE))


def blamed_hub(results: Sequence[ProbeResult]) -> str:
    """The collective's hub when it, not the nodes that could not reach it, is at fault.

    The collective is a star around the first probed node: when that node's network is dead,
    every other node fails "cannot reach n1". The hub is blamed when every collective failure
    names it and fewer nodes reached it than did not (none, when its own probe never answered);
    when most nodes reached it, it works, and those that could not are at fault. "" otherwise.
    """
    named = {r.blames for r in results if r.failed_check == "collective" and r.blames}
    if len(named) != 1:
        return ""
    hub = next(iter(named))
    record = next((r for r in results if r.node == hub), None)
    if record is None:
        return ""  # the hub is no node of this probe (a record of another attempt)
    failed = sum(1 for r in results if r.failed_check == "collective" and r.blames == hub)
    return hub if (record.peers_reached or 0) < failed else ""


def place(
    allocation: Sequence[str],
    excluded: Sequence[str],
    probes: Sequence[ProbeResult],
    *,
    nodes: int,
) -> Placement:
    """The `nodes` nodes of the allocation an attempt trains on, after the health probe.

    Nodes that failed the probe are set aside when others passed: the failure is theirs. When
    every probed node failed a check that reads a shared path (the run folder, the data),
    the path is at fault, not the nodes: they train, and the trainer names the problem. A
    node with no probe result (it never answered) failed; with no result at all (the probe
    is off, or its step could not start) every node not set aside trains. When the
    collective's hub is at fault (`blamed_hub`), only it is set aside: the nodes that could not
    reach it passed every check of their own. One probe sets aside at most `set_aside_cap`
    nodes; others that failed sit this attempt out without being set aside (nor excluded by
    a requeue), and the line says so.
    """
    candidates = [n for n in allocation if n not in excluded]
    if len(candidates) < nodes:
        aside = ", ".join(n for n in allocation if n in excluded)
        return Placement(
            (), {}, f"{len(candidates)} node(s) left ({aside} set aside), {nodes} needed"
        )
    if not probes:  # the probe is off (slurm.probe=false), or its srun could not start
        return Placement(tuple(candidates[:nodes]) if len(candidates) >= nodes else (), {}, "")
    found = {p.node: p for p in probes}
    results = [
        found.get(n, ProbeResult(n, "answer", "no probe result (node unreachable?)"))
        for n in candidates
    ]
    hub = blamed_hub(results)
    if hub:
        stranded = [r.node for r in results if r.failed_check == "collective" and r.blames == hub]
        reached = (found[hub].peers_reached or 0) if hub in found else 0
        why = (
            f"the hub, reached by {reached} node(s); {len(stranded)} could not "
            f"reach it ({_some(stranded)}), they are not set aside"
        )
        own = ("", "collective", "answer")  # the hub's own failure of another check stays
        results = [
            ProbeResult(r.node, "collective", why) if r.node == hub and r.failed_check in own
            else ProbeResult(r.node) if r.node in stranded else r
            for r in results
        ]  # fmt: skip
    failed = {r.node: f"{r.failed_check}: {r.message}" for r in results if not r.ok}
    healthy = [r.node for r in results if r.ok]
    shared_only = all(r.shared for r in results if not r.ok)
    if failed and not healthy and shared_only:
        chosen = tuple(candidates[:nodes])
        return Placement(
            chosen, {},
            "every node failed the same shared check (not a node's fault): training anyway, the trainer names the problem",
        )  # fmt: skip
    cap = set_aside_cap(len(candidates))
    set_aside = dict(list(failed.items())[:cap])
    lines = "; ".join(f"{node} failed {why}" for node, why in set_aside.items())
    if len(failed) > cap:
        spared = [n for n in failed if n not in set_aside]
        lines += (
            f"; {len(spared)} more failed ({_some(spared)}) but are not set aside: one probe "
            f"sets aside at most {cap} of {len(candidates)} nodes (1/16, at least "
            f"{MIN_SET_ASIDE}), so many failures at once are rarely each node's own"
        )
    if len(healthy) >= nodes:
        return Placement(tuple(healthy[:nodes]), set_aside, f"probe: {lines}" if failed else "")
    return Placement(
        (), set_aside, f"probe: {lines}; {len(healthy)} healthy node(s), {nodes} needed"
    )


def _some(names: Sequence[str], shown: int = 4) -> str:
    """`n1, n2, n3, n4 and 12 more`: a list that stays one short line at 2,048 nodes."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
