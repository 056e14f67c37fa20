"""QoS and partition limits read from sacctmgr/scontrol output; the fallback when none answer."""

from __future__ import annotations

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.launch import cluster_limits
from hpctrain.launch.cluster_limits import (
    PartitionLimits,
    check_live_limits,
    parse_partition,
    parse_qos_table,
)
from hpctrain.launch.profiles import load_profile, resolve_job


def job(*overrides: str):  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), ["slurm.profile=jean-zay-v100", *overrides])
    return resolve_job(cfg, load_profile("jean-zay-v100"))


def test_parse_qos_table() -> None:
    text = "normal|\nqos_gpu-t3|20:00:00\nqos_gpu-t4|4-04:00:00\nqos_gpu-dev|02:00:00\n"
    assert parse_qos_table(text) == {
        "normal": None,
        "qos_gpu-t3": 1200,
        "qos_gpu-t4": 6000,
        "qos_gpu-dev": 120,
    }


def test_parse_partition() -> None:
    line = "PartitionName=gpu_p2 AllowGroups=ALL AllowQos=qos_gpu-t3,qos_gpu-dev MaxTime=20:00:00 State=UP"
    assert parse_partition(line) == PartitionLimits("gpu_p2", 1200, ("qos_gpu-t3", "qos_gpu-dev"))
    assert parse_partition("PartitionName=debug AllowQos=ALL MaxTime=UNLIMITED") == PartitionLimits(
        "debug", None, None
    )
    assert parse_partition("") is None


def test_a_renamed_qos_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cluster_limits, "query_qos_table", lambda: {"qos_gpu-t3-new": 1200, "normal": None}
    )
    checks = check_live_limits(job())
    assert [c.name for c in checks if not c.ok] == ["qos"]
    assert "no such QoS" in checks[0].message and "qos_gpu-t3-new" in checks[0].message


def test_a_lowered_live_limit_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_limits, "query_qos_table", lambda: {"qos_gpu-t3": 60})
    (check,) = check_live_limits(job("slurm.time=02:00:00"))
    assert not check.ok and "MaxWall 01:00:00" in check.message


def test_partition_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_limits, "query_qos_table", lambda: None)
    monkeypatch.setattr(
        cluster_limits,
        "query_partition",
        lambda name: (True, PartitionLimits(name, 60, ("qos_gpu-dev",))),
    )
    (check,) = check_live_limits(job("slurm.partition=gpu_p2", "slurm.time=02:00:00"))
    assert not check.ok and "MaxTime 01:00:00" in check.message
    (check,) = check_live_limits(job("slurm.partition=gpu_p2", "slurm.time=00:30:00"))
    assert not check.ok and "allows only qos_gpu-dev" in check.message
    monkeypatch.setattr(cluster_limits, "query_partition", lambda name: (True, None))
    (check,) = check_live_limits(job("slurm.partition=gpu_p2"))
    assert not check.ok and "no such partition" in check.message


def test_no_answer_falls_back_to_the_profile_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_limits, "query_qos_table", lambda: None)
    monkeypatch.setattr(cluster_limits, "query_partition", lambda name: (False, None))
    (check,) = check_live_limits(job("slurm.partition=gpu_p2"))
    assert check.ok and check.warning and "profile's table only" in check.message
