"""`hpctrain status`: sacct parsing, last step, job records, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.launch import status as status_mod
from hpctrain.launch.status import last_step, parse_sacct, read_job_record


def test_parse_sacct_counts_requeues_and_takes_the_last_row() -> None:
    text = "7|REQUEUED|0:0\n7|REQUEUED|0:0\n7|COMPLETED|0:0\n"
    assert parse_sacct(text) == ("COMPLETED", "0:0", 2)
    assert parse_sacct("8|CANCELLED by 0|0:15\n") == ("CANCELLED", "0:15", 0)
    assert parse_sacct("") == ("UNKNOWN", "", 0)


def test_last_step_skips_a_line_cut_by_a_kill(tmp_path: Path) -> None:
    assert last_step(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 5}\n{"kind": "eval", "step": 5}\n{"kind": "train", "step": 6}\n{"kind": "tr'
    )
    assert last_step(tmp_path) == 6


def test_job_record_from_submit_or_from_the_sbatch_script(tmp_path: Path) -> None:
    slurm = tmp_path / "slurm"
    slurm.mkdir()
    assert read_job_record(tmp_path) == {}
    (slurm / "job_id").write_text("12\n")
    assert read_job_record(tmp_path) == {"job_id": "12", "stdout": str(slurm / "12.out")}
    (slurm / "job.json").write_text(json.dumps({"job_id": "12", "stderr": "/x/12_0_log.err"}))
    assert read_job_record(tmp_path)["stderr"] == "/x/12_0_log.err"


@pytest.mark.parametrize(
    ("state", "code"), [("COMPLETED", 0), ("RUNNING", 0), ("CANCELLED", 1), ("TIMEOUT", 1)]
)
def test_status_exit_code_says_failed(
    state: str,
    code: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("3\n")
    (tmp_path / "slurm" / "3.out").write_text("line 1\nline 2\n")
    monkeypatch.setattr(status_mod, "query_state", lambda job_id: (state, "0:0", 1))
    assert main(["status", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert f"state:     {state}" in out and "requeues:  1" in out and "| line 2" in out
    assert ("(failed)" in out) == (code == 1)


def test_status_without_a_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path)]) == 6  # a launch error
    err = capsys.readouterr().err
    assert "no SLURM job recorded" in err
    # a local run: where its progress is, and the verb that reads its hours (#49)
    assert f"{tmp_path}/metrics.jsonl" in err and f"hpctrain status {tmp_path} --goodput" in err


def test_every_job_of_the_folder_with_the_last_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.launch.status import JobRow, parse_sacct_rows

    text = (
        "40|REQUEUED|0:0|2026-11-30T10:00:00|2026-11-30T10:05:00\n"
        "40|FAILED|3:0|2026-11-30T10:06:00|2026-11-30T10:07:00\n"
        "41_0|COMPLETED|0:0|2026-11-30T11:00:00|2026-11-30T11:01:00\n"
    )
    rows = parse_sacct_rows(text)
    assert rows[1] == JobRow("40", "FAILED", "3:0", "2026-11-30T10:06:00", "2026-11-30T10:07:00")
    slurm = tmp_path / "slurm"
    slurm.mkdir()
    (slurm / "jobs").write_text("40\n40\n")
    (slurm / "job_id").write_text("40\n")
    (slurm / "40.out").write_text(
        "hpctrain: job 40 (restart 1) on n1\n"
        "hpctrain train [rank 1]: data error: /d/train-000003.tar: truncated member\n"
        "srun: error: n1: task 1: Exited with exit code 3\n"
        "done\n"
    )
    seen: list[list[str]] = []

    def fake_jobs(ids: list[str]) -> list[JobRow]:
        seen.append(ids)
        return rows[:2]

    monkeypatch.setattr(status_mod, "query_jobs", fake_jobs)
    monkeypatch.setattr(status_mod, "query_state", lambda job_id: ("FAILED", "3:0", 1))
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert seen == [["40"]]
    assert "  40             REQUEUED     exit 0:0" in out and "FAILED       exit 3:0" in out
    assert (
        "error:     hpctrain train [rank 1]: data error: /d/train-000003.tar: truncated member"
        in out
    )


def test_last_error_line_prefers_the_newest_log(tmp_path: Path) -> None:
    import os

    from hpctrain.launch.status import last_error_line

    old, new = tmp_path / "1_0_log.err", tmp_path / "2_0_log.err"
    old.write_text("RuntimeError: old\n")
    new.write_text('Traceback (most recent call last):\n  File "x"\nValueError: bad value\n')
    os.utime(old, (1, 1))
    assert last_error_line([old, new, tmp_path / "missing"]) == ("ValueError: bad value", str(new))
    new.write_text("all fine\n")
    assert last_error_line([new]) == ("", "")


def test_status_lists_the_attempts_and_says_why_the_run_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.resilience.records import append_record
    from hpctrain.resilience.restart_policy import AttemptRecord

    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("3\n")
    monkeypatch.setattr(status_mod, "query_state", lambda job_id: ("FAILED", "9:0", 0))
    monkeypatch.setattr(status_mod, "query_jobs", lambda ids: [])
    common = {"job_id": "3", "restart": 0, "start": 0.0, "end": 1.0, "nodes": ["n1", "n2"],
              "excluded": [], "num_tasks": 4}  # fmt: skip
    append_record(tmp_path, AttemptRecord(attempt=1, kind="signal", decision="restart",
        reason="rank 1 on n1 killed by SIGKILL at step 1; restarting in this allocation (1/3, slurm.max_restarts)",
        **common))  # fmt: skip
    stopped = ("stopped: no progress (2 attempts in a row committed no checkpoint, "
               "slurm.max_no_progress=2); last failure: rank 1 on n1 killed by SIGKILL at step 1")  # fmt: skip
    append_record(tmp_path, AttemptRecord(attempt=2, kind="signal", decision="stop",
                                          reason=stopped, exit_code=137, **common))  # fmt: skip
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "attempts:  (restarts and requeues: RUN_DIR/slurm/attempts.jsonl)" in out
    assert (
        "    1  job 3          n1,n2          signal      restart  rank 1 on n1 killed by SIGKILL"
        in out
    )
    assert f"\n{stopped}\n" in out
    assert main(["status", str(tmp_path), "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["stopped"] == stopped and [a["attempt"] for a in record["attempts"]] == [1, 2]
