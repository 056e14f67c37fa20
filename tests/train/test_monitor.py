"""MetricMonitor: which evaluations are among the best, early stopping, resumed state."""

from __future__ import annotations

import math

import pytest

from hpctrain.config import ConfigError
from hpctrain.train.metrics import MetricMonitor


def record(step: int, value: float) -> dict:
    return {"kind": "eval", "step": step, "epoch": 0, "val_loss": value, "val_accuracy": 1 - value}


def test_keep_best_says_when_to_save_and_patience_when_to_stop():
    monitor = MetricMonitor("val_loss", mode="min", keep_best=2, patience=2)
    enters = [monitor.observe(record(s, v)) for s, v in [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.8)]]
    # 0.9 and 0.5 fill the two places; 0.7 beats 0.9; 0.8 is worse than both kept (0.5, 0.7)
    assert enters == [True, True, True, False]
    assert monitor.best == [0.5, 0.7]
    assert monitor.evals_since_best == 2 and monitor.should_stop  # 0.7, 0.8: not below 0.5
    assert monitor.score_at(4) == 0.8 and monitor.score_at(3) is None


def test_state_continues_after_a_resume_and_nan_is_never_best():
    monitor = MetricMonitor("val_accuracy", mode="max", keep_best=1, patience=3)
    monitor.observe(record(1, 0.5))  # accuracy 0.5
    monitor.observe(record(2, 0.6))  # accuracy 0.4: no better
    resumed = MetricMonitor("val_accuracy", mode="max", keep_best=1, patience=3)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.best == [0.5] and resumed.evals_since_best == 1
    assert not resumed.observe({"kind": "eval", "step": 3, "val_accuracy": math.nan})
    assert not resumed.should_stop
    assert not resumed.observe(record(4, 0.9))
    assert resumed.should_stop
    other = MetricMonitor("val_loss", mode="min")
    other.load_state_dict(monitor.state_dict())  # another metric: starts afresh
    assert other.best == [] and other.evals_since_best == 0


def test_misconfigured_monitor_is_named():
    with pytest.raises(ConfigError, match="checkpoint.keep_best needs checkpoint.monitor"):
        MetricMonitor("", keep_best=2)
    with pytest.raises(ConfigError, match="train.early_stop_patience needs checkpoint.monitor"):
        MetricMonitor("", patience=2)
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.monitor='val_acc': not in the evaluation record \(val_loss, val_accuracy\)",
    ):
        MetricMonitor("val_acc").observe(record(1, 0.5))
    assert not MetricMonitor("").observe(record(1, 0.5))  # off: never saves
