"""What each (device, strategy, precision, ...) combination means: `plan_training`, a pure
function, and the parts it drives (autocast, the fp16 scaler, SyncBatchNorm, vit_tiny).
The same combinations trained for real are in test_matrix.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hpctrain.config import ConfigError, load_config
from hpctrain.distributed.startup import CUBLAS_WORKSPACE
from hpctrain.models import build_classifier
from hpctrain.parallel import precision as precision_module
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.precision import (
    DeviceFacts,
    Precision,
    TrainingPlan,
    compile_blocker,
    configure_backends,
    device_facts,
    make_grad_scaler,
    plan_training,
)
from hpctrain.toolchain import Toolchain

CPU = DeviceFacts(type="cpu")
V100 = DeviceFacts(type="cuda", name="Tesla V100-SXM2-32GB", capability=(7, 0))
A100 = DeviceFacts(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), min_capability=75)


def plan(device: DeviceFacts, world_size: int = 2, *overrides: str) -> TrainingPlan:
    return plan_training(load_config(None, list(overrides)).train, device, world_size)


def test_cpu_plans() -> None:
    assert plan(CPU, 2, "train.precision=auto").precision.name == "fp32"
    fsdp_bf16 = plan(CPU, 2, "train.strategy=fsdp", "train.precision=bf16")
    assert fsdp_bf16.strategy == "fsdp" and fsdp_bf16.precision.sharded
    assert fsdp_bf16.precision.dtype == torch.bfloat16
    # fp16 trains on a CPU under every strategy (autocast or FSDP2, with a scaler)
    assert plan(CPU, 2, "train.strategy=fsdp", "train.precision=fp16").precision.uses_scaler
    one = plan(CPU, 1, "train.strategy=fsdp", "train.sync_batchnorm=true")
    assert (one.strategy, one.precision.sharded, one.sync_batchnorm) == ("none", False, False)


@pytest.mark.parametrize(
    ("device", "world_size", "overrides", "message"),
    [
        (CPU, 2, ["train.strategy=none"], r"^train\.strategy=none with 2 ranks: each rank"),
        (
            CPU,
            2,
            ["train.sync_batchnorm=true"],
            r"^train\.sync_batchnorm=true with train\.strategy=ddp on cpu: torch's SyncBatchNorm",
        ),
        (
            V100,
            1,
            ["train.precision=bf16"],
            r"^train\.precision=bf16: Tesla V100.*7\.0\) has no bf16",
        ),
        (
            DeviceFacts(type="cpu", compile_blocker="inductor needs a C++ compiler on CPUs"),
            1,
            ["train.compile=true"],
            r"^train\.compile=true on cpu: inductor needs a C\+\+ compiler on CPUs; set train\.compile=false$",
        ),
        (
            DeviceFacts(type="cuda", name="Tesla V100", capability=(7, 0), min_capability=75),
            4,
            ["train.precision=fp16"],
            r"^device Tesla V100 \(compute capability 7\.0\): this torch .* has kernels from 7\.5 up",
        ),
    ],
)
def test_impossible_combinations_are_refused_in_one_line(
    device: DeviceFacts, world_size: int, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        plan(device, world_size, *overrides)
    assert "\n" not in str(error.value)


def test_gpu_plans() -> None:
    assert plan(A100, 8, "train.precision=auto").precision.name == "bf16"
    assert plan(V100, 4, "train.strategy=fsdp", "train.precision=fp16").precision.sharded
    synced = plan(A100, 8, "train.strategy=fsdp", "train.sync_batchnorm=true")
    assert synced.sync_batchnorm
    assert plan(A100, 1, "train.sync_batchnorm=true").sync_batchnorm is False


T4 = DeviceFacts(type="cuda", name="Tesla T4", capability=(7, 5), min_capability=75)


@pytest.mark.parametrize("gpu", [V100, T4], ids=["V100", "T4"])
def test_auto_precision_is_fp16_with_a_scaler_on_gpus_without_bf16_or_tf32(
    gpu: DeviceFacts,
) -> None:
    """fp32 there runs on CUDA cores, 4-8x slower than fp16's tensor cores (was fp32)."""
    auto = plan(gpu, 4, "train.precision=auto")
    assert auto.precision.name == "fp16" and auto.precision.uses_scaler
    assert auto.why_precision.startswith(
        f"train.precision=auto: fp16 (autocast and a gradient scaler) on {gpu.name} "
        f"(compute capability {gpu.capability[0]}.{gpu.capability[1]}): it has neither bf16 "
        "nor TF32"
    )
    assert auto.why_precision.endswith("set train.precision=fp32 to keep full precision")
    assert plan(gpu, 4, "train.precision=fp32").precision.name == "fp32"  # asked: kept
    sharded = plan(gpu, 4, "train.strategy=fsdp", "train.precision=auto").precision
    assert sharded.name == "fp16" and sharded.sharded  # FSDP2 + ShardedGradScaler
    assert plan(A100, 4, "train.precision=auto").why_precision.endswith(
        "bf16 on " + A100.name + " (compute capability 8.0)"
    )
    assert plan(CPU, 2, "train.precision=auto").why_precision == ""


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Puts torch's global kernel settings (and the cuBLAS variable) back after a test."""
    monkeypatch.delenv(CUBLAS_WORKSPACE, raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.benchmark = saved[2]
    torch.set_float32_matmul_precision(saved[3])


def test_deterministic_on_cuda_warns_where_torch_has_no_deterministic_kernel(
    backends: None,
) -> None:
    """Faked device facts (no GPU here): the settings are torch's global flags, set as on a
    GPU. A ResNet's or the UNet's first backward on CUDA raised before (no deterministic
    kernel for adaptive pooling or upsampling), and cuBLAS had no fixed workspace."""
    note = configure_backends(A100, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.benchmark is False
    assert os.environ[CUBLAS_WORKSPACE] == ":4096:8"
    assert note.startswith(f"train.deterministic=true on {A100.name}: deterministic kernels")
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in note and "torch warning" in note


def test_deterministic_on_cpu_stays_strict_and_cuda_runs_get_fast_kernels(
    backends: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert configure_backends(CPU, deterministic=True) == ""
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":16:8")  # a user's own setting is kept
    configure_backends(V100, deterministic=True)
    assert os.environ[CUBLAS_WORKSPACE] == ":16:8"
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    assert configure_backends(A100, deterministic=False) == ""
    assert torch.backends.cudnn.benchmark is True  # fixed shapes: cuDNN's autotuner
    assert torch.get_float32_matmul_precision() == "high"  # TF32 for fp32 matmuls
    assert not torch.are_deterministic_algorithms_enabled()


def test_device_facts_and_compile_blocker(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = device_facts(torch.device("cpu"))
    assert (facts.type, facts.compile_blocker, facts.bf16_ok) == ("cpu", "", True)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(precision_module.shutil, "which", lambda name: None)
    assert "C++ compiler" in compile_blocker(torch.device("cpu"))


FULL_TOOLCHAIN = Toolchain(
    c_compiler="/usr/bin/gcc",
    python_h="/usr/include/python3.11/Python.h",
    libcuda="/usr/lib/x86_64-linux-gnu",
    python_include="/usr/include/python3.11",
)


def test_compile_is_refused_where_triton_cannot_build_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fakes: this machine has no GPU (the capability) and no driver (the toolchain)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(precision_module, "find_toolchain", lambda: FULL_TOOLCHAIN)
    gpu = torch.device("cuda", 0)
    assert compile_blocker(gpu) == ""
    no_gcc = dataclasses.replace(FULL_TOOLCHAIN, c_compiler="")
    monkeypatch.setattr(precision_module, "find_toolchain", lambda: no_gcc)
    blocker = compile_blocker(gpu)
    assert blocker.startswith("triton cannot build its kernels here: no C compiler (neither gcc")
    h100 = DeviceFacts(type="cuda", name="NVIDIA H100", capability=(9, 0), compile_blocker=blocker)
    with pytest.raises(ConfigError, match=r"^train\.compile=true on NVIDIA H100: triton cannot"):
        plan(h100, 1, "train.compile=true")
    # inductor on CPUs compiles C++ against Python.h
    no_headers = dataclasses.replace(FULL_TOOLCHAIN, python_h="")
    monkeypatch.setattr(precision_module, "find_toolchain", lambda: no_headers)
    assert compile_blocker(torch.device("cpu")).startswith(
        "inductor cannot build its kernels here: no Python.h in /usr/include/python3.11"
    )


def test_autocast_only_where_fsdp2_does_not_cast() -> None:
    bf16 = Precision("bf16", "cpu", sharded=False)
    with bf16.autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16
    with Precision("bf16", "cpu", sharded=True).autocast():  # FSDP2 casts params itself
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32
    assert make_grad_scaler(Precision("fp32", "cpu", sharded=False)) is None
    assert isinstance(
        make_grad_scaler(Precision("fp16", "cpu", sharded=False)), torch.amp.GradScaler
    )


def test_sync_batchnorm_conversion_without_a_process_group() -> None:
    """The conversion itself (training with it needs GPUs; without a group it is plain BN)."""
    cfg = load_config(None, []).train
    synced = TrainingPlan("none", Precision("fp32", "cpu", sharded=False), sync_batchnorm=True)
    model = parallelize(build_classifier("small_cnn", 3), cfg, synced, torch.device("cpu"))
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, nn.SyncBatchNorm) for m in norms)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)


def test_vit_tiny_sizes() -> None:
    small = build_classifier("vit_tiny", 10, image_size=16)
    assert small(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    with torch.device("meta"):
        big = build_classifier("vit_tiny", 1000, image_size=224)
    assert sum(p.numel() for p in big.parameters()) == pytest.approx(5.7e6, rel=0.02)  # DeiT-Ti
    with pytest.raises(
        ConfigError, match=r"model\.image_size=18: vit_tiny needs a multiple of its 4 px"
    ):
        build_classifier("vit_tiny", 10, image_size=18)


def test_bf16_on_a_cpu_without_bf16_units_states_its_cost(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert not precision_module.cpu_has_bf16_units(str(avx2))
    assert precision_module.cpu_has_bf16_units(str(amx))
    assert not precision_module.cpu_has_bf16_units(str(tmp_path / "absent"))
    monkeypatch.setattr(precision_module, "cpu_has_bf16_units", lambda: False)
    assert plan(CPU, 1, "train.precision=bf16").precision_cost.startswith(
        "train.precision=bf16 on a CPU without AVX-512 BF16 or AMX: bf16 autocast runs about "
        "40x slower than fp32 there"
    )
    assert plan(CPU, 1, "train.precision=fp32").precision_cost == ""
    assert plan(A100, 1, "train.precision=bf16").precision_cost == ""
    monkeypatch.setattr(precision_module, "cpu_has_bf16_units", lambda: True)
    assert plan(CPU, 1, "train.precision=bf16").precision_cost == ""
