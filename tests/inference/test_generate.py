"""`hpctrain generate`'s precision: the run's on GPUs, fp32 on CPUs. No GPU here: the device's
facts are given (`DeviceFacts`), nothing runs on it."""

from __future__ import annotations

import torch

from hpctrain.inference.generate import generation_precision
from hpctrain.parallel.precision import DeviceFacts

GPU = torch.device("cuda", 0)
H100 = DeviceFacts(type="cuda", name="H100", capability=(9, 0))
V100 = DeviceFacts(type="cuda", name="V100", capability=(7, 0))


def run(precision: str) -> dict:
    return {"train": {"precision": precision}}


def test_a_gpu_decodes_in_the_runs_precision_and_a_cpu_in_fp32() -> None:
    on_gpu = generation_precision(run("bf16"), GPU, H100)
    assert on_gpu.name == "bf16" and on_gpu.device_type == "cuda" and not on_gpu.sharded
    assert generation_precision(run("auto"), GPU, H100).name == "bf16"  # as plan_training
    assert generation_precision(run("fp16"), GPU, V100).name == "fp16"
    assert generation_precision(run("auto"), GPU, V100).name == "fp32"  # no bf16 on a V100
    assert generation_precision(run("bf16"), torch.device("cpu")).name == "fp32"
    assert generation_precision({}, GPU, H100).name == "fp32"
