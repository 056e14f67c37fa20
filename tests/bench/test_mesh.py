"""`hpctrain bench mesh` runs its 4 ranks and reports HSDP (and TP) against flat FSDP2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.distributed
def test_bench_mesh_reports_paired_ratios() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctrain",
            "bench",
            "mesh",
            "--pairs",
            "1",
            "--steps",
            "1",
            "--seq-len",
            "16",
            "--tp",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert {"fsdp_b", "hsdp", "fsdp_tp"} <= result.keys()
    assert all(result[k]["ratio"] > 0 for k in ("fsdp_b", "hsdp", "fsdp_tp"))
