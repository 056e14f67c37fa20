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


# --- tasks ---
def test_foreach_lerp_and_copy_match_their_loops(monkeypatch):
    import pytest

    from hpctrain.compat_torch import foreach_copy_, foreach_lerp_

    weights = [torch.zeros(3), torch.ones(2)]
    foreach_lerp_(weights, [torch.full((3,), 4.0), torch.full((2,), 3.0)], 0.25, strict=True)
    assert weights[0].tolist() == [1.0] * 3 and weights[1].tolist() == [1.5] * 2
    foreach_copy_(weights, [torch.full((3,), 7.0), torch.full((2,), 8.0)], strict=True)
    assert weights[0].tolist() == [7.0] * 3 and weights[1].tolist() == [8.0] * 2
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
