"""Preflight: every problem found in one pass, one line each, nothing queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.launch.preflight import failed, format_checks, preflight
from hpctrain.launch.profiles import load_profile

REPO = Path(__file__).resolve().parents[2]


def checks_for(*overrides: str, profile: str = "local-dev"):  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), [f"slurm.profile={profile}", *overrides])
    return preflight(cfg, load_profile(profile))


def by_name(checks):  # type: ignore[no-untyped-def]
    return {c.name: c for c in checks}


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_good_config_passes(tiny_shards: Path, tmp_path: Path) -> None:
    checks = checks_for(
        f"run_dir={tmp_path / 'run'}",
        f"data.train={tiny_shards / 'train' / 'index.json'}",
        f"data.val={tiny_shards / 'val'}",
    )
    assert failed(checks) == [], format_checks(checks)
    assert "sample shards open" in by_name(checks)["data.train"].message


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    checks = by_name(
        checks_for(
            f"run_dir={blocker / 'run'}",
            f"data.train={tmp_path / 'missing' / 'index.json'}",
            "task=no_such_module:Task",
            "slurm.time=500",
            "slurm.qos=qos_gpu-dev",
            profile="jean-zay-v100",
        )
    )
    assert not checks["profile"].ok and "slurm.time" in checks["profile"].message
    assert not checks["run_dir"].ok and "not writable" in checks["run_dir"].message
    assert not checks["data.train"].ok
    assert not checks["task"].ok and "no_such_module" in checks["task"].message
    for check in checks.values():
        assert "\n" not in check.message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_credentials_and_internet_urls(tmp_path: Path) -> None:
    checks = by_name(
        checks_for(
            f"run_dir={tmp_path}",
            "data.train=https://user:s3cret@example.org/index.json",
            "checkpoint.dir=s3://bucket/ckpt?X-Amz-Signature=s3cret",
        )
    )
    assert not checks["credentials"].ok and "s3cret" not in checks["credentials"].message
    assert checks["data.train offline"].warning
    assert "s3cret" not in format_checks(list(checks.values()))


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_empty_account_on_jean_zay_is_a_warning(tmp_path: Path) -> None:
    checks = by_name(checks_for(f"run_dir={tmp_path}", "data.train=x", profile="jean-zay-h100"))
    assert checks["profile"].ok and checks["profile"].warning
    assert "<project>@h100" in checks["profile"].message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_preflight_verb_exit_status(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["preflight", str(REPO / "configs" / "demo.yaml"), f"run_dir={tmp_path}",
                 f"data.train={tmp_path / 'nope'}", "--profile", "local-dev"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 6 and "FAIL data.train" in out and "ok   run_dir" in out
