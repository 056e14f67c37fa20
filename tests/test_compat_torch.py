"""The private torch APIs behind `hpctrain.compat_torch` still work in this torch release.

A failure here names the torch version and the API: the fallback would hide it otherwise.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from hpctrain.compat_torch import new_shared_bytes, set_worker_info


def _child_reads(conn) -> None:
    tensor = conn.recv()
    conn.send(tensor[:4].tolist())
    tensor[0] = 99  # written in the child, seen by the parent: the same memory


def test_new_shared_storage_is_shared_memory_that_a_pipe_passes():
    flat = new_shared_bytes(1 << 16, strict=True)
    assert flat.dtype == torch.uint8 and flat.shape == (1 << 16,) and flat.is_shared()
    flat[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_child_reads, args=(child,))
    process.start()
    parent.send(flat)
    assert parent.recv() == [1, 2, 3, 4]
    process.join(timeout=60)
    assert process.exitcode == 0 and int(flat[0]) == 99


def test_worker_info_is_what_get_worker_info_answers():
    from torch.utils.data._utils import worker as torch_worker

    saved = torch_worker._worker_info
    try:
        set_worker_info(worker=1, num_workers=3, seed=7, dataset="d", strict=True)
        info = torch.utils.data.get_worker_info()
        assert info is not None
        assert (info.id, info.num_workers, info.seed, info.dataset) == (1, 3, 7, "d")
    finally:
        torch_worker._worker_info = saved


# --- bench ---


def test_dataloader_persistent_workers_pids_and_shutdown():
    import os

    from torch.utils.data import DataLoader

    from hpctrain.compat_torch import dataloader_worker_pids, shutdown_dataloader_workers

    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True)
    assert dataloader_worker_pids(loader, strict=True) == []  # none before the first epoch
    assert len(list(loader)) == 2
    pids = dataloader_worker_pids(loader, strict=True)
    assert len(pids) == 1 and os.path.exists(f"/proc/{pids[0]}")
    shutdown_dataloader_workers(loader, strict=True)
    assert not os.path.exists(f"/proc/{pids[0]}")  # joined (reaped), not left to the collector
    single = DataLoader(list(range(4)), batch_size=2)
    list(single)
    assert dataloader_worker_pids(single, strict=True) == []
    shutdown_dataloader_workers(single, strict=True)  # a no-op
