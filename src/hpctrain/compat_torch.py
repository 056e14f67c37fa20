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

Public replacements to watch for: a public way to close a `DataLoader`'s persistent workers
(pytorch/pytorch#64766, #71383) would replace both `DataLoader._iterator` uses.
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
