"""The goodput accounting on made-up records (hand-checked numbers), and its report.

The run of `RUN`: job 7 on one node with 2 tasks; attempt 1 dies at 1040 (a rank killed at
step 15; committed 10, reached 14), attempt 2 is preempted (saved at step 20), the job
requeues and attempt 3 completes at step 30. Times are seconds since the epoch; every amount
below is worked out by hand in the comments (task-seconds: seconds x 2 tasks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli.main import main
from hpctrain.resilience.goodput import Allocation, account, processes
from hpctrain.resilience.goodput_report import describe, parse_allocations, run_goodput, tres_units
from hpctrain.resilience.restart_policy import AttemptRecord


def attempt(number: int, start: float, end: float, kind: str, restart: int = 0,
            **fields: Any) -> AttemptRecord:  # fmt: skip
    return AttemptRecord(
        attempt=number, job_id="7", restart=restart, start=start, end=end, nodes=["n1"],
        excluded=[], num_tasks=fields.pop("num_tasks", 2), kind=kind, decision="restart",
        reason="", **fields,
    )  # fmt: skip


def train(step: int, time: float, steps: int, step_time_s: float, data_wait_s: float) -> dict:
    return {"kind": "train", "step": step, "time": time, "interval_steps": steps,
            "step_time_s": step_time_s, "data_wait_s": data_wait_s}  # fmt: skip


def startup(attempt: int, step: int, process_start: float, time: float, **phases: float) -> dict:
    return {"kind": "startup", "attempt": attempt, "step": step, "time": time,
            "process_start": process_start, "world_size": 2, "phases": phases}  # fmt: skip


RECORDS = [
    attempt(1, 1002, 1050, "signal", committed=10, step_reached=14,
            first_failure={"rank": 1, "node": "n1", "signal": "SIGKILL", "time": 1040.0}),
    attempt(2, 1052, 1090, "preempted", resumed_from=10, committed=20, step_reached=20),
    attempt(3, 1112, 1148, "completed", restart=1, resumed_from=20, committed=30, step_reached=30),
]  # fmt: skip
TIMELINE = [
    startup(1, 0, 1004, 1010, interpreter_and_imports=3, process_group=1, index=1,
            model_build=0.5, checkpoint_load=0, other=0.5),
    {"kind": "checkpoint", "step": 10, "time": 1022, "blocking_s": 2.0},
    {"kind": "end", "step": 14, "time": 1045, "status": "failed", "save_wait_s": 0.0},
    startup(2, 10, 1054, 1060, interpreter_and_imports=2, process_group=1, index=1,
            model_build=1, checkpoint_load=1),
    {"kind": "checkpoint", "step": 20, "time": 1076, "blocking_s": 1.5},
    {"kind": "end", "step": 20, "time": 1080, "status": "preempted", "save_wait_s": 0.5},
    startup(3, 20, 1113, 1120, interpreter_and_imports=4, process_group=1, index=1,
            model_build=0.5, checkpoint_load=0.5),
    {"kind": "checkpoint", "step": 30, "time": 1133, "blocking_s": 2.0},
    {"kind": "end", "step": 30, "time": 1138, "status": "finished", "save_wait_s": 0.0},
]  # fmt: skip
METRICS = [
    train(5, 1015, 5, 0.8, 1.0), train(10, 1020, 5, 0.8, 0.5), train(14, 1035, 4, 2.0, 0.0),
    train(15, 1065, 5, 0.9, 0.5), train(20, 1070, 5, 0.9, 0.5),
    {"kind": "eval", "step": 20, "time": 1074, "eval_time_s": 3.5},
    train(25, 1125, 5, 0.9, 0.0), train(30, 1130, 5, 0.9, 0.0),
    {"kind": "eval", "step": 30, "time": 1137, "eval_time_s": 3.8},
]  # fmt: skip
ALLOCATIONS = [
    Allocation(job_id="7", restart=0, start=1000, end=1100, tasks=2, submit=990),
    Allocation(job_id="7", restart=1, start=1111, end=1150, tasks=2, submit=1100),
]


def test_the_parts_of_a_run_with_a_restart_and_a_requeue_are_where_the_time_went() -> None:
    goodput = account(ALLOCATIONS, RECORDS, processes(TIMELINE, METRICS), unit="task-hours",
                      source="test")  # fmt: skip
    rows = {row.label: row for row in goodput.rows}
    first = rows["attempt 1"].parts
    # attempt 1 (1002-1050): probe and launch 2 s, start-up phases 6 s (first step at 1010);
    # steps to the save of step 10 at 1022: 2 x (5 x 0.8) s, of which 1.0 + 0.5 s data wait;
    # save 2 s; the rest of 1010-1022 is loop overhead (12 - 10 = 2 s); lost: 1022 to the
    # failure at 1040 (18 s, steps 11-14); tail: 1040 to 1050.
    assert first == pytest.approx({
        "productive": 2 * 6.5, "data_wait": 2 * 1.5, "checkpoint": 2 * 2.0, "evaluation": 0.0,
        "lost": 2 * 18.0, "hung": 0.0, "startup": 2 * 8.0, "loop_overhead": 2 * 2.0, "tail": 2 * 10.0,
        "idle": 0.0,
    })  # fmt: skip
    assert rows["attempt 1"].lost_steps == 4
    # attempt 2 (1052-1090): start-up 2 + 6 s; steps 2 x 4.5 s (1 s waiting); evaluation 3.5 s;
    # save 1.5 s and 0.5 s waiting for it at the end; overhead 20 - 14.5 = 5.5 s; tail 10 s.
    assert rows["attempt 2"].parts == pytest.approx({
        "productive": 2 * 8.0, "data_wait": 2 * 1.0, "checkpoint": 2 * 2.0, "evaluation": 2 * 3.5,
        "lost": 0.0, "hung": 0.0, "startup": 2 * 8.0, "loop_overhead": 2 * 5.5, "tail": 2 * 10.0,
        "idle": 0.0,
    })  # fmt: skip
    # the job script: 1000-1002 and 1050-1052 before the attempts, 1090-1100 after them
    assert rows["job 7"].parts["startup"] == 2 * 4.0 and rows["job 7"].parts["tail"] == 2 * 10.0
    assert rows["attempt 3"].parts["loop_overhead"] == pytest.approx(2 * (18 - 14.8))
    assert rows["job 7 (requeue 1)"].parts == pytest.approx(
        {**dict.fromkeys(first, 0.0), "startup": 2 * 1.0, "tail": 2 * 2.0}
    )
    hours = goodput.part_hours()
    assert {part: round(h * 3600, 6) for part, h in hours.items()} == {
        "productive": 47.0, "data_wait": 5.0, "checkpoint": 12.0, "evaluation": 14.6,
        "lost": 36.0, "hung": 0.0, "startup": 58.0, "loop_overhead": 21.4, "tail": 84.0, "idle": 0.0,
    }  # fmt: skip
    assert sum(hours.values()) == pytest.approx(goodput.allocated_hours)  # (100 + 39) x 2 s
    assert goodput.allocated_hours * 3600 == pytest.approx(278.0)
    assert {p: round(h * 3600, 6) for p, h in goodput.phase_hours().items()} == {
        "job_script": 10.0, "probe_and_launch": 10.0, "interpreter_and_imports": 18.0,
        "process_group": 6.0, "index": 6.0, "model_build": 4.0, "checkpoint_load": 3.0,
        "other": 1.0,
    }  # fmt: skip
    assert goodput.lost_steps == 4
    assert goodput.queue_wait_s == 21.0 and goodput.queue_wait_hours * 3600 == 42.0


def test_work_past_a_save_inside_a_logged_interval_is_split_by_steps() -> None:
    """Steps 6-10 logged together at 1020, the save of step 8 at 1016 in between, the
    failure at 1030: steps 6-8 were kept (3/5 of the interval), 9 and 10 lost."""
    allocation = Allocation(job_id="7", restart=0, start=1000, end=1040, tasks=1)
    record = attempt(1, 1000, 1040, "signal", num_tasks=1, committed=8, step_reached=10,
                     first_failure={"time": 1030.0})  # fmt: skip
    timeline = [startup(1, 5, 1000, 1010), {"kind": "checkpoint", "step": 8, "time": 1016,
                                            "blocking_s": 1.0}]  # fmt: skip
    row = account([allocation], [record], processes(timeline, [train(10, 1020, 5, 1.0, 0.5)]),
                  unit="task-hours", source="test").rows[0]  # fmt: skip
    assert row.lost_steps == 2
    assert row.parts["productive"] + row.parts["data_wait"] == pytest.approx(3.0)  # 3/5 of 5 s
    assert row.parts["data_wait"] == pytest.approx(0.3)
    assert row.parts["lost"] == pytest.approx(1030 - 1016)
    assert row.parts["loop_overhead"] == pytest.approx((1016 - 1010) - 3.0 - 1.0)
    assert sum(row.parts.values()) == pytest.approx(40.0)


def test_the_wait_on_a_stopped_rank_is_hung_not_tail() -> None:
    """A hang (#47): the stopped rank's last progress at 1030, its watcher ended it at
    1040, the attempt was decided at 1046. 1030-1040 every task waited on it: `hung`, not
    the tail; the tail is what followed its detection."""
    allocation = Allocation(job_id="7", restart=0, start=1000, end=1050, tasks=2)
    failure = {"rank": 1, "node": "n1", "time": 1030.0, "detected": 1040.0, "stopped": True}
    record = attempt(1, 1000, 1046, "hang", committed=10, step_reached=14, first_failure=failure)
    timeline = [startup(1, 0, 1002, 1010),
                {"kind": "checkpoint", "step": 10, "time": 1022, "blocking_s": 2.0}]  # fmt: skip
    metrics = [train(10, 1020, 10, 0.8, 0.0), train(14, 1028, 4, 1.0, 0.0)]
    rows = {row.label: row for row in account([allocation], [record], processes(timeline, metrics),
                                              unit="task-hours", source="test").rows}  # fmt: skip
    parts = rows["attempt 1"].parts
    assert parts["lost"] == pytest.approx(2 * (1030 - 1022))  # the steps after the save
    assert parts["hung"] == pytest.approx(2 * (1040 - 1030))
    assert parts["tail"] == pytest.approx(2 * (1046 - 1040))
    assert sum(parts.values()) == pytest.approx(2 * 46.0)
    # a lost node found only when srun ended the step: hung up to the decision
    lost = attempt(1, 1000, 1046, "lost", committed=10, step_reached=14,
                   first_failure={"rank": 2, "node": "n2", "time": 1030.0, "detected": None})  # fmt: skip
    row = account([allocation], [lost], processes(timeline, metrics), unit="h", source="t").rows[0]
    assert row.parts["hung"] == pytest.approx(2 * 16.0) and row.parts["tail"] == 0.0


def test_a_failure_before_the_first_logged_interval_loses_the_steps_its_end_record_names() -> None:
    """`train.log_every=10`, a failure at step 7: no interval was logged, but the trainer's
    end record says step 7 (#47: booked as loop overhead with 0 lost steps)."""
    allocation = Allocation(job_id="7", restart=0, start=1000, end=1040, tasks=1)
    record = attempt(1, 1000, 1040, "hang", num_tasks=1, step_reached=None,
                     first_failure={"time": 1030.0, "detected": 1035.0})  # fmt: skip
    timeline = [startup(1, 0, 1002, 1010),
                {"kind": "end", "step": 7, "time": 1036, "status": "failed", "save_wait_s": 0.0}]  # fmt: skip
    row = account([allocation], [record], processes(timeline, []), unit="h", source="t").rows[0]
    assert row.lost_steps == 7
    assert row.parts["lost"] == pytest.approx(1030 - 1010) and row.parts["loop_overhead"] == 0.0
    assert row.parts["hung"] == pytest.approx(5.0)


def test_spare_nodes_are_idle_and_an_attempt_the_probe_stopped_is_start_up() -> None:
    allocation = Allocation(job_id="7", restart=0, start=1000, end=1100, tasks=3)  # 3 x 1
    probe = attempt(1, 1000, 1010, "probe", num_tasks=0)
    trained = attempt(2, 1010, 1100, "completed", num_tasks=2, committed=0, step_reached=0)
    goodput = account([allocation], [probe, trained], [], unit="task-hours", source="test")
    rows = {row.label: row for row in goodput.rows}
    assert rows["attempt 1"].parts["startup"] == 3 * 10.0  # the whole allocation probed
    assert rows["attempt 2"].parts["idle"] == 1 * 90.0  # the third node stood by
    assert rows["attempt 2"].parts["startup"] == 2 * 90.0  # no trainer record: start-up
    assert sum(goodput.part_hours().values()) * 3600 == pytest.approx(300.0)


def test_sacct_lines_give_the_allocations_their_requeues_and_units() -> None:
    text = (
        "7|REQUEUED|2026-12-02T03:00:01|2026-12-02T03:00:02|2026-12-02T03:00:05|1|"
        "billing=2,cpu=2,node=1\n"
        "7|COMPLETED|2026-12-02T03:00:05|2026-12-02T03:00:17|2026-12-02T03:00:20|1|"
        "billing=2,cpu=2,node=1\n"
        "8|PENDING|2026-12-02T03:00:05|Unknown|Unknown|1|\n"
    )
    allocations, unit = parse_allocations(text, RECORDS, now=0.0)
    assert unit == "CPU core-hours"
    assert [(a.job_id, a.restart, a.end - a.start, a.start - a.submit, a.tasks, a.units_per_task)
            for a in allocations] == [("7", 0, 3.0, 1.0, 2, 1.0), ("7", 1, 3.0, 12.0, 2, 1.0)]  # fmt: skip
    assert tres_units("billing=32,cpu=32,gres/gpu=4,node=1") == ("GPU-hours", 4.0)


def write_run(run_dir: Path) -> None:
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "slurm" / "job_id").write_text("7\n")
    (run_dir / "slurm" / "attempts.jsonl").write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in RECORDS)
    )
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TIMELINE))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))


def sacct_line(job: str, submit: float, start: float, end: float) -> str:
    from datetime import datetime

    def iso(t: float) -> str:
        return datetime.fromtimestamp(t).isoformat(timespec="seconds")

    return f"{job}|COMPLETED|{iso(submit)}|{iso(start)}|{iso(end)}|1|billing=8,cpu=8,node=1\n"


def test_the_report_reads_the_run_folder_and_says_every_part(tmp_path: Path) -> None:
    write_run(tmp_path)
    answer = sacct_line("7", 990, 1000, 1100) + sacct_line("7", 1100, 1111, 1150)
    goodput = run_goodput(tmp_path, query=lambda ids: answer if ids == ["7"] else None)
    assert goodput.source == "sacct" and goodput.unit == "CPU core-hours"
    # 8 CPUs for 2 tasks: 4 CPU core-hours per task-hour
    assert goodput.allocated_hours * 3600 == pytest.approx(4 * 278.0)
    assert goodput.part_hours()["lost"] * 3600 == pytest.approx(4 * 36.0)
    lines = describe(goodput)
    assert (
        lines[0].startswith("goodput:")
        and "CPU core-hours allocated over 2 allocation(s) and 3 attempt(s)" in lines[0]
    )
    text = "\n".join(lines)
    assert "lost work (trained again)" in text and "(4 steps)" in text
    assert "queue wait: 21 s in the queue" in text
    assert "attempt 1 (job 7): signal, 2 task(s), 48 s" in text
    assert json.loads(json.dumps(goodput.to_json()))["lost_steps"] == 4
    # no spare (1 node): one would have idled 139 s x 8 CPUs, and no requeue set a node aside
    assert (
        "  spare nodes: none; one would have cost 0.3089 CPU core-hours idle and saved 0.0000 "
        "CPU core-hours (0 requeue(s) x 10 s of queue wait at the job's size)"
    ) in lines
    assert goodput.to_json()["spare"]["cost_hours"] == pytest.approx(139 * 8 / 3600)


def test_without_sacct_the_attempts_give_the_allocations(tmp_path: Path) -> None:
    write_run(tmp_path)
    goodput = run_goodput(tmp_path, query=lambda ids: None)
    assert (goodput.source, goodput.unit, goodput.queue_wait_s) == ("attempts", "task-hours", None)
    # job 7's first run spans attempts 1-2 (1002-1090), its requeue attempt 3 (1112-1148)
    assert goodput.allocated_hours * 3600 == pytest.approx(2 * (88 + 36))
    assert sum(goodput.part_hours().values()) == pytest.approx(goodput.allocated_hours)
    assert "sacct did not answer" in describe(goodput)[-1]


def write_local_run(run_dir: Path) -> None:
    timeline = [startup(0, 0, 1000, 1006, interpreter_and_imports=4, index=2),
                {"kind": "checkpoint", "step": 10, "time": 1020, "blocking_s": 1.0},
                {"kind": "end", "step": 10, "time": 1021, "status": "finished", "save_wait_s": 0.0}]  # fmt: skip
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    (run_dir / "metrics.jsonl").write_text(json.dumps(train(10, 1018, 10, 1.2, 2.0)) + "\n")


def test_a_run_without_a_slurm_job_counts_each_process_from_its_start(tmp_path: Path) -> None:
    write_local_run(tmp_path)
    goodput = run_goodput(tmp_path, query=lambda ids: pytest.fail("no job to ask about"))
    assert goodput.source == "processes"
    parts = {p: round(h * 3600, 6) for p, h in goodput.part_hours().items() if h}
    # 2 ranks, 1000-1021: start-up 6 s, steps 12 s (2 s waiting), save 1 s, overhead 2 s
    assert parts == {"productive": 20.0, "data_wait": 4.0, "checkpoint": 2.0, "startup": 12.0,
                     "loop_overhead": 4.0}  # fmt: skip


@pytest.mark.slow  # matplotlib
def test_status_goodput_and_plot_of_a_run_without_a_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_local_run(tmp_path)
    assert main(["status", str(tmp_path), "--goodput", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["goodput"]
    assert (
        report["sum_hours"] == pytest.approx(report["allocated_hours"]) == pytest.approx(42 / 3600)
    )
    assert [row["label"] for row in report["rows"]] == ["process 1"]
    assert main(["status", str(tmp_path), "--goodput"]) == 0
    assert "productive steps" in capsys.readouterr().out
    assert main(["plot", str(tmp_path)]) == 0
    assert f"plot: {tmp_path / 'goodput.png'}" in capsys.readouterr().out
    assert (tmp_path / "goodput.png").stat().st_size > 0
    (tmp_path / "timeline.jsonl").unlink()
    assert main(["status", str(tmp_path), "--goodput"]) == 2  # nothing to account
    assert "nothing to account" in capsys.readouterr().err


def test_lines_cut_by_a_kill_are_left_out(tmp_path: Path) -> None:
    """A rank 0 killed mid-write leaves a cut last line in timeline.jsonl and metrics.jsonl."""
    write_run(tmp_path)
    with open(tmp_path / "timeline.jsonl", "a") as f:
        f.write('{"kind": "checkpoint", "step": 40, "ti')
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 31, "time": 11')
    answer = sacct_line("7", 990, 1000, 1100) + sacct_line("7", 1100, 1111, 1150)
    goodput = run_goodput(tmp_path, query=lambda ids: answer)
    assert goodput.part_hours()["lost"] * 3600 == pytest.approx(4 * 36.0)
    assert sum(goodput.part_hours().values()) == pytest.approx(goodput.allocated_hours)


def test_an_attempt_still_running_or_killed_with_its_job_stands_in_for_its_record() -> None:
    """Attempt 2 has no record yet: while the job runs its trainer counts to now with nothing
    lost; once the job was killed under it (no record: the next attempt writes one), the work
    after its last save (step 20 at 1076, to step 22 at 1080) is lost."""
    # attempt 2: started, saved step 20 (1076), logged step 22 (1080)
    trainers = processes(TIMELINE[:5], [*METRICS[:6], train(22, 1080, 2, 1.0, 0.0)])
    running = Allocation(job_id="7", restart=0, start=1000, end=1100, tasks=2, running=True)
    goodput = account([running], RECORDS[:1], trainers, unit="task-hours", source="test")
    rows = {row.label: row for row in goodput.rows}
    assert rows["attempt 2"].kind == "running" and rows["attempt 2"].parts["lost"] == 0.0
    assert rows["attempt 2"].parts["tail"] == 0.0
    # 1050-1100 (now): no gap for the job script, the probe and launch to 1054, start-up to 1060
    assert rows["attempt 2"].parts["startup"] == pytest.approx(2 * 10.0)
    assert sum(goodput.part_hours().values()) * 3600 == pytest.approx(200.0)
    killed = Allocation(job_id="7", restart=0, start=1000, end=1100, tasks=2)
    rows = {r.label: r for r in account([killed], RECORDS[:1], trainers, unit="h", source="t").rows}
    assert rows["attempt 2"].kind == "unrecorded" and rows["attempt 2"].lost_steps == 2
    assert rows["attempt 2"].parts["lost"] == pytest.approx(2 * (1080 - 1076))
    assert rows["attempt 2"].parts["tail"] == pytest.approx(2 * (1100 - 1080))
