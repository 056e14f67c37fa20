"""Checkpoints: DCP save/load with an atomic commit, retention, async saves, safe loading.

See `manager.py` for the folder layout, `commit.py` for the commit protocol, `selection.py`
for the checkpoint a load picks and `manifest.py` for what verification checks.
"""

from hpctrain.checkpoint.commit import CheckpointSaveError
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.manifest import committed_steps, verify_checkpoint
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
