"""Fixtures of the SLURM tier: the local dev cluster (tools/dev-cluster); its tiny shards
(`tiny_shards`) are in tests/support/shard_fixtures.py.

Tests marked `slurm` need a running dev cluster. Its slurm.conf comes from
HPCTRAIN_SLURM_CONF, else SLURM_CONF, else `tools/dev-cluster env`. When it is not running the
tests are skipped with one line saying how to start it, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
HOW_TO = "start it with: sudo tools/dev-cluster install && sudo tools/dev-cluster start"


def _dev_cluster_conf() -> str:
    for name in ("HPCTRAIN_SLURM_CONF", "SLURM_CONF"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        out = subprocess.run(
            [str(REPO / "tools" / "dev-cluster"), "env"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.strip().removeprefix("export SLURM_CONF=")


def _cluster_problem(conf: str) -> str:
    """Why the cluster at `conf` cannot run jobs, or "" when it can."""
    if not conf or not Path(conf).is_file():
        return f"no slurm.conf at {conf or '(unset)'}"
    env = {**os.environ, "SLURM_CONF": conf}
    try:
        ping = subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, timeout=15, env=env
        )
        nodes = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15, env=env
        )
    except FileNotFoundError:
        return "SLURM client commands (scontrol, sinfo) are not installed"
    except subprocess.TimeoutExpired:
        return "slurmctld does not answer"
    if "UP" not in ping.stdout:
        return "slurmctld is not running"
    states = set(nodes.stdout.split())
    if len(states & {"idle", "mixed", "allocated"}) == 0:
        return f"no usable node (states: {', '.join(sorted(states)) or 'none'})"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[str]:
    """The dev cluster's slurm.conf, exported as SLURM_CONF for the whole session."""
    conf = _dev_cluster_conf()
    problem = _cluster_problem(conf)
    if problem:
        message = f"SLURM dev cluster not available ({problem}); {HOW_TO}"
        if IN_CI:
            pytest.fail(f"CI=true requires the SLURM tier: {message}", pytrace=False)
        pytest.skip(message)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        yield conf


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids a test submits, cancelled after it whatever happened (an array's by its job)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        subprocess.run(["scancel", job_id.split("_")[0]], capture_output=True, timeout=30)
