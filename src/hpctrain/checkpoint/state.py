"""Stateful wrappers that make training state fit DCP.

DCP saves one copy of a value stored under the same key on every rank (it de-duplicates
replicated data), so anything that differs per rank (RNG streams, loader positions) must
live under a per-rank key: `PerRankState` does that. `ModelOptimizerState` goes through
DCP's `get_state_dict`/`set_state_dict`, which give the same keys for a plain module, DDP and
FSDP2, so a checkpoint written under one strategy or world size loads under another.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimizerState:
    """Model (and optimizer) state for DCP, for plain, DDP and FSDP2 models.

    Args:
        model: the module as trained (plain, DDP-wrapped or `fully_shard`-ed).
        optimizer: its optimizer, or None to checkpoint the model only.
        options: DCP `StateDictOptions` (default: sharded state, strict loading).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )


class PerRankState:
    """Keeps a rank-local state under the key `rank<r>` so DCP stores every rank's copy.

    The state is stored as one opaque blob (`torch.save` bytes, read back with
    `weights_only=True`): DCP loads into the structure of the *current* state dict, so a state
    whose lists or keys change length over a run (a loader's re-planned stages, per-worker
    entries) would otherwise be loaded only where its fresh shape happens to match.

    Resuming at a larger world size, a rank with no saved entry loads the entry of
    `fallback_rank` (right for loader positions, which are the same on every rank and let the
    loader re-plan), or keeps its fresh state when `fallback_rank` is None. The checkpoint
    manager sets which saved rank to read before a load (`source_rank`).

    Args:
        obj: anything with `state_dict()` and `load_state_dict()`; its state may hold
            tensors and plain data (what `torch.load(weights_only=True)` accepts).
        fallback_rank: the saved rank to read when this rank has no entry.
    """

    def __init__(self, obj: Stateful, *, fallback_rank: int | None = 0) -> None:
        self.obj = obj
        self.fallback_rank = fallback_rank
        self.source_rank: int | None = None  # set by CheckpointManager.load, else own rank

    def _key(self) -> str:
        if self.source_rank is not None:
            return f"rank{self.source_rank}"
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.obj.state_dict(), buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict[self._key()]
        self.obj.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


class RNGState:
    """The random generators of this process: torch (CPU and CUDA) and Python's `random`.

    Wrap it in `PerRankState` (each rank has its own streams). Values are tensors and tuples of
    ints, which load with `weights_only=True`. numpy's global generator is not saved: hpctrain
    derives data randomness from (seed, epoch, rank, worker), not from global generators.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():  # the same keys on save and load, whatever ran first
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
