"""GPU utilisation and memory in `metrics.jsonl`, on a CPU.

No GPU (and no NVML driver library) here, so these tests MOCK NVML as torch exposes it:
`torch.cuda.utilization`, `torch.cuda.device_memory_used` and
`torch.cuda.get_device_properties` are replaced by fakes. The reduction over 2 ranks runs for
real in `ema_worker.py`'s process group (see `test_ema.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctrain.errors import install_hint
from hpctrain.observe.gpu_stats import GpuCounters, summarize_rows
from tests.train.test_trainer import build, make_config, train_records

CUDA = torch.device("cuda", 0)
GIB = 2**30


class FakeNVML:
    """Readings a GPU would give; `fail` makes the next readings raise like pynvml does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.util, self.used, self.fail = 40, 3 * GIB, False
        monkeypatch.setattr(torch.cuda, "utilization", self.utilization)
        monkeypatch.setattr(torch.cuda, "device_memory_used", self.device_memory_used)
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device: SimpleNamespace(total_memory=80 * GIB),
        )

    def utilization(self, device: torch.device) -> int:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return self.util

    def device_memory_used(self, device: torch.device) -> int:
        return self.used


def test_counters_read_nvml_and_skip_a_failed_reading(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNVML(monkeypatch)
    counters = GpuCounters(CUDA)
    assert counters.read() == {
        "gpu_util_pct": 40.0,
        "gpu_util_pct_worst": 40.0,
        "gpu_memory_used_mb": 3072.0,
        "gpu_memory_used_mb_worst": 3072.0,
        "gpu_memory_total_mb": 81920.0,
    }
    nvml.fail = True
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert counters.read() == {}
    assert "NVML_ERROR_GPU_IS_LOST" in caplog.text
    nvml.fail = False
    assert counters.read()["gpu_util_pct"] == 40.0


def test_without_nvml_one_line_says_why_and_nothing_is_written(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_pynvml(device: torch.device) -> int:
        # what torch raises when nvidia-ml-py is not installed
        raise ModuleNotFoundError("pynvml module not found, please install nvidia-ml-py")

    monkeypatch.setattr(torch.cuda, "utilization", no_pynvml)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        counters = GpuCounters(CUDA)
        assert counters.read() == {} and counters.read() == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pynvml module not found" in lines[0]
    assert install_hint("gpu") in lines[0]
    assert GpuCounters(torch.device("cpu")).read() == {}  # CPUs: no counters, no line


def test_ranks_reduce_to_mean_and_worst() -> None:
    rows = torch.tensor([[90.0, 1000.0, 80.0], [30.0, 5000.0, 80.0]], dtype=torch.float64)
    assert summarize_rows(rows) == {
        "gpu_util_pct": 60.0,
        "gpu_util_pct_worst": 30.0,  # the least busy GPU
        "gpu_memory_used_mb": 3000.0,
        "gpu_memory_used_mb_worst": 5000.0,  # the fullest GPU
        "gpu_memory_total_mb": 80.0,
    }


def test_train_records_carry_the_counters(
    shapes_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeNVML(monkeypatch)
    trainer = build(make_config(shapes_shards, tmp_path / "run", "data.val=", "train.max_steps=2"))
    trainer.gpu_counters = GpuCounters(CUDA)  # the trainer's own is off on this CPU
    assert trainer.fit() == 0
    records = train_records(tmp_path / "run")
    assert len(records) == 2
    assert all(r["gpu_util_pct"] == 40.0 and r["gpu_memory_total_mb"] == 81920.0 for r in records)
