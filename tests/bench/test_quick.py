"""`make bench-quick`'s report: the verdict rule and the lines built from the benches' JSON."""

from __future__ import annotations

from hpctrain.bench.quick import checkpoint_lines, report_line, trainer_lines, verdict


def test_verdict_by_the_median_unless_the_control_or_the_range_says_noisy() -> None:
    assert verdict(1.01, 1.02, higher_is_better=False, aa=1.00) == "met"
    assert verdict(1.08, 1.02, higher_is_better=False, aa=0.98) == "missed"
    assert verdict(1.01, 1.02, higher_is_better=False, aa=1.05) == "noisy"  # A/A off by 5 %
    assert verdict(0.90, 0.85, higher_is_better=True, low=0.88, high=0.95) == "met"
    assert verdict(0.80, 0.85, higher_is_better=True, low=0.70, high=0.84) == "missed"
    # the range straddles the goal: wide, noisy; narrow, the median decides
    assert verdict(0.90, 0.85, higher_is_better=True, low=0.60, high=1.30) == "noisy"
    assert verdict(0.86, 0.85, higher_is_better=True, low=0.84, high=0.88) == "met"


def test_lines_name_the_goal_the_ratio_and_the_verdict() -> None:
    assert report_line("goal", "ratio", "met") == "goal | ratio | met"
    cpu = {
        "ratio": 1.08,
        "ratio_min": 1.01,
        "ratio_max": 1.14,
        "aa_ratio": 1.01,
        "overhead_ms": 0.05,
    }
    results = {
        "compare": [
            {"model": "mlp", "cpu": {**cpu, "aa_ratio": 0.99}},
            {"model": "resnet18", "cpu": cpu},
        ]
    }
    assert trainer_lines(results) == [
        "trainer: fixed overhead per step <= 0.1 ms (MLP, CPU) | 0.050 ms / 0.1 ms = 0.50, "
        "A/A 0.990 | met",
        "trainer: resnet18 step <= 1.02x a hand-written loop (CPU) | 1.080 (1.010-1.140), "
        "A/A 1.010 | missed",
    ]
    state = {
        "bytes": 240e6,
        "methods": {
            "dd": {"seconds_range": [0.50, 0.60]},
            "hpctrain sync": {"ratio_to_dd": 1.1, "ratio_to_dd_range": [0.9, 1.2]},
            "hpctrain async": {"blocked_ratio_to_sync": 0.3, "blocked_ratio_range": [0.1, 0.6]},
        },
        "checksums": {
            "sync_save_throughput_ratio": 0.95,
            "sync_save_throughput_ratio_range": [0.93, 0.97],
        },
    }
    assert [line.rsplit(" | ", 1)[1] for line in checkpoint_lines(state)] == [
        "met",
        "noisy",
        "met",
    ]
    state["methods"]["dd"]["seconds_range"] = [0.5, 1.5]  # the disk itself 3x slower once
    assert [line.rsplit(" | ", 1)[1] for line in checkpoint_lines(state)] == ["noisy"] * 3
