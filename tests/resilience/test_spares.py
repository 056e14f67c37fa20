"""How many spare nodes (`slurm.spare_nodes: auto`) and what a spare would have saved or cost
(resilience/spares.py): the arithmetic from table cases, no cluster."""

from __future__ import annotations

import math

import pytest

from hpctrain.resilience.restart_policy import AttemptRecord
from hpctrain.resilience.spares import (
    SpareAllocation,
    SpareModel,
    choose_spares,
    describe_hindsight,
    measured_queue_wait,
    poisson_at_least,
    queue_waits,
    requeues_per_allocation,
    spare_hindsight,
)


@pytest.mark.parametrize(
    ("m", "k", "tail"),
    [
        (0.5, 0, 1.0),
        (0.5, 1, 1 - math.exp(-0.5)),
        (2.0, 3, 1 - math.exp(-2) * (1 + 2 + 2)),
        (0.0, 1, 0.0),
        (800.0, 1, 1.0),  # exp(-800) is 0 in floats: still a probability
    ],
)
def test_the_poisson_tail(m: float, k: int, tail: float) -> None:
    assert poisson_at_least(m, k) == pytest.approx(tail)


@pytest.mark.parametrize(
    ("m", "spares", "requeues"),
    [
        (0.8, 0, 0.8),  # no spare: every failure requeues
        (0.0, 2, 0.0),
        # one spare: the second failure of an allocation requeues; the segment up to it is
        # cut at T: m P(X>=2) / (P(X>=1) + P(X>=2))
        (0.8, 1, 0.8 * (1 - math.exp(-0.8) * 1.8) / ((1 - math.exp(-0.8)) + (1 - math.exp(-0.8) * 1.8))),
        (0.01, 1, pytest.approx(0.01**2 / 2, rel=0.02)),  # rare failures: about P(X >= 2)
    ],
)  # fmt: skip
def test_requeues_per_allocation(m: float, spares: int, requeues: float) -> None:
    assert requeues_per_allocation(m, spares) == pytest.approx(requeues)


@pytest.mark.parametrize(
    ("nodes", "hours", "mtbf", "wait", "spares"),
    [
        (2, 20, 12600, 1.0, 0),  # a small job: a spare idles a third of it for 0.3 % risk
        (64, 20, 12600, 2.0, 0),  # 0.1 failures per allocation: not worth 20 node-hours
        (512, 20, 12600, 2.0, 3),  # 0.8 failures: three spares
        (512, 20, 12600, 0.0, 0),  # no wait: a requeue costs only a fresh start
        (512, 20, 6300, 6.0, 5),  # twice the failures, a longer wait
        (1024, 20, 6300, 12.0, 9),
        (8, 20, 100, 3.0, 1),  # a flaky site (1.6 failures), but a spare is 1/8 more nodes
    ],
)
def test_the_spares_that_maximise_expected_goodput(
    nodes: int, hours: float, mtbf: float, wait: float, spares: int
) -> None:
    model = SpareModel(nodes, hours, mtbf, wait)
    choice = choose_spares(model, "profile")
    assert choice.spares == spares
    assert choice.goodput[spares] == max(choice.goodput.values())
    assert choice.goodput[spares] == pytest.approx(model.goodput(spares))


def test_expected_goodput_by_hand_and_the_line_that_says_why() -> None:
    """512 nodes x 20 h, MTBF 12600 h: m = 0.8127 failures; without a spare each requeues:
    20 / (20 + m (60 s + 2 h + 60 s)) = 92.4 %."""
    model = SpareModel(512, 20, 12600, 2.0)
    m = 512 * 20 / 12600
    assert model.goodput(0) == pytest.approx(20 / (20 + m / 60 + m * (2 + 1 / 60)))
    assert choose_spares(model, "median of 12 of your jobs of the last 14 days, sacct").line == (
        "slurm.spare_nodes=auto: 3 spare node(s), expected goodput 99.3 % (0: 92.4 %, 2: 99.0 %, "
        "4: 99.1 %): 512 node(s) x 20 h at a node MTBF of 12600 h expect 0.813 node failure(s) "
        "per allocation; a spare idles 20 node-hours, a requeue waits 2 h (median of 12 of your "
        "jobs of the last 14 days, sacct)"
    )


def test_the_queue_wait_is_the_runs_own_then_the_users_then_unknown() -> None:
    asked: list[list[str]] = []
    lines = {
        "-D": "2026-01-01T10:00:00|2026-01-01T10:30:00\n2026-01-02T10:00:00|Unknown\n",
        "-u": "2026-01-01T10:00:00|2026-01-01T11:00:00\n"
        "2026-01-01T10:00:00|2026-01-01T13:00:00\n2026-01-01T10:00:00|2026-01-01T15:00:00\n",
    }

    def query(arguments: list[str]) -> str | None:
        asked.append(list(arguments))
        return lines.get(arguments[0])

    assert measured_queue_wait(["7", "9"], query=query, user="u") == (
        0.5, "median of 1 of this run's earlier jobs, sacct",
    )  # fmt: skip
    assert asked[-1] == ["-D", "-j", "7,9"]
    hours, where = measured_queue_wait([], query=query, user="u", now=1e9) or (0, "")
    assert (hours, where) == (3.0, "median of 3 of your jobs of the last 14 days, sacct")
    assert asked[-1][:3] == ["-u", "u", "-S"]
    assert measured_queue_wait(["7"], query=lambda _a: None, user="u") is None
    assert queue_waits("garbage\n|\n2026-01-01T10:00:00|None\n") == []


def attempt(number: int, job: str, restart: int, decision: str, aside: dict[str, str],
            nodes: tuple[str, ...] = ("n1", "n2")) -> AttemptRecord:  # fmt: skip
    return AttemptRecord(
        attempt=number, job_id=job, restart=restart, start=0.0, end=1.0, nodes=list(nodes),
        excluded=[], num_tasks=2 * len(nodes), kind="signal", decision=decision, reason="",
        set_aside=aside,
    )  # fmt: skip


def test_what_a_spare_would_have_saved_a_run_without_one() -> None:
    """Two nodes, no spare: a node set aside by a requeue that waited 30 min; a spare would
    have idled through both allocations (3 h x 4 GPUs) and saved that wait at the job's size
    (0.5 h x 8 GPUs)."""
    allocations = [
        SpareAllocation("7", 0, 1.0, 2, 4.0, 600.0),
        SpareAllocation("7", 1, 2.0, 2, 4.0, 1800.0),
    ]
    records = [attempt(1, "7", 0, "requeue", {"n2": "signal: rank 2 on n2 killed by SIGKILL"}),
               attempt(2, "7", 1, "done", {}, ("n1", "n3"))]  # fmt: skip
    spare = spare_hindsight(allocations, records, "GPU-hours")
    assert spare is not None
    assert (spare["spares"], spare["requeues_avoided"], spare["queue_wait_s"]) == (0, 1, 1200.0)
    assert spare["cost_hours"] == pytest.approx(12.0)
    assert spare["saved_hours"] == pytest.approx(1200 / 3600 * 8)
    assert describe_hindsight(spare) == (
        "  spare nodes: none; one would have cost 12.0000 GPU-hours idle and saved 2.6667 "
        "GPU-hours (1 requeue(s) x 1200 s of queue wait at the job's size)"
    )


def test_what_the_spare_of_a_run_cost_and_saved() -> None:
    allocations = [SpareAllocation("7", 0, 2.0, 3, 1.0, None)]
    records = [attempt(1, "7", 0, "restart", {"n2": "signal: ..."}),
               attempt(2, "7", 0, "done", {}, ("n1", "n3"))]  # fmt: skip
    spare = spare_hindsight(allocations, records, "CPU core-hours")
    assert spare is not None and (spare["spares"], spare["had_spares"]) == (1, True)
    assert spare["cost_hours"] == pytest.approx(2.0) and spare["saved_hours"] is None
    assert describe_hindsight(spare) == (
        "  spare nodes: 1 cost 2.0000 CPU core-hours idle, saved 1 requeue(s), queue wait unknown"
    )
    assert spare_hindsight([], records, "GPU-hours") is None
