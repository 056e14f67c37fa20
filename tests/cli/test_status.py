"""`hpctrain status --json`: one JSON object also when the folder has no job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli.main import main


def test_status_json_without_a_job_is_json_with_the_same_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#32 item 16: `status --json` of a local run printed a plain line, not JSON."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 3}\n')
    assert main(["status", str(tmp_path), "--json"]) == 6
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["job_id"] == "" and record["last_step"] == 3 and record["exit_code"] == 6
    assert "no SLURM job recorded" in record["error"] and "no SLURM job" in captured.err
    assert main(["status", str(tmp_path / "nope"), "--json"]) == 2
    record = json.loads(capsys.readouterr().out)
    assert record == {
        "run_dir": str(tmp_path / "nope"),
        "error": f"{tmp_path / 'nope'}: not a run folder",
        "exit_code": 2,
    }
