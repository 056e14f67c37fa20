"""Mixed precision: which dtype, autocast or FSDP2 policy, and whether a gradient scaler runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.config import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def resolve_precision(requested: str, device: torch.device, sharded: bool) -> Precision:
    """Pick the precision, failing before any work when the device cannot do it.

    `auto` is bf16 on GPUs with bf16 support (Ampere and newer) and fp32 elsewhere: on CPUs
    without AVX-512 BF16, bf16 autocast is ~40x slower than fp32 (see BENCHMARKS.md).
    """
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        bf16_ok = major >= 8
        if requested == "auto":
            return Precision("bf16" if bf16_ok else "fp32", "cuda", sharded)
        if requested == "bf16" and not bf16_ok:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(
                f"train.precision=bf16: {name} (compute capability {major}.x) has no bf16; use fp16 or fp32"
            )
        return Precision(requested, "cuda", sharded)
    if requested == "auto":
        return Precision("fp32", device.type, sharded)
    if requested == "fp16" and sharded:
        # FSDP2 keeps fp16 params for compute; gloo reduces them in fp32, but CPU fp16 kernels
        # for every op are not guaranteed, so only autocast fp16 is offered on CPU.
        raise ConfigError(
            "train.precision=fp16 with train.strategy=fsdp needs a GPU; on CPU use fp32 or bf16"
        )
    return Precision(requested, device.type, sharded)


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
