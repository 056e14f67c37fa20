"""The failure rate behind `checkpoint.every_minutes: auto`: the profile's prior and the
run's own attempts (RUN_DIR/slurm/attempts.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.checkpoint.interval import DEFAULT_FAILURE_RATE
from hpctrain.config import load_config
from hpctrain.launch.profiles import LaunchError, load_profile, run_failure_rate
from hpctrain.resilience.failure_rate import observed
from hpctrain.resilience.restart_policy import AttemptRecord


def attempt(number: int, kind: str, hours: float, nodes: list[str]) -> AttemptRecord:
    return AttemptRecord(
        attempt=number, job_id="7", restart=0, start=0.0, end=hours * 3600, nodes=nodes,
        excluded=[], num_tasks=2 * len(nodes), kind=kind, decision="restart", reason="",
    )  # fmt: skip


def test_failures_not_announced_count_over_the_node_hours_attempts_ran() -> None:
    records = [
        attempt(1, "signal", 1.0, ["n1", "n2"]),  # 2 node-hours, a failure
        attempt(2, "preempted", 0.5, ["n1", "n2"]),  # 1 node-hour, announced: no failure
        attempt(3, "distributed", 0.25, ["n1", "n2"]),  # 0.5, a failure
        attempt(4, "user", 0.1, ["n1"]),  # 0.1, the user's: no failure
        attempt(5, "probe", 0.0, []),  # did not train: no failure, no exposure
    ]
    assert observed(records) == (2, pytest.approx(3.6))


def test_auto_reads_the_profile_prior_and_the_runs_attempts(tmp_path: Path) -> None:
    (tmp_path / "slurm").mkdir()
    with open(tmp_path / "slurm" / "attempts.jsonl", "w") as f:
        for record in (
            attempt(1, "signal", 1.0, ["n1", "n2"]),
            attempt(2, "completed", 2.0, ["n1"]),
        ):
            f.write(json.dumps(record.to_json()) + "\n")
    cfg = load_config(None, [f"run_dir={tmp_path}", "checkpoint.every_minutes=auto",
                             "slurm.profile=jean-zay-a100"])  # fmt: skip
    rate = run_failure_rate(cfg)
    assert (rate.prior_node_hours, rate.failures, rate.node_hours) == (6300.0, 1, 4.0)
    assert rate.node_mtbf_hours == (6300.0 + 4.0) / 2
    assert rate.source == "profile jean-zay-a100"
    # not auto: no profile read
    assert run_failure_rate(load_config(None, ["slurm.profile=nope"])) is DEFAULT_FAILURE_RATE


def test_a_profile_mtbf_that_is_not_a_positive_number_is_refused(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "configs/clusters/generic.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("mtbf_node_hours: 12600", "mtbf_node_hours: soon"))
    with pytest.raises(LaunchError, match=r"bad.yaml: mtbf_node_hours='soon' is not a positive"):
        load_profile(str(bad))
