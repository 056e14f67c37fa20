"""A restart's seconds by phase (resilience/recovery.py) on made-up timestamps, as the next
attempt's record keeps them and as `hpctrain status --goodput` says them.

The restart of `restart_files`: rank 1 dies at 100.0; `attempts end` starts at 100.4 (srun
returned) and the next attempt begins at 100.9; it is placed at 101.0 (no probe); its rank 0
starts at 101.3 and reaches its first step at 103.3 (its start-up phases: 0.2 s interpreter
and imports, 0.5 process group, 0.1 index, 0.2 model build, 0.6 checkpoint load, the other
0.4 s its own); that step ends at 104.0: 4.0 s in all.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from hpctrain.resilience.attempts import (
    begin_and_place,
    current_folder,
    end_attempt,
    place_attempt,
    read_records,
)
from hpctrain.resilience.goodput_report import describe, run_goodput
from hpctrain.resilience.recovery import PHASES, recovery
from hpctrain.resilience.restart_policy import AttemptRecord
from tests.resilience.test_attempts import JOB, config, probe_record, rank_record

FAILED = AttemptRecord(
    attempt=1, job_id="42", restart=0, start=90.0, end=100.8, nodes=["n1", "n2"], excluded=[],
    num_tasks=4, kind="signal", decision="restart", reason="",
    first_failure={"rank": 1, "node": "n1", "signal": "SIGKILL", "time": 100.0}, step_end=100.4,
)  # fmt: skip
STARTUP = {"kind": "startup", "attempt": 2, "time": 103.3, "process_start": 101.3, "step": 10,
           "phases": {"interpreter_and_imports": 0.2, "process_group": 0.5, "index": 0.1,
                      "model_build": 0.2, "checkpoint_load": 0.6, "other": 0.35}}  # fmt: skip
FIRST = {"kind": "first_step", "time": 104.0, "step": 11}
EXPECTED = {
    "detection": 0.4, "decision": 0.5, "probe": 0.1, "launch": 0.3,
    "interpreter_and_imports": 0.2, "process_group": 0.5, "index": 0.1, "model_build": 0.2,
    "checkpoint_load": 0.6, "other": 0.4, "first_step": 0.7,
}  # fmt: skip


def test_the_phases_of_a_restart_add_up_from_the_failure_to_the_first_step() -> None:
    found = recovery(FAILED, {"start": 100.9}, {"time": 101.0}, STARTUP, FIRST)
    assert list(found["phases"]) == list(PHASES)
    assert found["phases"] == pytest.approx(EXPECTED)
    assert found["total_s"] == pytest.approx(4.0) == pytest.approx(sum(found["phases"].values()))
    assert (found["after_attempt"], found["kind"], found["to"], found["step"]) == (
        1, "signal", "first_step", 11)  # fmt: skip


def test_a_restart_not_yet_at_its_first_step_has_the_phases_it_went_through() -> None:
    started = recovery(FAILED, {"start": 100.9}, {"time": 101.0}, STARTUP, None)
    assert started["to"] == "started" and started["total_s"] is None
    assert started["phases"]["first_step"] is None
    assert started["phases"]["launch"] == pytest.approx(0.3)
    placed = recovery(FAILED, {"start": 100.9}, {"time": 101.0}, None, None)
    assert placed["to"] == "placed"
    assert all(placed["phases"][p] is None for p in PHASES[4:])
    # an older record without `step_end`: the decision and the detection are unknown
    old = recovery(AttemptRecord.from_json({**FAILED.to_json(), "step_end": None}),
                   {"start": 100.9}, {"time": 101.0}, STARTUP, FIRST)  # fmt: skip
    assert old["phases"]["detection"] is None and old["phases"]["decision"] is None
    assert old["total_s"] is None


def test_trainer_phases_longer_than_its_start_up_are_cut_to_it() -> None:
    """The clock's marks are apart by a few ms: the phases are kept inside the span from the
    process's start to its first step, the last ones cut first."""
    long = {**STARTUP, "phases": {**STARTUP["phases"], "checkpoint_load": 5.0}}
    found = recovery(FAILED, {"start": 100.9}, {"time": 101.0}, long, FIRST)
    assert found["phases"]["checkpoint_load"] == pytest.approx(2.0 - 1.0)
    assert found["phases"]["other"] == 0.0
    assert found["total_s"] == pytest.approx(sum(found["phases"].values()))


def restart_files(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Attempt 1 of job 42 killed, attempt 2 begun by the same `attempts end` and trained to
    its first step (the timeline as its rank 0 writes it); attempt 2's record not written."""
    cfg = config(tmp_path)
    run_dir = Path(cfg.run_dir)
    begin_and_place(cfg, JOB)
    folder = current_folder(run_dir)
    for node in ("n1", "n2", "n3"):
        probe_record(folder, node)
    place_attempt(cfg, JOB)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step-10\n")
    now = time.time()
    rank_record(folder, 0, "n1", ended=now - 1, exit_code=None, signal=int(signal.SIGKILL))
    for rank in (1, 2, 3):
        rank_record(folder, rank, "n1" if rank < 2 else "n2", ended=now, exit_code=7)
    end_attempt(cfg, JOB, srun_status=137, state="RUNNING", step_end=now + 0.2)
    text = begin_and_place(cfg, JOB)
    assert "PLACED=1" in text  # after a SIGKILL: no probe, placed as it began
    begun = json.loads((current_folder(run_dir) / "begin.json").read_text())
    started = begun["start"] + 0.5
    timeline = [
        {**STARTUP, "process_start": started, "time": started + 2.0},
        {**FIRST, "time": started + 2.5},
    ]
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    return cfg, run_dir


def test_the_next_attempts_record_keeps_the_restarts_phases(tmp_path: Path) -> None:
    cfg, run_dir = restart_files(tmp_path)
    folder = current_folder(run_dir)
    for rank, node in enumerate(("n1", "n1", "n2", "n2")):
        rank_record(folder, rank, node)
    end_attempt(cfg, JOB, srun_status=0, state="RUNNING")
    failed, done = read_records(run_dir)
    assert failed.recovery is None and failed.step_end is not None
    assert done.step_end is not None and done.recovery is not None
    found = done.recovery
    assert (found["after_attempt"], found["to"], found["step"]) == (1, "first_step", 11)
    assert all(isinstance(found["phases"][p], float) for p in PHASES), found
    assert found["phases"]["launch"] == pytest.approx(0.5 - found["phases"]["probe"], abs=0.05)
    assert found["total_s"] == pytest.approx(sum(found["phases"].values()))
    on_disk = json.loads((run_dir / "slurm" / "attempts.jsonl").read_text().splitlines()[1])
    assert on_disk["recovery"] == found  # a field of the record, as docs/clusters.md says


def test_status_goodput_says_each_restarts_phases_also_while_it_trains(tmp_path: Path) -> None:
    _, run_dir = restart_files(tmp_path)
    goodput = run_goodput(run_dir, query=lambda ids: None)  # attempt 2 still training
    (found,) = goodput.to_json()["recoveries"]
    assert (found["attempt"], found["after_attempt"], found["to"]) == (2, 1, "first_step")
    lines = describe(goodput)
    at = next(i for i, line in enumerate(lines) if "restart after attempt 1 (signal)" in line)
    assert lines[at].endswith("from the failure to attempt 2's first step"), lines[at]
    assert [line.split()[0] for line in lines[at + 1 : at + 5]] == [
        "detection", "decision", "probe", "launch"]  # fmt: skip
    assert lines[at + 11].split()[:2] == ["first", "step"]
