"""`hpctrain bench loader` runs end to end (tiny sizes; the figures are in BENCHMARKS.md)."""

from __future__ import annotations

import json

from hpctrain.cli.main import main


def test_bench_loader_runs_all_cases(capsys):
    args = ["bench", "loader", "--images", "24", "--rounds", "1", "--workers", "1"]
    assert (
        main(
            [*args, "--batch-size", "8", "--crop", "32", "--remote", "--latency-ms", "1", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["cases"]) == 9
    assert all(v["images_per_cpu_s"] > 0 for v in out["cases"].values())
    assert "hpctrain / webdataset (images per CPU-s)" in out["ratios"]
