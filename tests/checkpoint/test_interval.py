"""`checkpoint.every_minutes`: Young/Daly's interval from a save cost and a failure rate
(pure functions, hand-checked numbers)."""

from __future__ import annotations

import math

import pytest

from hpctrain.checkpoint.interval import (
    FIRST_INTERVAL_S,
    CheckpointInterval,
    FailureRate,
    young_daly_s,
)


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf() -> None:
    # a 30 s save, a failure every 10 h: sqrt(2 x 30 x 36000) = sqrt(2,160,000) = 1469.7 s
    assert young_daly_s(30.0, 36000.0) == pytest.approx(1469.69, abs=0.01)
    # four times the cost, twice the interval
    assert young_daly_s(120.0, 36000.0) == pytest.approx(2 * young_daly_s(30.0, 36000.0))
    assert young_daly_s(0.0, 36000.0) == 0.0


def test_a_save_costing_half_the_mtbf_or_more_saves_every_mtbf() -> None:
    """Daly 2006: sqrt(2CM) would exceed M itself there."""
    assert young_daly_s(50.0, 100.0) == 100.0
    assert young_daly_s(500.0, 100.0) == 100.0
    assert young_daly_s(49.0, 100.0) == pytest.approx(math.sqrt(2 * 49 * 100))


def test_the_prior_counts_as_one_failure_and_the_run_takes_over() -> None:
    none_yet = FailureRate.estimate(12600.0, 0, 100.0, "profile generic")
    assert none_yet.node_mtbf_hours == 12700.0  # (12600 + 100) / (1 + 0)
    flaky = FailureRate.estimate(12600.0, 9, 1400.0, "profile generic")
    assert flaky.node_mtbf_hours == 1400.0  # (12600 + 1400) / (1 + 9)
    assert "1,400 node-hours between failures" in flaky.describe()
    assert "this run 9 failure(s) in 1,400.0 node-hours" in flaky.describe()


def test_auto_divides_one_nodes_mtbf_by_the_nodes_and_starts_with_the_first_interval() -> None:
    rate = FailureRate.estimate(100.0, 0, 0.0, "a test")  # 100 h per node
    first = CheckpointInterval("auto", nodes=4, failure_rate=rate)
    assert first.mtbf_s == 100 * 3600 / 4  # 90,000 s: four nodes fail four times as often
    assert first.seconds == FIRST_INTERVAL_S and first.save_s is None
    first.after_save(20.0)
    assert first.seconds == pytest.approx(math.sqrt(2 * 20 * 90000))  # 1897.4 s
    assert first.inputs()["save_cost_s"] == 20.0
    assert "sqrt(2 x save 20.00 s x MTBF 90,000 s)" in first.describe()
    measured = CheckpointInterval("auto", nodes=4, failure_rate=rate, last_save_s=20.0)
    assert measured.seconds == pytest.approx(first.seconds)  # (and the microseconds run)


def test_numbers_are_minutes_and_zero_disables() -> None:
    assert CheckpointInterval(0.0).seconds is None
    fixed = CheckpointInterval(2.5)
    assert fixed.seconds == 150.0
    fixed.after_save(10.0)  # a fixed interval stays fixed
    assert fixed.seconds == 150.0 and fixed.inputs() == {}


def test_each_save_adds_the_node_hours_run_without_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("hpctrain.checkpoint.interval.time.monotonic", lambda: clock[0])
    rate = FailureRate.estimate(100.0, 1, 10.0, "a test")  # (100 + 10) / 2 = 55 h per node
    interval = CheckpointInterval("auto", nodes=2, failure_rate=rate)
    clock[0] += 3600.0  # an hour on 2 nodes: 2 more node-hours
    interval.after_save(20.0)
    assert interval.failure_rate.node_hours == 12.0
    assert interval.mtbf_s == (100 + 12) / 2 * 3600 / 2  # 56 h per node, 28 h for the job
    assert interval.seconds == pytest.approx(math.sqrt(2 * 20 * 28 * 3600))
