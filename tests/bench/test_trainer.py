"""`hpctrain bench trainer` machinery, on the tiny MLP only (the real run is in BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.bench import trainer


def test_trainer_bench_pairs_and_report(tmp_path: Path) -> None:
    result = trainer.compare("mlp", pairs=3, steps=5, work=tmp_path)
    assert result["pairs"] == 3
    for clock in ("cpu", "wall"):
        r = result[clock]
        assert r["reference_step_ms"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["aa_min"] <= r["aa_ratio"] <= r["aa_max"]
    text = trainer.format_results({"compare": [result]})
    lines = text.splitlines()
    assert len(lines) == 4  # per clock: the ratios, then the step times
    assert lines[0].startswith("mlp cpu time: Trainer / reference loop = ")
    assert "reference B / reference A" in lines[0]
    assert lines[1].startswith("mlp cpu time per step: reference loop ")
    assert " ms, Trainer " in lines[1] and "Trainer - reference loop = " in lines[1]
