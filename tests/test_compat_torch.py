"""The private torch APIs behind `hpctrain.compat_torch` still work in this torch release.

A failure here names the torch version and the API: the fallback would hide it otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest
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


# --- ckpt ---


def test_dcp_classes_come_from_their_private_modules():
    from torch.distributed.checkpoint import _fsspec_filesystem, filesystem

    from hpctrain import compat_torch

    assert compat_torch.dcp_class("FsspecReader", strict=True) is _fsspec_filesystem.FsspecReader
    assert compat_torch.dcp_class("FsspecWriter", strict=True) is _fsspec_filesystem.FsspecWriter
    assert compat_torch.dcp_class("StorageInfo", strict=True) is filesystem._StorageInfo
    writer_transforms = compat_torch.dcp_class("StorageWriterTransforms", strict=True)
    assert writer_transforms is filesystem._StorageWriterTransforms
    assert hasattr(writer_transforms, "transform_save_stream")
    assert compat_torch.StorageInfo is filesystem._StorageInfo  # the lazy module attribute
    # The readers check item checksums in this hook: without it they would check nothing.
    assert callable(getattr(filesystem.FileSystemReader, "_slice_file", None))


def test_set_element_is_dcp_s_and_the_fallback_does_the_same():
    from hpctrain.compat_torch import _set_element, set_element

    for setter in (lambda *a: set_element(*a, strict=True), _set_element):
        root: dict = {"kept": 1}
        setter(root, ("a", "b", 1, "c"), 5)
        setter(root, ("top",), 7)
        assert root == {"kept": 1, "a": {"b": [None, {"c": 5}]}, "top": 7}


def test_metadata_path_is_the_one_the_reader_reads(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from hpctrain.compat_torch import metadata_path

    reader = FileSystemReader(str(tmp_path))
    assert str(metadata_path(reader, strict=True)) == str(tmp_path / ".metadata")
    assert str(metadata_path(reader, 2, strict=True)) == str(tmp_path / "__2.metadata")


def test_the_fallbacks_of_a_torch_without_them_give_the_same(tmp_path):
    import pytest
    from torch.distributed.checkpoint import FileSystemReader

    from hpctrain.compat_torch import metadata_path

    reader = FileSystemReader(str(tmp_path))

    class MovedReader:  # a reader of a torch without `_get_metadata_path`
        fs, path = reader.fs, reader.path

    with pytest.warns(RuntimeWarning, match="_get_metadata_path"):
        assert str(metadata_path(MovedReader(), 1)) == str(metadata_path(reader, 1, strict=True))


# --- tasks ---
def test_foreach_lerp_copy_and_mul_match_their_loops(monkeypatch):
    import pytest

    from hpctrain.compat_torch import foreach_copy_, foreach_lerp_, foreach_mul_

    weights = [torch.zeros(3), torch.ones(2)]
    foreach_lerp_(weights, [torch.full((3,), 4.0), torch.full((2,), 3.0)], 0.25, strict=True)
    assert weights[0].tolist() == [1.0] * 3 and weights[1].tolist() == [1.5] * 2
    foreach_copy_(weights, [torch.full((3,), 7.0), torch.full((2,), 8.0)], strict=True)
    assert weights[0].tolist() == [7.0] * 3 and weights[1].tolist() == [8.0] * 2
    foreach_mul_(weights, torch.tensor(0.5), strict=True)
    assert weights[0].tolist() == [3.5] * 3 and weights[1].tolist() == [4.0] * 2
    foreach_copy_(weights, [torch.full((3,), 7.0), torch.full((2,), 8.0)], strict=True)
    monkeypatch.delattr(torch, "_foreach_lerp_")  # a torch without it: the loop, and a warning
    with pytest.warns(RuntimeWarning, match="torch._foreach_lerp_"):
        foreach_lerp_(weights, [torch.zeros(3), torch.zeros(2)], 0.5)
    assert weights[1].tolist() == [4.0] * 2


def test_memory_history_and_snapshot_are_where_they_were():
    import inspect

    record = torch.cuda.memory._record_memory_history
    assert {"enabled", "max_entries", "stacks"} <= set(inspect.signature(record).parameters)
    assert callable(torch.cuda.memory._dump_snapshot)
    if torch.cuda.is_available():  # the calls themselves need a GPU
        from hpctrain.compat_torch import dump_memory_snapshot, record_memory_history

        assert record_memory_history(100, strict=True)
        record_memory_history(None, strict=True)
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            dump_memory_snapshot(f"{folder}/s.pickle", strict=True)


def test_checkpoint_wrapper_keeps_the_names_and_the_gradients():
    from torch import nn

    from hpctrain.compat_torch import checkpoint_wrapper

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapped = nn.Sequential(*[checkpoint_wrapper(m, strict=True) for m in plain])
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    plain.zero_grad()
    nn.Sequential(*[m._checkpoint_wrapped_module for m in wrapped])(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, plain.parameters(), strict=True))


def test_batchnorm_classes_cover_every_batchnorm_and_dynamo_answers():
    from torch import nn

    from hpctrain.compat_torch import batchnorm_classes, dynamo_supported

    classes = batchnorm_classes(strict=True)
    for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert issubclass(kind, classes)
    assert not issubclass(nn.LayerNorm, classes)
    assert isinstance(dynamo_supported(strict=True), bool)


COMPILE_WORKERS = """
import os, signal, sys, time
from torch._inductor.async_compile import AsyncCompile
from hpctrain.compat_torch import start_compile_workers
from hpctrain.distributed.signals import job_signals_blocked

def children(pid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found

def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

if __name__ == "__main__":
    with job_signals_blocked():  # as hpctrain.distributed.signals.start_compile_workers
        start_compile_workers(strict=True)
    (sidecar,) = children(os.getpid())
    for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        os.kill(sidecar, signum)
    pool = AsyncCompile.process_pool()  # the pool inductor compiles with: the one started
    assert pool.submit(AsyncCompile._get_ready).result(timeout=240) == "ready"
    workers = children(sidecar)  # forked by the sidecar for that job
    for pid in workers:
        for signum in (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1):
            os.kill(pid, signum)
    time.sleep(0.5)
    assert pool.submit(AsyncCompile._get_ready).result(timeout=240) == "ready"
    print(running(sidecar), len(workers), all(map(running, workers)), flush=True)
"""


@pytest.mark.slow  # a subprocess that starts inductor's compile workers: tens of seconds
def test_compile_workers_started_with_job_signals_blocked_survive_them():
    """Inductor's compile sidecar and its workers ignore only SIGINT; SLURM's USR2, TERM
    and USR1 reach every process of a job step. Started with them blocked (what
    `hpctrain.distributed.signals.start_compile_workers` does), they survive and compile on.
    (Started without: "SubprocPool closed" at the first job.)"""
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_WORKERS],
        capture_output=True,
        text=True,
        timeout=600,
        # a pool needs two compile threads or more (inductor's default: the CPUs, up to 32)
        env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sidecar_alive, num_workers, workers_alive = done.stdout.split()
    assert sidecar_alive == "True" and int(num_workers) >= 1 and workers_alive == "True"


def test_ddp_ignore_is_the_list_ddp_reads():
    from torch import nn

    from hpctrain import compat_torch

    module = nn.Linear(2, 2)
    compat_torch.ddp_ignore(module, ["weight"], strict=True)
    assert module._ddp_params_and_buffers_to_ignore == ["weight"]
    assert module.weight._ddp_ignored and not hasattr(module.bias, "_ddp_ignored")


def test_dispatch_mode_and_storage_identity_for_the_meta_build():
    from hpctrain.compat_torch import dispatch_mode_class, storage_key

    seen = []

    class Mode(dispatch_mode_class(strict=True)):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.device("meta"), Mode():
        weight = torch.nn.Parameter(torch.empty(3, 4))
        torch.nn.init.normal_(weight)
    assert seen == ["empty", "normal_"]
    # the Parameter and a view share their storage's key; another tensor has its own
    key = storage_key(weight, strict=True)
    assert key == storage_key(weight[1], strict=True)
    assert key != storage_key(torch.empty(3, 4, device="meta"), strict=True)
