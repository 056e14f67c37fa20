"""The Trainer's own timing records (RUN_DIR/timeline.jsonl, the sums in metrics.jsonl) and
`checkpoint.every_minutes: auto` picking a new interval after each save (in this process)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpctrain.checkpoint.interval import FIRST_INTERVAL_S, FailureRate, young_daly_s
from hpctrain.distributed import resolve_env
from hpctrain.observe.timeline import read_timeline
from hpctrain.train.trainer import Trainer
from tests.train.test_trainer import CPU, make_config, read_jsonl

STARTUP_PHASES = {"interpreter_and_imports", "index", "model_build", "checkpoint_load", "other"}


def test_a_run_records_its_start_up_saves_evaluations_and_end(
    shapes_shards: Path, tmp_path: Path
) -> None:
    cfg = make_config(shapes_shards, tmp_path, "checkpoint.every_steps=2", "train.eval_every=2")
    assert Trainer(cfg, resolve_env({}), CPU).fit() == 0
    startup, first, *saves, end = read_timeline(tmp_path)
    assert startup["kind"] == "startup" and startup["step"] == 0 and startup["world_size"] == 1
    # the end of its first step: the end of a restart (resilience/recovery.py)
    assert (first["kind"], first["step"]) == ("first_step", 1) and first["time"] >= startup["time"]
    assert startup["phases"].keys() >= STARTUP_PHASES, startup
    assert all(v >= 0 for v in startup["phases"].values())
    assert startup["process_start"] <= startup["time"]
    assert [(r["kind"], r["step"]) for r in saves] == [("checkpoint", 2), ("checkpoint", 4)]
    assert all(r["blocking_s"] > 0 for r in saves)
    assert (end["kind"], end["step"], end["status"]) == ("end", 4, "finished")
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in metrics if r["kind"] == "train"]
    assert [r["interval_steps"] for r in train] == [1, 1, 1, 1]
    assert all(0 <= r["data_wait_s"] <= r["step_time_s"] for r in train)
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_time_s"] > 0 for r in evals)
    # every record carries its wall time, in the order written
    times = [r["time"] for r in metrics]
    assert times == sorted(times) and startup["time"] <= times[0] <= end["time"]


def test_auto_interval_takes_the_measured_save_cost_after_each_save(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2's save (every_steps) measures the cost; against a job that fails every few
    milliseconds Young/Daly then wants a save at every step: steps 3 and 4 save by time, which
    the first interval (5 minutes, before any measured save) would never have done."""
    # a node failing every few microseconds, however long the run goes on without a failure
    flaky = FailureRate.estimate(1e-6, 10**6, 0.0, "a test")
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "checkpoint.every_minutes=auto",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=10",
        "data.val=",
    )
    trainer = Trainer(cfg, resolve_env({}), CPU, failure_rate=flaky)
    assert trainer.save_interval.seconds == FIRST_INTERVAL_S
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        assert trainer.fit() == 0
    saves = [r for r in read_timeline(tmp_path) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 3, 4]
    for record in saves:  # each save logs the interval it leads to, with its inputs
        assert record["save_cost_s"] == record["blocking_s"]
        assert record["interval_s"] == young_daly_s(record["blocking_s"], record["mtbf_s"])
        assert record["mtbf_s"] < 0.01 and record["node_hours"] > 0  # the run so far counts
        assert (record["nodes"], record["failures"]) == (1, 10**6)
    lines = [
        r.getMessage() for r in caplog.records if "every_minutes=auto: every" in r.getMessage()
    ]
    assert len(lines) == 3 and "sqrt(2 x save" in lines[0] and "a test" in lines[0], lines

    # A later process of the run starts from the last measured cost, not the first interval.
    again = Trainer(cfg, resolve_env({}), CPU, failure_rate=FailureRate.estimate(1.0, 0, 0.0, "x"))
    assert again.save_interval.save_s == saves[-1]["blocking_s"]
    assert again.save_interval.seconds == young_daly_s(saves[-1]["blocking_s"], 3600.0)


def test_numeric_every_minutes_keeps_its_meaning(shapes_shards: Path, tmp_path: Path) -> None:
    for minutes, seconds in (("0", None), ("2.5", 150.0)):
        cfg = make_config(shapes_shards, tmp_path, f"checkpoint.every_minutes={minutes}")
        assert Trainer(cfg, resolve_env({}), CPU).save_interval.seconds == seconds
