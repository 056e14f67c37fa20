"""What a (device, strategy, precision, compile, ...) combination means, decided in one place.

`plan_training` is a pure function of the device's facts and the `train.*` keys: it picks the
effective strategy and precision, and refuses every combination that cannot train with a
one-line `ConfigError` naming the keys, before any model or loader work. The Trainer calls it
first; `hpctrain preflight` can call it with the facts of the cluster's GPUs. What each
combination does on a CPU is asserted cell by cell in `tests/parallel/test_matrix.py`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.compat_torch import dynamo_supported
from hpctrain.config import ConfigError, TrainConfig
from hpctrain.distributed.startup import CUBLAS_WORKSPACE, DETERMINISTIC_CUBLAS_WORKSPACE
from hpctrain.toolchain import find_toolchain

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan needs to know about the device (gathered by `device_facts`)."""

    type: str  # "cpu" or "cuda"
    name: str = "cpu"
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability
    # Lowest compute capability this torch build has kernels for (sm_75 for torch 2.14+cu130:
    # no V100); 0 when unknown.
    min_capability: int = 0
    compile_blocker: str = ""  # why torch.compile cannot run here; empty when it can

    @property
    def bf16_ok(self) -> bool:
        """bf16 kernels: every CPU (slow without AVX-512 BF16/AMX), GPUs from Ampere (sm_80)."""
        return self.type != "cuda" or self.capability[0] >= 8

    @property
    def tf32_ok(self) -> bool:
        """TF32 tensor cores for fp32 matmuls: GPUs from Ampere (sm_80), as bf16."""
        return self.type == "cuda" and self.capability[0] >= 8


@dataclass(frozen=True)
class Precision:
    """The resolved precision of a run."""

    name: str  # fp32 | bf16 | fp16
    device_type: str
    sharded: bool  # FSDP2: compute dtype comes from MixedPrecisionPolicy, not autocast

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for the forward pass; FSDP2 casts parameters itself, so nothing there."""
        if self.name == "fp32" or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


SHARDED = ("fsdp", "hsdp")  # the strategies where FSDP2 shards parameters


@dataclass(frozen=True)
class TrainingPlan:
    """The effective parallelism and precision of a run."""

    strategy: str  # none | ddp | fsdp | hsdp (none whenever there is one process)
    precision: Precision
    sync_batchnorm: bool  # convert BatchNorm layers to SyncBatchNorm
    # (replicate, shard) degrees of the data-parallel ranks: DDP (D, 1), FSDP2 (1, D),
    # HSDP (D / shard_degree, shard_degree), D = world size / tp
    mesh: tuple[int, int] = (1, 1)
    tp: int = 1  # tensor-parallel ranks (innermost: consecutive ranks, inside a node)
    why_precision: str = ""  # what `train.precision=auto` chose and why (a log line)
    precision_cost: str = ""  # a precision that runs much slower here than fp32 (a warning)

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different batches (a TP group reads one batch together)."""
        return self.mesh[0] * self.mesh[1]

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.tp

    def describe_mesh(self) -> str:
        """`replicate 2 x shard 2` (the log and metrics.jsonl's first record)."""
        replicate, shard = self.mesh
        tp = f" x tp {self.tp}" if self.tp > 1 else ""
        if self.strategy == "hsdp":
            return f"replicate {replicate} x shard {shard}{tp}"
        if self.strategy == "fsdp":
            return f"shard {shard}{tp}"
        if self.strategy == "ddp":
            return f"replicate {replicate}"
        return "single process"


def plan_training(
    train: TrainConfig, device: DeviceFacts, world_size: int, local_world_size: int = 0
) -> TrainingPlan:
    """Decide what `train.*` means on `device` with `world_size` ranks, or refuse it.

    `local_world_size`: the ranks of one node (0: unknown, taken as `world_size`), which
    `train.strategy=hsdp` shards over when `train.shard_degree` is 0.

    Raises `ConfigError` (one line naming the keys) for combinations that cannot train:
    bf16 on GPUs before Ampere, a GPU this torch build has no kernels for, several ranks
    without data parallelism, SyncBatchNorm on CPUs, `train.compile` where it cannot run.
    `auto` precision (`auto_precision`): bf16 on GPUs with bf16, fp16 on GPUs with neither
    bf16 nor TF32 (V100, T4), fp32 on CPUs.
    """
    if device.type == "cuda" and device.min_capability:
        major, minor = device.capability
        if 10 * major + minor < device.min_capability:
            low = divmod(device.min_capability, 10)
            raise ConfigError(
                f"device {device.name} (compute capability {major}.{minor}): this torch "
                f"{torch.__version__} has kernels from {low[0]}.{low[1]} up; install a torch built for it"
            )
    if world_size > 1 and train.strategy == "none":
        raise ConfigError(
            f"train.strategy=none with {world_size} ranks: each rank would train its own diverging "
            "copy; use ddp or fsdp, or run one process"
        )
    strategy = train.strategy if world_size > 1 else "none"
    local_world_size = local_world_size or world_size
    tp = _tensor_parallel_degree(train, strategy, world_size, local_world_size)
    mesh = _data_parallel_mesh(train, strategy, world_size // tp, local_world_size // tp)

    name, why = train.precision, ""
    if name == "auto":
        name, why = auto_precision(device)
    if name == "bf16" and not device.bf16_ok:
        major, minor = device.capability
        raise ConfigError(
            f"train.precision=bf16: {device.name} (compute capability {major}.{minor}) has no bf16; "
            "use fp16 or fp32"
        )

    cost = ""
    if name == "bf16" and device.type == "cpu" and not cpu_has_bf16_units():
        cost = (
            "train.precision=bf16 on a CPU without AVX-512 BF16 or AMX: bf16 autocast runs about "
            "40x slower than fp32 there (a resnet18 step: 30 s against 0.73 s on a 2-core AVX2 "
            "CPU, docs/benchmark-log.md); train.precision=fp32 (or auto) for a CPU run"
        )

    sync_batchnorm = train.sync_batchnorm and strategy != "none"
    if sync_batchnorm and device.type != "cuda":
        raise ConfigError(
            f"train.sync_batchnorm=true with train.strategy={strategy} on {device.type}: torch's "
            "SyncBatchNorm runs on GPUs only; set train.sync_batchnorm=false"
        )
    if train.compile and device.compile_blocker:
        raise ConfigError(
            f"train.compile=true on {device.name}: {device.compile_blocker}; set train.compile=false"
        )
    return TrainingPlan(
        strategy=strategy,
        precision=Precision(name, device.type, sharded=strategy in SHARDED),
        sync_batchnorm=sync_batchnorm,
        mesh=mesh,
        tp=tp,
        why_precision=why,
        precision_cost=cost,
    )


def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 arithmetic units (AVX-512 BF16 or AMX), where bf16 autocast
    pays off; False where /proc/cpuinfo cannot tell (not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_precision(device: DeviceFacts) -> tuple[str, str]:
    """(precision, the log line saying why) for `train.precision=auto` on `device`.

    - bf16 on GPUs from Ampere: the tensor cores' fast path, fp32's range (no loss scaling).
    - fp16 (autocast and a gradient scaler) on GPUs with neither bf16 nor TF32 (V100, T4):
      fp32 matmuls there run on CUDA cores, 4-8x slower than fp16's tensor cores (V100: 15.7
      against 125 TFLOP/s), the mixed precision these GPUs were built for.
    - fp32 on CPUs: without AVX-512 BF16/AMX, bf16 autocast is ~40x slower than fp32
      (docs/benchmark-log.md).
    """
    if device.type != "cuda":
        return "fp32", ""
    major, minor = device.capability
    where = f"{device.name} (compute capability {major}.{minor})"
    if device.bf16_ok:
        return "bf16", f"train.precision=auto: bf16 on {where}"
    assert not device.tf32_ok  # both arrived with Ampere
    return "fp16", (
        f"train.precision=auto: fp16 (autocast and a gradient scaler) on {where}: it has "
        "neither bf16 nor TF32, and fp32 runs 4-8x slower there than fp16's tensor cores; "
        "set train.precision=fp32 to keep full precision"
    )


def configure_backends(device: DeviceFacts, deterministic: bool) -> str:
    """Set torch's kernel choices for a run on `device`; the same for training, eval and
    predict (evaluating with other kernels than training would score other numbers).
    Returns a line for the log ("" when there is nothing to say).

    Deterministic: deterministic algorithms, cuDNN's autotuner off. On CUDA they are asked
    with `warn_only=True`: torch only knows whether an op has a deterministic CUDA kernel
    when it runs it, and a ResNet's adaptive pooling and the UNet's upsampling have none in
    their backward. Refusing the combination up front would refuse every GPU run (a GPT
    has such kernels for every op it uses), and an error at the first backward comes after
    the queue wait and the start-up; with `warn_only` every op that has a deterministic kernel
    uses it, and torch names the others in a warning. cuBLAS needs a fixed workspace for
    repeatable results (and torch < 2.9 errors without one): `CUBLAS_WORKSPACE_CONFIG` is
    set before CUDA starts (`start_process`), and here for callers that skipped it.

    Otherwise on CUDA: cuDNN's autotuner (fixed input shapes) and TF32 for fp32 matmuls.
    """
    if not deterministic:
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.set_float32_matmul_precision("high")
        return ""
    torch.backends.cudnn.benchmark = False
    if device.type != "cuda":
        torch.use_deterministic_algorithms(True)
        return ""
    os.environ.setdefault(CUBLAS_WORKSPACE, DETERMINISTIC_CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return (
        f"train.deterministic=true on {device.name}: deterministic kernels where torch has them "
        f"({CUBLAS_WORKSPACE}={os.environ[CUBLAS_WORKSPACE]}, cuDNN autotuning off); ops "
        "without one (e.g. the backward of adaptive pooling and upsampling) run as they are, "
        "each named once in a torch warning: only what goes through them can differ"
    )


def _tensor_parallel_degree(
    train: TrainConfig, strategy: str, world_size: int, local_world_size: int
) -> int:
    """`train.tp_degree`, or a one-line refusal of a degree that cannot split this job."""
    tp = train.tp_degree
    if tp == 1:
        return 1
    key = f"train.tp_degree={tp}"
    if strategy not in SHARDED:
        raise ConfigError(
            f"{key} with train.strategy={strategy} and {world_size} rank(s): tensor parallelism "
            "runs with train.strategy=fsdp or hsdp on two ranks or more (FSDP2 shards the "
            "remaining data-parallel dimension; DDP does not take tensor-parallel parameters)"
        )
    if local_world_size % tp or world_size % tp:
        raise ConfigError(
            f"{key}: must divide the {local_world_size} ranks of a node (tensor parallelism "
            "stays inside a node, on its fast links)"
        )
    return tp


def _data_parallel_mesh(
    train: TrainConfig, strategy: str, world_size: int, local_world_size: int
) -> tuple[int, int]:
    """(replicate, shard) degrees; refuses a `train.shard_degree` that cannot apply."""
    if train.shard_degree and train.strategy != "hsdp":
        raise ConfigError(
            f"train.shard_degree={train.shard_degree} applies to train.strategy=hsdp only "
            f"(train.strategy={train.strategy}); set train.shard_degree=0"
        )
    if strategy == "hsdp":
        shard = train.shard_degree or local_world_size
        if world_size % shard:
            where = "" if train.shard_degree else " (the ranks of one node)"
            tp = f" (world size / train.tp_degree={train.tp_degree})" if train.tp_degree > 1 else ""
            raise ConfigError(
                f"train.shard_degree={shard}{where} does not divide the {world_size} "
                f"data-parallel ranks{tp} of train.strategy=hsdp: their number must be a "
                "multiple of the shard degree"
            )
        return world_size // shard, shard
    if strategy == "fsdp":
        return 1, world_size
    return world_size, 1


def device_facts(device: torch.device, *, compile: bool = False) -> DeviceFacts:
    """The facts of `device` that `plan_training` needs (what can compile only if asked)."""
    blocker = compile_blocker(device) if compile else ""
    if device.type != "cuda":
        return DeviceFacts(type=device.type, name=device.type, compile_blocker=blocker)
    archs = [
        int(arch.removeprefix("sm_"))
        for arch in torch.cuda.get_arch_list()
        if arch.startswith("sm_") and arch.removeprefix("sm_").isdigit()
    ]
    return DeviceFacts(
        type="cuda",
        name=torch.cuda.get_device_name(device),
        capability=torch.cuda.get_device_capability(device),
        min_capability=min(archs, default=0),
        compile_blocker=blocker,
    )


def compile_blocker(device: torch.device) -> str:
    """Why `torch.compile` (inductor) cannot run on `device` here; empty when it can."""
    if not dynamo_supported():
        return f"torch.compile does not support Python {sys.version.split()[0]}"
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "inductor needs triton for GPUs (pip install triton)"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            return f"triton needs compute capability 7.0 or newer, not {major}.{minor}"
        missing = find_toolchain().missing(cuda=True)
        return f"triton cannot build its kernels here: {'; '.join(missing)}" if missing else ""
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "inductor needs a C++ compiler on CPUs (none of $CXX, c++, g++, clang++ found)"
    missing = find_toolchain().missing(cuda=False, c_compiler=False)
    return f"inductor cannot build its kernels here: {missing[0]}" if missing else ""


def make_grad_scaler(precision: Precision) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 (its state is checkpointed); None otherwise.

    Under FSDP2 each rank holds only gradient shards, so the inf/nan check must be agreed on
    across ranks: `ShardedGradScaler` all-reduces `found_inf`, the plain scaler does not.
    """
    if not precision.uses_scaler:
        return None
    if precision.sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=precision.device_type)
    return torch.amp.GradScaler(precision.device_type)
