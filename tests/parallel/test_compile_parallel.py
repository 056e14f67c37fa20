"""`train.compile` (inductor on the CPU) under FSDP2, HSDP with activation checkpointing and
FSDP2 x TP, on 2 gloo ranks with per-document attention (the lm_kit documents are packed, so
every sequence has document boundaries): the losses are those of the same run uncompiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.config import config_to_yaml, load_config
from hpctrain.parallel.precision import compile_blocker
from tests.models.test_hf_init_from import lm_overrides
from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import run_hpctrain

CASES = {
    "fsdp": ["train.strategy=fsdp"],
    "hsdp-checkpointing": ["train.strategy=hsdp", "train.activation_checkpointing=true"],
    "fsdp-tp": ["train.strategy=fsdp", "train.tp_degree=2"],
}


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r and "step" in r]


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_parallel_runs_train_like_eager_ones(tmp_path: Path, case: str) -> None:
    import torch

    blocker = compile_blocker(torch.device("cpu"))
    if blocker:
        pytest.fail(f"CPU compile unavailable here: {blocker}")
    write_token_shards(tmp_path / "shards", 1, seed=1)
    config = tmp_path / "lm.yaml"
    base = lm_overrides(tmp_path / "shards", tmp_path / "unused", "train.max_steps=3")
    config.write_text(config_to_yaml(load_config(None, [*base, "train.log_every=1"])))
    runs = {}
    for compiled in ("false", "true"):
        run_dir = tmp_path / f"compile-{compiled}"
        run_hpctrain("train", str(config), "--nproc", "2", "--resume", "none",
                     f"run_dir={run_dir}", *CASES[case], f"train.compile={compiled}",
                     timeout=400)  # fmt: skip
        runs[compiled] = losses(run_dir)
    eager, compiled = runs["false"], runs["true"]
    assert len(eager) == len(compiled) == 3, runs
    # inductor fuses and reorders floating-point sums: close, not bitwise (TP: also the
    # all-reduces of the row-parallel outputs, rel ~1e-3 after 2 updates)
    rel = 5e-3 if "tp" in case else 1e-4
    assert compiled == pytest.approx(eager, rel=rel), runs
