"""Workers' reused shared-memory batch buffers: reused only once the trainer let go."""

from __future__ import annotations

import gc

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.loader import BatchBuffers
from tests.data.loader_testkit import make_shards


def images(first: int, n: int = 3) -> list[torch.Tensor]:
    return [torch.full((3, 2, 2), first + i, dtype=torch.uint8) for i in range(n)]


def test_a_buffer_is_reused_only_after_release():
    pool = BatchBuffers(keep=4)
    a = pool.stack(images(0))
    assert BatchBuffers.is_pooled(a) and a.is_shared() and a[:, 0, 0, 0].tolist() == [0, 1, 2]
    b = pool.stack(images(10))  # `a` not released: a new buffer
    assert b.data_ptr() != a.data_ptr() and a[:, 0, 0, 0].tolist() == [0, 1, 2]
    BatchBuffers.release(a)
    c = pool.stack(images(20))
    assert c.data_ptr() == a.data_ptr() and c[:, 0, 0, 0].tolist() == [20, 21, 22]
    assert not BatchBuffers.is_pooled(torch.stack(images(0)))


def test_a_lent_batch_is_released_when_its_last_view_is_gone():
    pool = BatchBuffers(keep=4)
    sent = pool.stack(images(0))
    lent = BatchBuffers.lend(sent)
    view = lent[1]
    del lent
    gc.collect()
    other = pool.stack(images(50))  # a view is still alive: the buffer is not reused
    assert other.data_ptr() != sent.data_ptr() and view[0, 0, 0] == 1
    del view
    gc.collect()
    again = pool.stack(images(70))
    assert again.data_ptr() == sent.data_ptr()


def test_the_pool_never_waits_and_forgets_beyond_keep():
    pool = BatchBuffers(keep=2)
    held = [pool.stack(images(i * 10)) for i in range(5)]
    assert len(pool.buffers) == 2
    assert [int(h[0, 0, 0, 0]) for h in held] == [0, 10, 20, 30, 40]
    pool.stack([torch.zeros(3, 4, 4, dtype=torch.uint8)] * 3)  # another shape: a new buffer
    with pytest.raises(RuntimeError):
        pool.stack(
            [torch.zeros(3, 2, 2, dtype=torch.uint8), torch.zeros(3, 4, 4, dtype=torch.uint8)]
        )


def test_batches_kept_by_the_trainer_are_never_overwritten(tmp_path):
    sizes = [12, 12, 12, 12]
    make_shards(tmp_path, sizes)
    data = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=0, persistent_workers=True)
    loader = ShardedLoader(open_index(str(tmp_path)), data, rank=0, world_size=1, seed=0)
    kept = list(loader)  # every batch held at once: buffers cannot be reused under them
    for _ in range(2):  # more epochs through dropped batches: buffers reused
        loader.set_epoch(loader.epoch + 1)
        for batch in loader:
            del batch
    assert loader._dataset.pool_batches
    for batch in kept:
        for key, image in zip(batch["key"], batch["image"], strict=True):
            value = int(key[1:5]) * 1000 + int(key[6:])
            assert image[:, 0, 0].tolist() == [value % 256, value // 256 % 256, 0]
