"""`hpctrain bench checkpoint` runs end to end on a tiny state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_bench_checkpoint_tiny(tmp_path):
    args = ["--params", "2e5", "--rounds", "1", "--dir", str(tmp_path), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "bench", "checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert results["bytes"] == 3 * 200_000 * 4
    methods = results["methods"]
    assert set(methods) == {
        "dd",
        "torch.save+fsync",
        "dcp.save",
        "dcp.async_save",
        "hpctrain sync",
        "hpctrain async",
        "hpctrain sync size",
        "hpctrain load",
        "hpctrain load size",
    }
    assert methods["dd"]["ratio_to_dd"] == 1.0
    assert methods["hpctrain async"]["blocked_ratio_to_sync"] > 0
    assert results["checksums"]["sync_save_throughput_ratio"] > 0
    assert results["checksums"]["load_time_ratio"] > 0
    assert list(tmp_path.iterdir()) == []  # the scratch folder is removed
