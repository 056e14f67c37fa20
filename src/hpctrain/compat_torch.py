"""The private torch APIs hpctrain uses, fenced in one place, each with a public fallback.

torch keeps no promise about underscored names, so each use goes through a function here
that first tries the private path and, if a torch release moved it, falls back to a public
(slower or narrower) one with a warning. `tests/test_compat_torch.py` calls the private paths
directly (`strict=True`): on a torch that changed them it fails loudly, naming the torch
version and the API, instead of the fallback hiding the change.

| private API                                     | why                                  | fallback                        |
|-------------------------------------------------|--------------------------------------|---------------------------------|
| `torch.UntypedStorage._new_shared(nbytes)`      | a shared-memory buffer made in place | `share_memory_()` (a copy)      |
| `torch.utils.data._utils.worker._worker_info`   | `get_worker_info()` in our workers   | none: it answers None there     |
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


class TorchAPIChanged(RuntimeError):
    """A private torch API hpctrain relies on is gone or changed in this torch release."""


def _changed(api: str, exc: BaseException) -> TorchAPIChanged:
    return TorchAPIChanged(
        f"torch {torch.__version__} changed {api} ({type(exc).__name__}: {exc}); "
        "hpctrain falls back to a public path: see hpctrain/compat_torch.py"
    )


def new_shared_bytes(nbytes: int, *, strict: bool = False) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` in a new shared-memory segment (uninitialised;
    torch's sharing strategy), which a pipe passes as a file descriptor without a copy.

    `strict`: raise `TorchAPIChanged` instead of falling back (for the test).
    """
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    except (AttributeError, TypeError, RuntimeError) as exc:
        error = _changed("torch.UntypedStorage._new_shared", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
    # zeroed in private memory first, then copied into the shared segment: slower, same result
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def set_worker_info(
    *, worker: int, num_workers: int, seed: int, dataset: Any, strict: bool = False
) -> None:
    """Make `torch.utils.data.get_worker_info()` answer in hpctrain's loader workers as in
    DataLoader's (a user's transform may ask which worker it runs in).

    Without the private module (a torch that moved it) it keeps answering None there, with
    a warning; `strict`: raise `TorchAPIChanged` instead.
    """
    try:
        from torch.utils.data._utils import worker as torch_worker

        info = torch_worker.WorkerInfo(
            id=worker, num_workers=num_workers, seed=seed, dataset=dataset
        )
        if not hasattr(torch_worker, "_worker_info"):
            raise AttributeError("no attribute _worker_info")
        torch_worker._worker_info = info
    except (ImportError, AttributeError, TypeError) as exc:
        error = _changed("torch.utils.data._utils.worker._worker_info", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)


# --- tasks ---
# | private API                                        | why                               | fallback (public replacement to watch for)          |
# |----------------------------------------------------|-----------------------------------|-----------------------------------------------------|
# | `torch._foreach_lerp_`, `torch._foreach_copy_`     | the EMA update in one kernel/list | a loop of `Tensor.lerp_`/`copy_` (no public foreach) |
# | `torch.cuda.memory._record_memory_history`         | allocation stacks in OOM snapshots| no history (documented, but no public name yet)     |
# | `torch.cuda.memory._dump_snapshot`                 | the OOM snapshot for memory_viz   | pickle of public `torch.cuda.memory_snapshot()`     |
# | `torch.distributed.algorithms._checkpoint`         | activation checkpointing wrapper  | `torch.utils.checkpoint` in the block's forward     |
# | `torch.nn.modules.batchnorm._BatchNorm`            | every BatchNorm kind at once      | the public BatchNorm1d/2d/3d and SyncBatchNorm      |
# | `torch._dynamo.is_dynamo_supported`                | why torch.compile cannot run      | assume supported (`torch.compiler` has no such test)|


def _fallback(api: str, exc: BaseException, strict: bool) -> None:
    """Raise `TorchAPIChanged` for `strict`, else warn that `api` falls back."""
    error = _changed(api, exc)
    if strict:
        raise error from exc
    warnings.warn(str(error), RuntimeWarning, stacklevel=3)


def foreach_lerp_(
    tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: float, *, strict: bool = False
) -> None:
    """`t.lerp_(end, weight)` for every pair, in one fused call where torch has it."""
    try:
        fused = torch._foreach_lerp_
    except AttributeError as exc:
        _fallback("torch._foreach_lerp_", exc, strict)
    else:
        fused(tensors, ends, weight)
        return
    for tensor, end in zip(tensors, ends, strict=True):
        tensor.lerp_(end, weight)


def foreach_copy_(
    tensors: list[torch.Tensor], sources: list[torch.Tensor], *, strict: bool = False
) -> None:
    """`t.copy_(source)` for every pair, in one fused call where torch has it."""
    try:
        fused = torch._foreach_copy_
    except AttributeError as exc:
        _fallback("torch._foreach_copy_", exc, strict)
    else:
        fused(tensors, sources)
        return
    for tensor, source in zip(tensors, sources, strict=True):
        tensor.copy_(source)


def record_memory_history(max_entries: int | None, *, strict: bool = False) -> bool:
    """Start (`max_entries` events, Python stacks) or, with None, stop recording the CUDA
    allocator's history; False when this torch cannot (then snapshots have no stacks)."""
    try:
        record = torch.cuda.memory._record_memory_history
    except AttributeError as exc:
        _fallback("torch.cuda.memory._record_memory_history", exc, strict)
        return False
    if max_entries is None:
        record(enabled=None)
    else:
        # stacks="python": Python frames only; C++ frames ("all") cost far more per event.
        record(max_entries=max_entries, stacks="python")
    return True


def dump_memory_snapshot(path: str, *, strict: bool = False) -> None:
    """Write the CUDA allocator's snapshot (for pytorch.org/memory_viz) to `path`."""
    try:
        dump = torch.cuda.memory._dump_snapshot
    except AttributeError as exc:
        _fallback("torch.cuda.memory._dump_snapshot", exc, strict)
    else:
        dump(path)
        return
    import pickle

    # the segments alone (no history): what memory_viz shows of a snapshot without traces
    with open(path, "wb") as f:
        pickle.dump({"segments": torch.cuda.memory_snapshot(), "device_traces": []}, f)


def checkpoint_wrapper(block: torch.nn.Module, *, strict: bool = False) -> torch.nn.Module:
    """`block` with its activations recomputed in the backward pass (non-reentrant), keeping
    its state-dict names (the wrapper strips its own prefix)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper as wrap,
        )

        return wrap(block)
    except ImportError as exc:
        _fallback("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", exc, strict)
    import functools

    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed  # type: ignore[method-assign]
    return block


def batchnorm_classes(*, strict: bool = False) -> tuple[type[torch.nn.Module], ...]:
    """The classes of every BatchNorm kind (norms with running statistics)."""
    try:
        from torch.nn.modules.batchnorm import _BatchNorm

        return (_BatchNorm,)
    except ImportError as exc:
        _fallback("torch.nn.modules.batchnorm._BatchNorm", exc, strict)
    nn = torch.nn
    return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def dynamo_supported(*, strict: bool = False) -> bool:
    """Whether torch.compile's dynamo runs on this Python (`torch._dynamo` is imported here,
    on first use: it is slow to import)."""
    try:
        import torch._dynamo

        supported = torch._dynamo.is_dynamo_supported
    except (ImportError, AttributeError) as exc:
        _fallback("torch._dynamo.is_dynamo_supported", exc, strict)
        return True
    return bool(supported())
