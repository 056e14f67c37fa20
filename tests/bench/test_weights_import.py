"""`hpctrain bench import` machinery at a toy size (the 1B-shaped figures are in BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.bench import weights_import
from hpctrain.models import hf
from hpctrain.models.gpt import gpt_config

pytest.importorskip("safetensors")


@pytest.mark.distributed
def test_import_bench_loads_both_ways_and_reports(tmp_path: Path) -> None:
    cfg = gpt_config("gpt-tiny", 301, n_layers=1)
    result = weights_import.compare(tmp_path, cfg, dtype="bf16", ranks=2)
    index = json.loads((tmp_path / "model" / hf.INDEX).read_text())
    assert set(index["weight_map"]) == set(hf.hf_names(cfg).values())
    assert result["file_bytes"] * 2 == result["model_bytes"]  # bf16 files, an fp32 model
    assert len(result["fsdp"]) == 2
    for figures in (result["single"], *result["fsdp"]):
        assert figures["seconds"] > 0 and figures["cpu_seconds"] > 0 and figures["peak_bytes"] >= 0
        assert set(figures["phases"]) == {"build", "load"}
    lines = weights_import.format_results({**result, "preset": "gpt-tiny"}).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("import of a gpt-tiny-shaped Hugging Face folder (1 layers")
    assert lines[3].startswith("peak per rank / model = ")
    assert "(goal <= 0.6x: " in lines[3] and "(goal <= 1.5x: " in lines[3]
