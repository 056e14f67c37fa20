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
| `DataLoader._iterator._workers`                 | the bench's live workers' pids (CPU) | multiprocessing's live children |
| `DataLoader._iterator._shutdown_workers()`      | the bench joins workers at once     | none: they exit when collected  |
| `torch.distributed.checkpoint._traverse.set_element` | `SafeLoadPlanner.load_bytes` as DCP's | a copy here; watch for a `weights_only` `DefaultLoadPlanner` |
| `FileSystemReader._get_metadata_path`           | the `.metadata` our safe reader reads | `fs.concat_path(path, ".metadata")`; watch for a public metadata path |
| `checkpoint._fsspec_filesystem.FsspecReader`, `FsspecWriter` | checkpoints at fsspec URLs (subclassed) | `torch.distributed.checkpoint.FsspecReader`/`Writer`, the public export to watch for |
| `checkpoint.filesystem._StorageInfo`, `_StorageWriterTransforms` | item checksums while DCP writes (subclassed) | none (`TorchAPIChanged`); watch for a public `StorageInfo` and stream-transform extension |
| `FileSystemReader._slice_file` (overridden)     | item checksums while DCP reads       | none: tested only; watch for a public read-stream hook |
| `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model` | DDP leaves QLoRA's NF4 base alone | the attribute it sets; watch for a public ignore list |
| `torch._foreach_mul_`                            | `train.grad_clip` scales gradients in one call (`parallel/grad_norm.py`) | `mul_` per gradient |
| `torch.utils._python_dispatch.TorchDispatchMode`, `UntypedStorage._cdata` | record a model's initialisation on the meta device (`models/deferred_init.py`) | none: the model is built whole, as before; watch for a public deferred init |

Public replacements to watch for: a public way to close a `DataLoader`'s persistent workers
(pytorch/pytorch#64766, #71383) would replace both `DataLoader._iterator` uses.
"""

from __future__ import annotations

import importlib
import itertools
import warnings
from typing import TYPE_CHECKING, Any

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


# --- bench ---


def dataloader_worker_pids(loader: Any, *, strict: bool = False) -> list[int]:
    """The process ids of a torch `DataLoader`'s persistent workers, once an epoch has started
    them ([] when it keeps none: no workers, or not persistent).

    torch keeps them on the loader's private iterator; without it (a torch that moved it) the
    fallback is this process's live multiprocessing children, with a warning; `strict`: raise
    `TorchAPIChanged` instead.
    """
    try:
        iterator = loader._iterator
        return [] if iterator is None else [worker.pid for worker in iterator._workers]
    except AttributeError as exc:
        error = _changed("DataLoader._iterator._workers", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
    import multiprocessing

    return [child.pid for child in multiprocessing.active_children() if child.pid is not None]


def shutdown_dataloader_workers(loader: Any, *, strict: bool = False) -> None:
    """Stop and join a torch `DataLoader`'s persistent workers now, not when the loader is
    garbage collected (a no-op when it keeps none).

    Without the private iterator (a torch that moved it) the workers exit when the loader is
    collected, with a warning; `strict`: raise `TorchAPIChanged` instead.
    """
    try:
        iterator = loader._iterator
        if iterator is not None:
            iterator._shutdown_workers()
    except AttributeError as exc:
        error = _changed("DataLoader._iterator._shutdown_workers", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)


# --- ckpt ---
# DCP's private classes that `checkpoint/` subclasses or checks against, imported on first use
# through the module's `__getattr__`: importing DCP takes seconds, and loader workers import
# this module. Each name here: (private module, private name, public name to watch for).
if TYPE_CHECKING:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as FsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as FsspecWriter
    from torch.distributed.checkpoint.filesystem import (  # noqa: F401 (re-exported)
        _StorageInfo as StorageInfo,
    )
    from torch.distributed.checkpoint.filesystem import (  # noqa: F401 (re-exported)
        _StorageWriterTransforms as StorageWriterTransforms,
    )

_DCP = "torch.distributed.checkpoint"
_DCP_CLASSES = {
    "FsspecReader": (f"{_DCP}._fsspec_filesystem", "FsspecReader", f"{_DCP}.FsspecReader"),
    "FsspecWriter": (f"{_DCP}._fsspec_filesystem", "FsspecWriter", f"{_DCP}.FsspecWriter"),
    "StorageInfo": (f"{_DCP}.filesystem", "_StorageInfo", ""),
    "StorageWriterTransforms": (f"{_DCP}.filesystem", "_StorageWriterTransforms", ""),
}


def dcp_class(name: str, *, strict: bool = False) -> Any:
    """DCP's class `name` of `_DCP_CLASSES`, from its private module; if torch moved it,
    its public export with a warning (`strict`: `TorchAPIChanged` instead), or, without
    one, `TorchAPIChanged`: hpctrain's checkpoints need it."""
    module, private, public = _DCP_CLASSES[name]
    try:
        return getattr(importlib.import_module(module), private)
    except (ImportError, AttributeError) as exc:
        error = _changed(f"{module}.{private}", exc)
        if strict or not public:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        public_module, _, public_name = public.rpartition(".")
        return getattr(importlib.import_module(public_module), public_name)


def __getattr__(name: str) -> Any:
    if name in _DCP_CLASSES:
        return dcp_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _set_element(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """DCP's `set_element`: `value` at the object path `path` (str keys, int list indices)
    of `root`, creating the dicts and lists on the way."""
    container = root
    for key, next_key in itertools.pairwise(path):
        empty: Any = {} if type(next_key) is str else []
        if isinstance(container, dict):
            container = container.setdefault(key, empty)
        else:
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    if type(path[-1]) is int:
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def set_element(root: Any, path: tuple[Any, ...], value: Any, *, strict: bool = False) -> None:
    """Set `value` at DCP object path `path` of state dict `root` as DCP's loader does.

    Without the private function: the copy above, with a warning; `strict`:
    `TorchAPIChanged` instead.
    """
    try:
        from torch.distributed.checkpoint._traverse import set_element as dcp_set_element
    except ImportError as exc:
        error = _changed("torch.distributed.checkpoint._traverse.set_element", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        _set_element(root, path, value)
        return
    dcp_set_element(root, path, value)


def metadata_path(reader: Any, rank: int | None = None, *, strict: bool = False) -> Any:
    """The path of the `.metadata` file that DCP file reader `reader` reads (for `rank`).

    Without the private method: `.metadata` (`__<rank>.metadata`) in the reader's folder,
    as torch 2.14 names it, with a warning; `strict`: `TorchAPIChanged` instead.
    """
    try:
        return reader._get_metadata_path(rank)
    except (AttributeError, TypeError) as exc:
        error = _changed("FileSystemReader._get_metadata_path", exc)
        if strict:
            raise error from exc
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    return reader.fs.concat_path(reader.path, name)


# --- tasks ---
# | private API                                        | why                               | fallback (public replacement to watch for)          |
# |----------------------------------------------------|-----------------------------------|-----------------------------------------------------|
# | `torch._foreach_lerp_`, `torch._foreach_copy_`     | the EMA update in one kernel/list | a loop of `Tensor.lerp_`/`copy_` (no public foreach) |
# | `torch.cuda.memory._record_memory_history`         | allocation stacks in OOM snapshots| no history (documented, but no public name yet)     |
# | `torch.cuda.memory._dump_snapshot`                 | the OOM snapshot for memory_viz   | pickle of public `torch.cuda.memory_snapshot()`     |
# | `torch.distributed.algorithms._checkpoint`         | activation checkpointing wrapper  | `torch.utils.checkpoint` in the block's forward     |
# | `torch.nn.modules.batchnorm._BatchNorm`            | every BatchNorm kind at once      | the public BatchNorm1d/2d/3d and SyncBatchNorm      |
# | `torch._dynamo.is_dynamo_supported`                | why torch.compile cannot run      | assume supported (`torch.compiler` has no such test)|
# | `torch._inductor.async_compile.AsyncCompile.warm_pool` | start the compile workers now, deaf to the job's signals | none: torch starts them at the first compile (then USR2 kills them); watch for a public pool start or signal setting |


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


def foreach_mul_(tensors: list[torch.Tensor], value: torch.Tensor, *, strict: bool = False) -> None:
    """`t.mul_(value)` for every tensor (one device and dtype), in one fused call where torch
    has it (what `clip_grad_norm_` does)."""
    try:
        fused = torch._foreach_mul_
    except AttributeError as exc:
        _fallback("torch._foreach_mul_", exc, strict)
    else:
        fused(tensors, value)
        return
    for tensor in tensors:
        tensor.mul_(value)


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


def start_compile_workers(*, strict: bool = False) -> None:
    """Start inductor's compile worker pool (its sidecar process) now, in this thread.

    torch starts it itself at the first compile (`torch._dynamo.backends.inductor` calls
    `maybe_warm_pool`); starting it first lets the caller choose what it inherits (see
    `hpctrain.distributed.signals`). A no-op with one compile thread (`compile_threads=1`:
    inductor then compiles in this process) or where torch allows no pool (a daemonic
    process). The pool is torch's own afterwards: the same one later compiles use.
    """
    try:
        from torch._inductor.async_compile import AsyncCompile

        warm = AsyncCompile.warm_pool
    except (ImportError, AttributeError) as exc:
        _fallback("torch._inductor.async_compile.AsyncCompile.warm_pool", exc, strict)
        return
    warm()


def ddp_ignore(module: torch.nn.Module, names: list[str], *, strict: bool = False) -> None:
    """Have a later `DistributedDataParallel(module)` leave the parameters `names` alone: not
    broadcast at construction (DDP's broadcast of a tensor subclass, torchao's NF4Tensor,
    round-trips its values: measured 1e-5 changes), nor reduced."""
    try:
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
        return
    except AttributeError as exc:
        _fallback(
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", exc, strict
        )
    module._ddp_params_and_buffers_to_ignore = names  # type: ignore[assignment]


def dispatch_mode_class(*, strict: bool = False) -> type | None:
    """`TorchDispatchMode`, the base of a mode that sees every aten op (None if moved)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode

        return TorchDispatchMode
    except ImportError as exc:
        _fallback("torch.utils._python_dispatch.TorchDispatchMode", exc, strict)
    return None


def storage_key(tensor: torch.Tensor, *, strict: bool = False) -> int | None:
    """An identity of `tensor`'s storage, shared by its views and the Parameter made of it
    (meta tensors have no data pointer to tell them apart); None if torch changed it."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (AttributeError, TypeError, RuntimeError) as exc:
        _fallback("torch.UntypedStorage._cdata", exc, strict)
    return None
