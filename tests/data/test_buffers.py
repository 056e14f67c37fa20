"""Workers' pooled shared-memory batch buffers: reused only once the trainer let go, handed
back through the worker's release pipe."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.buffers import BatchBuffers, MappedBuffers, PooledBatch, release
from tests.support.loader_kit import make_shards


@pytest.fixture
def ends():
    """A worker's buffers and the training process's side, joined by a release pipe (both
    in this process: the protocol is the same)."""
    reader, writer = mp.Pipe(duplex=False)
    os.set_blocking(writer.fileno(), False)
    yield (lambda keep=4: BatchBuffers(keep, reader)), MappedBuffers({os.getpid(): writer})
    reader.close()
    writer.close()


def images(first: int, n: int = 3) -> torch.Tensor:
    return torch.stack([torch.full((3, 2, 2), first + i, dtype=torch.uint8) for i in range(n)])


def send(pool: BatchBuffers, batch: dict[str, torch.Tensor], **rest) -> PooledBatch:
    """What a worker does with a batch: fill an allocated buffer, then name it for sending."""
    views, finish = pool.allocate([(k, tuple(v.shape), v.dtype) for k, v in batch.items()])
    for name, value in batch.items():
        views[name].copy_(value)
    return finish(rest)


def first_pixels(batch: torch.Tensor) -> list[int]:
    return batch[:, 0, 0, 0].tolist()


def test_a_buffer_is_reused_only_after_its_release_reached_the_worker(ends):
    make, mapped = ends
    pool = make()
    a = mapped.receive(send(pool, {"image": images(0)}))["image"]
    assert first_pixels(a) == [0, 1, 2]
    b = mapped.receive(send(pool, {"image": images(10)}))["image"]  # `a` held: a new buffer
    assert b.data_ptr() != a.data_ptr() and first_pixels(a) == [0, 1, 2]
    ptr = a.data_ptr()
    del a
    gc.collect()
    c = mapped.receive(send(pool, {"image": images(20)}))["image"]
    assert c.data_ptr() == ptr and first_pixels(c) == [20, 21, 22]


def test_every_field_shares_the_batch_buffer_and_holds_it(ends):
    make, mapped = ends
    pool = make()
    fields = {
        "image": images(0),
        "mask": torch.arange(12, dtype=torch.uint8).view(3, 2, 2),
        "depth": torch.rand(3, 5, dtype=torch.float64),
        "label": torch.tensor([1, 2, 3]),
        "valid": torch.tensor([True, False, True]),
        "half": torch.full((3, 2), 1.5, dtype=torch.bfloat16),  # a dtype numpy lacks
        "empty": torch.zeros(3, 0),
    }
    ref = send(pool, fields, key=["a", "b", "c"], caption=["x", "y", "z"])
    assert ref.buffer is not None and ref.buffer.is_shared()
    batch = mapped.receive(ref)
    assert batch["key"] == ["a", "b", "c"] and batch["caption"] == ["x", "y", "z"]
    for name, value in fields.items():
        assert batch[name].dtype == value.dtype and torch.equal(batch[name], value), name
    ptr = ref.buffer.data_ptr()
    for name in ("image", "mask", "depth", "label", "valid", "half"):
        offset = batch[name].data_ptr() - ptr
        assert 0 <= offset < ref.buffer.numel() and offset % 64 == 0
    kept = batch["valid"]  # one small field kept: the whole buffer stays lent
    del batch
    gc.collect()
    other = send(pool, fields)
    assert other.serial != ref.serial
    del kept
    gc.collect()
    assert send(pool, fields).serial == ref.serial


def test_a_buffer_travels_until_the_receiver_mapped_it(ends):
    make, mapped = ends
    pool = make()
    first = send(pool, {"image": images(0)})
    assert first.buffer is not None and first.buffer.is_shared()
    lent = mapped.receive(first)
    del lent
    gc.collect()
    again = send(pool, {"image": images(5)})  # the same buffer, now known on the other side
    assert (again.owner, again.serial) == (first.owner, first.serial) and again.buffer is None
    held = mapped.receive(again)
    assert first_pixels(held["image"]) == [5, 6, 7]
    new = send(pool, {"image": images(9)})  # a new buffer (the first one is held)
    assert new.buffer is not None and new.serial != first.serial
    with pytest.raises(RuntimeError, match="never received"):
        MappedBuffers().receive(again)


def test_the_pool_never_waits_and_forgets_beyond_keep(ends):
    make, mapped = ends
    pool = make(keep=2)
    held = [mapped.receive(send(pool, {"image": images(i * 10)})) for i in range(5)]
    assert len(pool.buffers) == 2 and len(mapped.mapped) == 2  # the receiver forgot them too
    assert [first_pixels(h["image"])[0] for h in held] == [0, 10, 20, 30, 40]
    del held
    gc.collect()  # late releases of forgotten buffers are ignored
    remembered = set(pool.buffers)
    for _ in range(3):
        ref = send(pool, {"image": images(0)})
        assert ref.serial in remembered
        mapped.receive(ref)  # dropped at once: released again
        gc.collect()


def test_a_larger_free_buffer_serves_a_smaller_batch(ends):
    make, mapped = ends
    pool = make()
    big = mapped.receive(send(pool, {"image": torch.zeros(4, 3, 64, 64, dtype=torch.uint8)}))
    del big
    gc.collect()
    small = send(pool, {"image": images(1)})
    assert small.serial == 1 and first_pixels(mapped.receive(small)["image"]) == [1, 2, 3]


def test_releases_come_from_any_thread_and_never_block(ends):
    make, mapped = ends
    pool = make()
    batch = mapped.receive(send(pool, {"image": images(0)}))
    box = [batch]
    del batch
    thread = threading.Thread(target=box.clear)  # e.g. the pinning thread drops a batch
    thread.start()
    thread.join()
    gc.collect()
    assert send(pool, {"image": images(1)}).serial == 1
    writer = mapped.releases[os.getpid()]
    for _ in range(100_000):  # far more than a pipe holds: the excess is lost, not waited on
        release(writer, 12345)
    writer.close()
    release(writer, 1)  # a closed pipe (workers stopped): nothing happens


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
        for key, image, label in zip(batch["key"], batch["png"], batch["cls"], strict=True):
            value = int(key[1:5]) * 1000 + int(key[6:])
            assert image[:, 0, 0].tolist() == [value % 256, value // 256 % 256, 0]
            assert int(label) == value % 7
    assert len(loader._pool.buffers.mapped) <= 2 * (data.prefetch_factor + 3)
    loader.close()


def test_steady_state_batches_arrive_without_their_buffers(tmp_path, monkeypatch):
    """Persistent workers: after the first epoch every batch is a handle to a mapped buffer."""
    from hpctrain.data import buffers

    make_shards(tmp_path, [16, 16])
    data = DataConfig(batch_size=4, workers_per_rank=2, shuffle_buffer=0, persistent_workers=True)
    loader = ShardedLoader(open_index(str(tmp_path)), data, rank=0, world_size=1, seed=0)
    received = []
    real = buffers.MappedBuffers.receive

    def spy(self, ref):
        received.append((loader.epoch, ref.buffer is not None))
        return real(self, ref)

    monkeypatch.setattr(buffers.MappedBuffers, "receive", spy)
    first = [b["key"] for b in loader]
    loader.set_epoch(0)  # the same epoch again, through the same workers
    assert [b["key"] for b in loader] == first
    loader.close()
    again = [with_buffer for epoch, with_buffer in received[len(first) :]]
    # a worker that runs ahead while the trainer still holds two batches may make one more
    # buffer (it never waits for one); beyond that every batch is a handle to a mapped buffer
    assert len(again) == len(first) and sum(again) <= 2, again
