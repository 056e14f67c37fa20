"""The one place where DDP and FSDP2 appear: activation checkpointing → compile → shard/wrap.

Order matters (as in torchtitan's parallelize): checkpoint wrappers go around the blocks that
FSDP2 shards one by one, and `torch.compile` sees the blocks before they are wrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hpctrain.config import TrainConfig
from hpctrain.dist import DistEnv
from hpctrain.train.precision import Precision


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The repeated blocks of a model as (parent, attribute name, block).

    Known layouts: `model.blocks` (hpctrain's SmallCNN, many ViTs), torchvision ResNets
    (`layer1`..`layer4`), torchvision ViT (`encoder.layers`); otherwise the top-level children.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return [(blocks, name, child) for name, child in blocks.named_children()]
    resnet_layers = [
        name for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, name)
    ]
    if resnet_layers:
        return [(model, name, getattr(model, name)) for name in resnet_layers]
    encoder = getattr(model, "encoder", None)
    layers = getattr(encoder, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return [(layers, name, child) for name, child in layers.named_children()]
    return [
        (model, name, child)
        for name, child in model.named_children()
        if any(True for _ in child.parameters())
    ]


def parallelize(
    model: nn.Module,
    cfg: TrainConfig,
    env: DistEnv,
    device: torch.device,
    precision: Precision,
    *,
    channels_last: bool = False,
) -> nn.Module:
    """Move `model` to `device` and apply activation checkpointing, compile and DDP/FSDP2.

    Every rank must have built the model from the same seed: FSDP2 does not broadcast initial
    weights (DDP does, but starting equal keeps the two strategies bitwise comparable).
    With `channels_last`, 4-d weights are stored NHWC too, so convolutions on channels_last
    inputs need no layout conversion (cuDNN's fast path for tensor cores).
    """
    model.to(device)
    sharded = env.is_distributed and cfg.strategy == "fsdp"
    if channels_last and not sharded:
        # FSDP2 refuses non-contiguous parameters ("does not support non-contiguous
        # parameters yet", torch 2.14); under it only the inputs are channels_last.
        model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        for parent, name, block in find_blocks(model):
            setattr(parent, name, checkpoint_wrapper(block))
    if cfg.compile:
        for parent, name, block in find_blocks(model):
            setattr(parent, name, torch.compile(block))
    if not env.is_distributed or cfg.strategy == "none":
        # DDP at world size 1 costs 2-18% per step for nothing (notes/environment.md).
        return model
    if cfg.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return shard_fsdp2(model, cfg, precision)


def shard_fsdp2(model: nn.Module, cfg: TrainConfig, precision: Precision) -> nn.Module:
    """`fully_shard` per block, then the root; parameters in the compute dtype, reduce in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    for _, _, block in find_blocks(model):
        fully_shard(block, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on accumulation micro-steps (all but the last one)."""
    if not skip:
        yield
        return
    wrapped: Any = model
    if hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
        return
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
        return
    yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modules are the user's module itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model
