"""`train.ema_decay`: an exponential moving average (EMA) of the model's weights.

After every optimizer step, `ema = decay * ema + (1 - decay) * weight` for every parameter
(one `torch._foreach_lerp_` over all of them, without autograd). The EMA is held in fp32 and
laid out like the parameters it follows:

- plain and DDP models: plain tensors, the same on every rank (every rank steps alike);
- FSDP2: DTensors with the parameters' mesh and placements, so each rank averages only its
  own shard (no all-gather per step) and the EMA costs 1/world_size of the model per rank.
  FSDP2's sharded parameters stay fp32 under a bf16/fp16 `MixedPrecisionPolicy` (only the
  gathered copies are cast), and DDP/plain parameters stay fp32 under autocast.

Buffers (BatchNorm running statistics) are not averaged: evaluating with the EMA uses the
model's current buffers, and an EMA export takes the buffers from the checkpoint's model.

The EMA is a `Stateful` keyed by the parameters' plain-module names (without the `module.`,
`_orig_mod.` and `_checkpoint_wrapped_module.` parts that DDP, `torch.compile` and activation
checkpointing add): the checkpoint holds it as `ema.<name>`, beside `app.model.<name>`, so it
reshards across world sizes and strategies like the model (DCP reads DTensor shards into
plain tensors and back).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain.compat_torch import foreach_copy_, foreach_lerp_
from hpctrain.parallel.parallelize import reshard

# Module-name parts that wrappers of blocks insert: torch.compile, activation checkpointing
# (reserved names; DDP's root `module.` is dropped by naming the parameters of DDP's module).
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")
CHECKPOINT_KEY = "ema"  # its key in the trainer's checkpoint states (entries `ema.<name>`)


def plain_name(name: str) -> str:
    """`blocks.0._checkpoint_wrapped_module._orig_mod.weight` -> `blocks.0.weight`."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (a view: writing it writes the DTensor), else itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class WeightEMA:
    """An fp32 EMA of `model`'s parameters, sharded like them.

    Args:
        model: the trained module as wrapped (plain, DDP or `fully_shard`-ed).
        decay: weight kept from the average at each update, in [0, 1).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.model = model
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        named = [(plain_name(n), p) for n, p in inner.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            # DTensor.to keeps the mesh and placements: the EMA is sharded like the parameter.
            self.weights = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self._locals = [_local(w) for w in self.weights]

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current weights (call after each optimizer step)."""
        current = [_local(p) for p in self.params]
        if any(c.dtype != torch.float32 for c in current):
            current = [c.float() for c in current]
        # lerp_(w, p, 1 - d) = w + (1 - d) (p - w) = d w + (1 - d) p
        foreach_lerp_(self._locals, current, 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the current weights."""
        foreach_copy_(self._locals, [_local(p) for p in self.params])

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the EMA and the model's weights; a second call swaps them back.

        Evaluation with the EMA runs between two calls. One parameter at a time goes through
        a temporary copy, so the swap needs memory for the largest (shard of a) parameter only.
        The swap writes into FSDP2's shards: gathered copies are freed first, or the next
        forward would use them as they are (`hpctrain.parallel.parallelize.reshard`).
        """
        reshard(self.model)
        for param, weight in zip(self.params, self._locals, strict=True):
            local = _local(param)
            kept = local.clone()
            local.copy_(weight)
            weight.copy_(kept)

    def state_dict(self) -> dict[str, Any]:
        return dict(zip(self.names, self.weights, strict=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP loads tensors in place into what state_dict() returned; copy anything else.
        with torch.no_grad():
            for name, weight in zip(self.names, self.weights, strict=True):
                value = state_dict[name]
                if value is not weight:
                    weight.copy_(value)


def build_ema(model: nn.Module, decay: float) -> WeightEMA | None:
    """The EMA of `model` for `train.ema_decay`, or None when it is 0 (disabled)."""
    return WeightEMA(model, decay) if decay > 0 else None
