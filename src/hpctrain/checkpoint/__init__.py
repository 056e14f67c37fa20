"""Checkpoints: DCP save/load with an atomic commit, retention, async saves, safe loading.

See `manager.py` for the folder layout, `commit.py` for the commit protocol, `selection.py`
for the checkpoint a load picks and `manifest.py` for what verification checks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.checkpoint.commit import CheckpointSaveError
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.checkpoint.manifest import committed_steps, verify_checkpoint
    from hpctrain.checkpoint.retention import steps_to_delete
    from hpctrain.checkpoint.safety import CheckpointError, UnsafeCheckpointError
    from hpctrain.checkpoint.state import ModelOptimizerState, PerRankState, RNGState

# Imported when first used: the manager needs torch (seconds), which what only reads a
# policy of this package (`checkpoint.interval`, `checkpoint.selection` from `launch`) and
# every `--help` should not pay.
_LAZY = {
    "CheckpointSaveError": "hpctrain.checkpoint.commit",
    "CheckpointManager": "hpctrain.checkpoint.manager",
    "committed_steps": "hpctrain.checkpoint.manifest",
    "verify_checkpoint": "hpctrain.checkpoint.manifest",
    "steps_to_delete": "hpctrain.checkpoint.retention",
    "CheckpointError": "hpctrain.checkpoint.safety",
    "UnsafeCheckpointError": "hpctrain.checkpoint.safety",
    "ModelOptimizerState": "hpctrain.checkpoint.state",
    "PerRankState": "hpctrain.checkpoint.state",
    "RNGState": "hpctrain.checkpoint.state",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
