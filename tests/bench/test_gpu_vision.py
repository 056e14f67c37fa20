"""`tools/gpu_bench.sh`'s vision case (`bench/gpu_vision.py`) without a GPU: the plan, the peak table, FLOPs, the report, a dry run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hpctrain.bench import gpu_report, gpu_vision
from hpctrain.config import load_config, with_overrides
from tests.support.train_kit import REPO


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla V100-SXM2-32GB", 125.0),
        ("NVIDIA A10", 125.0),
        ("Some Future GPU", None),
    ],
)
def test_peak_table(name: str, peak: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCTRAIN_PEAK_TFLOPS", raising=False)
    assert gpu_report.peak_tflops(name) == peak


def test_plan_uses_the_node_cpus_and_the_gpu_generation() -> None:
    h200 = gpu_vision.make_plan(1, "NVIDIA H200", 9, 139, cpus=16)
    assert (h200.precision, h200.batch_size, h200.workers_per_rank) == ("bf16", 256, 15)
    jean_zay_v100 = gpu_vision.make_plan(4, "Tesla V100-SXM2-32GB", 7, 32, cpus=40)
    assert jean_zay_v100.precision == "fp16"  # V100 has no bf16
    assert (jean_zay_v100.batch_size, jean_zay_v100.workers_per_rank) == (128, 9)
    assert gpu_vision.make_plan(8, "x", 8, 16, cpus=4, workers_per_rank=3).workers_per_rank == 3
    # 4 H100 x 23 workers: 368 workers, 40,000 images -> 108 per shard, 371 shards
    assert gpu_vision.samples_per_shard(40_000, 4 * 23) == 108
    assert gpu_vision.samples_per_shard(20_000, 15) == 256
    assert gpu_vision.samples_per_shard(30, 1) == 16


def test_resnet50_training_flops_and_report(tmp_path: Path) -> None:
    flops = gpu_vision.train_flops_per_image("resnet50", 224)
    assert 23e9 < flops < 26e9  # 3 x 4.1 GMAC x 2
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {
            "kind": "train",
            "step": s,
            "samples_per_s": 2500.0 + s,
            "step_time_s": 0.1,
            "data_wait_fraction": 0.01,
            "data_wait_fraction_worst": 0.02,
            "peak_memory_mb": 30000.0,
        }
        for s in range(10, 60, 10)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    plan = gpu_vision.make_plan(1, "NVIDIA H200", 9, 139, cpus=16)
    result = gpu_vision.report(run, plan, flops)
    assert result["steps_measured"] == 30 and result["images_per_s"] == 2540.0
    assert result["mfu"] == pytest.approx(2540.0 * flops / 989e12)
    text = gpu_vision.format_report(result)
    assert "images/s" in text and "data wait" in text and "MFU" in text and "GiB" in text


def header_example(flag: str) -> list[str]:
    """The usage line of tools/gpu_bench.sh's header comment that holds `flag`, as words."""
    header = (REPO / "tools" / "gpu_bench.sh").read_text().split("set -euo pipefail", 1)[0]
    lines = [line[1:].split("#", 1)[0].split() for line in header.splitlines()]
    found = [words for words in lines if words[:1] == ["tools/gpu_bench.sh"] and flag in words]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without GPUs")
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_the_headers_dry_run_generates_shards_and_builds_every_trainer(tmp_path: Path) -> None:
    """The header's own `tools/gpu_bench.sh --dry-run --images 200`, as written (issue #49: it
    failed, the planned batch of 256 larger than the 200 images), builds each run's Trainer on
    the CPU as it will start on the GPU (issue #44: a config that loads but cannot start must
    not read "config valid")."""
    words = header_example("--dry-run")
    assert words == ["tools/gpu_bench.sh", "--dry-run", "--images", "200"]
    command = [str(REPO / words[0]), *words[1:]]
    env = {**os.environ, "GPU_BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resnet50: --images 200 gives each of 1 GPU(s) 200 images: batch 256 -> 200" in (
        proc.stdout
    )
    summary = proc.stdout.split("== summary\n", 1)[1]
    assert summary.endswith("dry run: config valid; not training\n"), summary
    for check in ("signals", "flex", "deterministic"):
        assert f"check {check:13s} dry run: config valid: " in summary, summary
    for cell in gpu_vision.SMOKE_CELLS:
        assert f"smoke {cell.name:22s} config valid: " in summary, summary
    assert "resnet50 config valid: none (single process), bf16, 23.5 M parameters, 200 steps" in (
        summary
    )
    assert "lm gpt-1b config valid: none (single process), bf16, 1040.3 M parameters" in summary
    assert "lora: GPU only (hpctrain bench lora --device cuda); not in a dry run" in summary
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert sum(s["num_samples"] for s in index["shards"]) == 200
    cfg = load_config(str(tmp_path / "config.yaml"))
    assert (cfg.model.name, cfg.model.channels_last, cfg.train.strategy) == (
        "resnet50",
        True,
        "ddp",
    )
    assert cfg.train.max_steps == 200 and cfg.data.workers_per_rank >= 1
    assert cfg.data.batch_size == 200
    assert not cfg.checkpoint.final and cfg.checkpoint.every_steps == 0  # nothing saved (#38)
    # A batch the shards cannot fill is a failure of the dry run, not "config valid".
    too_big = with_overrides(cfg, ["data.batch_size=256"])
    assert gpu_vision.dry_check(too_big, 0).startswith("FAILED: data.batch_size=256: ")


def test_a_plan_s_batch_shrinks_to_what_the_images_fill_and_says_so() -> None:
    plan = gpu_vision.make_plan(4, "NVIDIA H100", 9, 80, cpus=32)
    assert gpu_vision.batch_for_images(plan, 4 * 256) == (plan, "")
    smaller, note = gpu_vision.batch_for_images(plan, 200)
    assert smaller.batch_size == 50
    assert note == (
        "resnet50: --images 200 gives each of 4 GPU(s) 50 images: batch 256 -> 50 per GPU "
        "(--images 1024 or more keeps the planned batch)"
    )


def test_smoke_cells_are_the_matrix_gpu_cells_and_outcomes(tmp_path: Path) -> None:
    cells = {(c.strategy, c.precision, c.model) for c in gpu_vision.SMOKE_CELLS}
    assert cells == {
        (s, p, m)
        for s in ("ddp", "fsdp")
        for p in ("bf16", "fp16")
        for m in ("resnet50", "vit_b_16")
    }
    run = tmp_path / "run"
    run.mkdir()
    refusal = (
        "train.precision=bf16: Tesla V100 (compute capability 7.0) has no bf16; use fp16 or fp32"
    )
    assert (
        gpu_vision.smoke_outcome(2, f"hpctrain train: config error: {refusal}", run, refusal)
        == "refused"
    )
    assert gpu_vision.smoke_outcome(0, "", run, refusal).startswith("FAILED")
    assert gpu_vision.smoke_outcome(0, "", run, "") == "FAILED: no loss logged"
    (run / "metrics.jsonl").write_text(
        '{"kind": "train", "loss": 6.9}\n{"kind": "train", "loss": NaN}\n'
    )
    assert gpu_vision.smoke_outcome(0, "", run, "").startswith("FAILED: losses")
    (run / "metrics.jsonl").write_text('{"kind": "train", "loss": 6.9}\n')
    assert gpu_vision.smoke_outcome(0, "", run, "") == "trained"
    assert gpu_vision.smoke_outcome(1, "", run, "") == "FAILED: exit 1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bench_runs_on_this_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *(str(REPO / "tools" / "gpu_bench.sh"), "--steps", "40", "--images", "4000"),
            *("--work", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.split("== summary\n", 1)[1]
    for check in ("signals", "flex", "deterministic"):
        assert f"check {check:13s} ok" in summary, summary
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["images_per_s"] > 0 and 0 <= report["data_wait_fraction"] <= 1
    lm = json.loads((tmp_path / "lm" / "report.json").read_text())
    assert lm["plan"]["preset"] == "gpt-1b" and lm["mfu"] is not None
    # no benchmark writes a checkpoint (the signals check saves one: USR2 asks for it)
    assert [p for p in tmp_path.rglob("step-*") if "checks" not in p.parts] == []
