"""Shard index, epoch plan and the per-rank streaming loader.

The loader names are imported lazily: `hpctrain plan` and `hpctrain inspect` should not pay
for `import torch` (seconds).
"""

from typing import TYPE_CHECKING, Any

from hpctrain.data.index import (
    INDEX_NAME,
    ShardIndex,
    ShardIndexError,
    ShardInfo,
    read_index,
    redact_url,
)
from hpctrain.data.locate import expand_braces, open_index
from hpctrain.data.planning import EpochPlan, PlanError, Segment, StageParams, plan
from hpctrain.data.stream import ReadStats, ShardReadError, ShardUnavailableError

__all__ = [
    "INDEX_NAME",
    "EpochPlan",
    "LoaderStateError",
    "PlanError",
    "ReadStats",
    "SampleError",
    "Segment",
    "ShardIndex",
    "ShardIndexError",
    "ShardInfo",
    "ShardReadError",
    "ShardUnavailableError",
    "ShardedLoader",
    "StageParams",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "decode_sample",
    "expand_braces",
    "open_index",
    "plan",
    "read_index",
    "redact_url",
]

if TYPE_CHECKING:  # the real types for type checkers; at run time they load on first use
    from hpctrain.data.decode import SampleError, decode_sample
    from hpctrain.data.loader import LoaderStateError, ShardedLoader
    from hpctrain.data.transport import WorkerDiedError, WorkerTimeoutError

_LAZY = {"LoaderStateError", "ShardedLoader"}


def __getattr__(name: str) -> Any:
    if name in ("SampleError", "decode_sample"):
        from hpctrain.data import decode

        return getattr(decode, name)
    if name in _LAZY:
        from hpctrain.data import loader

        return getattr(loader, name)
    if name in ("WorkerDiedError", "WorkerTimeoutError"):
        from hpctrain.data import transport

        return getattr(transport, name)
    raise AttributeError(f"module 'hpctrain.data' has no attribute {name!r}")
