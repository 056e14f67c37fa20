"""Workers' reused shared-memory batch buffers: reused only once the trainer let go."""

from __future__ import annotations

import gc

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.loader import BatchBuffers, MappedBuffers, PooledBatch
from tests.data.loader_testkit import make_shards


def images(first: int, n: int = 3) -> list[torch.Tensor]:
    return [torch.full((3, 2, 2), first + i, dtype=torch.uint8) for i in range(n)]


def stack(pool: BatchBuffers, batch: list[torch.Tensor]) -> PooledBatch:
    """What a worker does with a batch: fill an acquired buffer, then name it for sending."""
    out, send = pool.acquire((len(batch), *batch[0].shape), batch[0].dtype)
    torch.stack(batch, out=out)
    return send()


def first_pixels(batch: torch.Tensor) -> list[int]:
    return batch[:, 0, 0, 0].tolist()


def test_a_buffer_is_reused_only_after_release():
    pool, mapped = BatchBuffers(keep=4), MappedBuffers()
    a = mapped.receive(stack(pool, images(0)))
    assert first_pixels(a) == [0, 1, 2]
    b = mapped.receive(stack(pool, images(10)))  # `a` still held: a new buffer
    assert b.data_ptr() != a.data_ptr() and first_pixels(a) == [0, 1, 2]
    ptr = a.data_ptr()
    del a
    gc.collect()
    c = mapped.receive(stack(pool, images(20)))
    assert c.data_ptr() == ptr and first_pixels(c) == [20, 21, 22]


def test_a_buffer_travels_until_the_receiver_mapped_it():
    pool, mapped = BatchBuffers(keep=4), MappedBuffers()
    first = stack(pool, images(0))
    assert first.buffer is not None and first.buffer.is_shared()
    lent = mapped.receive(first)
    del lent
    gc.collect()
    again = stack(pool, images(5))  # the same buffer, now known on the other side
    assert (again.owner, again.serial) == (first.owner, first.serial) and again.buffer is None
    held = mapped.receive(again)
    assert first_pixels(held) == [5, 6, 7]
    new = stack(pool, images(9))  # a new buffer (the first one is held), never received yet
    assert new.buffer is not None and new.serial != first.serial
    with pytest.raises(RuntimeError, match="never received"):
        MappedBuffers().receive(again)


def test_a_lent_batch_is_released_when_its_last_view_is_gone():
    pool, mapped = BatchBuffers(keep=4), MappedBuffers()
    lent = mapped.receive(stack(pool, images(0)))
    ptr = lent.data_ptr()
    view = lent[1]
    del lent
    gc.collect()
    other = mapped.receive(stack(pool, images(50)))  # a view is alive: no reuse
    assert other.data_ptr() != ptr and view[0, 0, 0] == 1
    del view
    gc.collect()
    assert mapped.receive(stack(pool, images(70))).data_ptr() == ptr


def test_the_pool_never_waits_and_forgets_beyond_keep():
    pool, mapped = BatchBuffers(keep=2), MappedBuffers()
    held = [mapped.receive(stack(pool, images(i * 10))) for i in range(5)]
    assert len(pool.buffers) == 2 and len(mapped.mapped) == 2  # the receiver forgot them too
    assert [first_pixels(h)[0] for h in held] == [0, 10, 20, 30, 40]
    stack(pool, [torch.zeros(3, 4, 4, dtype=torch.uint8)] * 3)  # another shape: a new buffer
    with pytest.raises(RuntimeError):
        stack(
            pool, [torch.zeros(3, 2, 2, dtype=torch.uint8), torch.zeros(3, 4, 4, dtype=torch.uint8)]
        )


def test_a_dtype_numpy_lacks_is_copied_out_and_released_at_once():
    pool, mapped = BatchBuffers(keep=4), MappedBuffers()
    batch = [torch.full((2, 2), i, dtype=torch.bfloat16) for i in range(3)]
    lent = mapped.receive(stack(pool, batch))
    assert lent.dtype == torch.bfloat16 and lent[:, 0, 0].tolist() == [0, 1, 2]
    again = stack(pool, batch)  # released already: the same buffer, without the descriptor
    assert again.serial == 1 and again.buffer is None


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
    for batch in kept:
        for key, image in zip(batch["key"], batch["image"], strict=True):
            value = int(key[1:5]) * 1000 + int(key[6:])
            assert image[:, 0, 0].tolist() == [value % 256, value // 256 % 256, 0]
    assert len(loader._mapped.mapped) <= 2 * (data.prefetch_factor + 2)


def test_steady_state_batches_arrive_without_their_buffers(tmp_path, monkeypatch):
    """Persistent workers: after the first epoch every batch is a handle to a mapped buffer."""
    from hpctrain.data import loader as loader_module

    make_shards(tmp_path, [16, 16])
    data = DataConfig(batch_size=4, workers_per_rank=2, shuffle_buffer=0, persistent_workers=True)
    loader = ShardedLoader(open_index(str(tmp_path)), data, rank=0, world_size=1, seed=0)
    received = []
    real = loader_module.MappedBuffers.receive

    def spy(self, ref):
        received.append((loader.epoch, ref.buffer is not None))
        return real(self, ref)

    monkeypatch.setattr(loader_module.MappedBuffers, "receive", spy)
    first = [b["key"] for b in loader]
    loader.set_epoch(0)  # the same epoch again, through the same workers
    assert [b["key"] for b in loader] == first
    loader.close()
    assert [with_buffer for epoch, with_buffer in received[len(first) :]] == [False] * len(first)
