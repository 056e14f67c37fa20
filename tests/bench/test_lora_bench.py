"""`hpctrain bench lora` without its minutes of training: each kind's run config, and the
report's ratios and verdicts against issue 40's goals."""

from __future__ import annotations

from hpctrain.bench.lora import GOALS, format_results, overrides
from hpctrain.config import load_config


def spec(kind: str, device: str = "cpu") -> dict:
    return {
        "kind": kind,
        "folder": "/m",
        "index": "/d/index.json",
        "run_dir": "/r",
        "rank": 8,
        "seq_len": 512,
        "batch_size": 1,
        "steps": 3,
        "warmup": 1,
        "device": device,
    }


def test_each_kind_trains_what_it_names() -> None:
    full = load_config(None, overrides(spec("full")))
    assert full.model.lora.rank == 0 and full.model.init_from == "/m"
    assert full.train.max_steps == 4 and full.train.precision == "fp32"
    lora = load_config(None, overrides(spec("lora", "cuda")))
    assert (lora.model.lora.rank, lora.model.lora.alpha) == (8, 16.0)
    assert lora.model.lora.base_dtype == "bf16" and lora.train.precision == "bf16"
    qlora = load_config(None, overrides(spec("qlora")))
    assert qlora.model.lora.quantize_base == "nf4" and qlora.model.lora.base_dtype == "fp32"


def test_the_report_gives_each_ratio_its_verdict() -> None:
    summary = {
        "full": {
            "peak_bytes": 4e9,
            "step_seconds": 10.0,
            "trainable_fraction": 1.0,
            "checkpoint_bytes": 1e9,
        },
        "lora": {
            "peak_bytes": 1e9,
            "step_seconds": 9.0,
            "trainable_fraction": 0.005,
            "checkpoint_bytes": 2e7,
        },
    }
    result = {
        "preset": "gpt-125m", "num_params": 125e6, "vocab_size": 32000, "rank": 8, "seq_len": 512,
        "batch_size": 1, "device": "cpu", "pairs": 1, "summary": summary, "goals": GOALS,
        "ratios": {"lora": {"memory": 0.25, "step_time": 0.9, "trainable": 0.005, "checkpoint": 0.02}},
    }  # fmt: skip
    text = format_results(result)
    assert "memory 0.25x (goal <= 0.5x: met)" in text
    assert "step_time 0.90x (goal <= 0.8x: missed)" in text
    assert "trainable 0.500% (goal <= 0.01: met)" in text
    assert "checkpoint 0.02x (goal <= 0.05x: met)" in text
