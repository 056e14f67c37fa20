"""Checkpoints: DCP save/load with an atomic commit, retention, async saves, safe loading.

See `manager.py` for the folder layout and the commit protocol.
"""

from hpctrain.checkpoint.manager import (
    CheckpointManager,
    CheckpointSaveError,
    committed_steps,
    verify_checkpoint,
)
from hpctrain.checkpoint.retention import steps_to_delete
from hpctrain.checkpoint.safety import CheckpointError, UnsafeCheckpointError
from hpctrain.checkpoint.state import ModelOptimizerState, PerRankState, RNGState

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointSaveError",
    "ModelOptimizerState",
    "PerRankState",
    "RNGState",
    "UnsafeCheckpointError",
    "committed_steps",
    "steps_to_delete",
    "verify_checkpoint",
]
