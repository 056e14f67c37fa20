"""ShardedLoader on real tar shards: content, equal batches, exact and elastic resume."""

from __future__ import annotations

import tarfile
import threading
import time
from collections import Counter

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, ShardReadError, open_index
from hpctrain.data.collate import BatchError
from tests.support.loader_kit import all_keys, make_shards, sample_key


def cfg(**kw):
    base = dict(batch_size=4, workers_per_rank=0, shuffle_buffer=0, persistent_workers=False)
    base.update(kw)
    return DataConfig(**base)


def keys_of(batches):
    return [k for b in batches for k in b["key"]]


def expected_keys(loader):
    p = loader.plan()
    return [sample_key(s, i) for s, i, _v in p.rank_order(loader.rank)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    sizes = [13, 7, 20, 1, 9]
    root = tmp_path_factory.mktemp("shards")
    make_shards(root, sizes)
    return root, sizes


def test_batches_hold_every_field_uint8_images_labels_keys_in_plan_order(shards):
    root, sizes = shards
    index = open_index(str(root))
    loader = ShardedLoader(index, cfg(shuffle_buffer=5), rank=0, world_size=1, seed=3)
    batches = list(loader)
    assert len(batches) == len(loader) == sum(sizes) // 4
    b = batches[0]
    assert set(b) == {"png", "cls", "key", "valid"}
    assert b["png"].dtype == torch.uint8 and b["png"].shape == (4, 3, 8, 8)
    assert b["cls"].dtype == torch.int64 and b["valid"].dtype == torch.bool and b["valid"].all()
    assert keys_of(batches) == expected_keys(loader)
    for batch in batches:
        for key, label, image in zip(batch["key"], batch["cls"], batch["png"], strict=True):
            shard, i = int(key[1:5]), int(key[6:])
            value = shard * 1000 + i
            assert int(label) == value % 7
            assert image[:, 0, 0].tolist() == [value % 256, value // 256 % 256, 0]


def test_two_workers_round_robin_matches_plan_and_epochs_differ(shards):
    root, sizes = shards
    index = open_index(str(root / "index.json"))
    loader = ShardedLoader(
        index,
        cfg(workers_per_rank=2, shuffle_buffer=4, persistent_workers=True),
        rank=1,
        world_size=2,
        seed=0,
    )
    first = keys_of(loader)
    assert first == expected_keys(loader)
    loader.set_epoch(1)
    second = keys_of(loader)
    assert second == expected_keys(loader) and second != first
    assert len(first) == len(second) == (sum(sizes) // 8) * 4


@pytest.mark.parametrize(("workers", "stop"), [(0, 5), (0, 1), (0, 11), (2, 5), (2, 6), (3, 4)])
def test_exact_resume_gives_identical_remaining_batches(shards, workers, stop):
    root, _ = shards
    index = open_index(str(root))
    c = cfg(workers_per_rank=workers, shuffle_buffer=6)
    straight = ShardedLoader(index, c, rank=0, world_size=1, seed=5)
    straight.set_epoch(2)
    full = list(straight)
    first = ShardedLoader(index, c, rank=0, world_size=1, seed=5)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    resumed = ShardedLoader(index, c, rank=0, world_size=1, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what a trainer does at the top of its epoch loop: keeps position
    assert resumed.position == stop and len(resumed) == len(full)
    rest = list(resumed)
    assert len(rest) == len(full) - stop
    for a, b in zip(full[stop:], rest, strict=True):
        assert a["key"] == b["key"]
        assert torch.equal(a["png"], b["png"]) and torch.equal(a["cls"], b["cls"])


@pytest.mark.parametrize(
    ("old", "new"), [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 2), (1, 0))]
)
def test_elastic_resume_sees_every_sample_once(tmp_path, old, new):
    sizes = [8, 8, 8, 8, 8, 8]  # 48 samples: no drop with batch 4 on 1 or 2 ranks
    make_shards(tmp_path, sizes)
    index = open_index(str(tmp_path))
    (w0, k0), (w1, k1) = old, new
    seen: list[str] = []
    states = []
    for rank in range(w0):
        loader = ShardedLoader(
            index, cfg(workers_per_rank=k0, shuffle_buffer=5), rank=rank, world_size=w0, seed=1
        )
        it = iter(loader)
        for _ in range(3):
            seen.extend(next(it)["key"])
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # ranks agree: any rank's state will do
    for rank in range(w1):
        loader = ShardedLoader(
            index, cfg(workers_per_rank=k1, shuffle_buffer=5), rank=rank, world_size=w1, seed=1
        )
        loader.load_state_dict(states[0])
        batches = list(loader)
        assert loader.position == len(loader)
        # the re-plan pads (flagged) rather than drop what the epoch still owes
        seen += [k for b in batches for k, ok in zip(b["key"], b["valid"], strict=True) if ok]
    counts = Counter(seen)
    assert set(counts) == all_keys(sizes) and set(counts.values()) == {1}


def test_augmentations_are_seeded_per_sample(shards):
    root, _ = shards
    index = open_index(str(root))

    def draw(sample):
        sample["label"] = int(torch.randint(0, 2**62, ()))
        return sample

    def run(workers, world_size, rank):
        loader = ShardedLoader(
            index,
            cfg(workers_per_rank=workers),
            rank=rank,
            world_size=world_size,
            seed=9,
            transform=draw,
        )
        return {k: int(v) for b in loader for k, v in zip(b["key"], b["label"], strict=True)}

    one = run(0, 1, 0)
    assert len(set(one.values())) == len(one)  # differ across samples (and so across workers)
    again = run(2, 2, 0) | run(2, 2, 1)
    assert all(one[k] == v for k, v in again.items())  # repeat across runs, workers, ranks


def test_eval_pads_with_invalid_samples(shards):
    root, sizes = shards
    index = open_index(str(root))
    seen = []
    lengths = set()
    for rank in range(3):
        loader = ShardedLoader(
            index, cfg(batch_size=4), rank=rank, world_size=3, seed=0, train=False
        )
        batches = list(loader)
        lengths.add(len(batches))
        seen += [k for b in batches for k, ok in zip(b["key"], b["valid"], strict=True) if ok]
    assert lengths == {-(-sum(sizes) // 12)}
    assert sorted(seen) == sorted(all_keys(sizes))


def test_pax_shards_and_json_meta(tmp_path):
    make_shards(tmp_path, [5, 6], fmt=tarfile.PAX_FORMAT, with_json=True)
    metas = []

    def keep_meta(sample):
        metas.append(sample["json"])
        return sample

    loader = ShardedLoader(
        open_index(str(tmp_path)),
        cfg(batch_size=1),
        rank=0,
        world_size=1,
        seed=0,
        transform=keep_meta,
    )
    assert sorted(keys_of(loader)) == sorted(all_keys([5, 6]))
    assert {"shard": 1, "i": 5} in metas


def test_shard_pattern_and_missing_shard(tmp_path):
    make_shards(tmp_path, [3, 4, 5])
    index = open_index(str(tmp_path / "train-{000000..000002}.tar"))
    assert [s.num_samples for s in index.shards] == [3, 4, 5]
    (tmp_path / "train-000001.tar").unlink()
    loader = ShardedLoader(index, cfg(batch_size=2), rank=0, world_size=1, seed=0, train=False)
    with pytest.raises(ShardReadError, match="train-000001.tar: not found"):
        list(loader)


def test_corrupt_shard_fails_or_is_skipped_and_counted(tmp_path):
    sizes = [6, 6, 6]
    make_shards(tmp_path, sizes)
    path = tmp_path / "train-000001.tar"
    data = bytearray(path.read_bytes())
    # damage the header of the 4th member (sample 1's .cls): checksum mismatch
    blocks = [i for i in range(0, 4096, 512) if data[i : i + 5] == b"s0001"]
    data[blocks[3] + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    index = open_index(str(tmp_path))
    with pytest.raises(ShardReadError, match="train-000001.tar: bad tar header checksum"):
        list(ShardedLoader(index, cfg(batch_size=3), rank=0, world_size=1, seed=0))
    loader = ShardedLoader(index, cfg(batch_size=3, on_error="skip"), rank=0, world_size=1, seed=0)
    batches = list(loader)
    assert len(batches) == 6  # the rank is never left short
    valid = [k for b in batches for k, ok in zip(b["key"], b["valid"], strict=True) if ok]
    assert len(valid) == 13  # sample 0 of shard 1 was read before the damage
    assert loader.stats()["samples_lost"] == 5 and loader.stats()["shards_failed"] == 1


def test_resume_skips_without_decoding(shards):
    root, _ = shards
    index = open_index(str(root))
    c = cfg(shuffle_buffer=6)
    first = ShardedLoader(index, c, rank=0, world_size=1, seed=4)
    it = iter(first)
    for _ in range(4):
        next(it)
    calls = []

    def count(sample):
        calls.append(sample["key"])
        return sample

    resumed = ShardedLoader(index, c, rank=0, world_size=1, seed=4, transform=count)
    resumed.load_state_dict(first.state_dict())
    rest = keys_of(resumed)
    assert calls == rest  # only the samples handed out were decoded and transformed
    assert len(rest) == (len(resumed) - 4) * 4


def test_breaking_out_and_iterating_again_continues_with_persistent_workers(shards):
    root, _ = shards
    index = open_index(str(root))
    c = cfg(workers_per_rank=2, shuffle_buffer=3, persistent_workers=True)
    full = keys_of(ShardedLoader(index, c, rank=0, world_size=1, seed=8))
    loader = ShardedLoader(index, c, rank=0, world_size=1, seed=8)
    got = []
    for i, batch in enumerate(loader):  # e.g. an evaluation interrupts the epoch
        got += batch["key"]
        if i == 2:
            break
    got += keys_of(loader)
    assert got == full


def test_worker_pids_name_the_persistent_workers_until_close(shards):
    root, _ = shards
    index = open_index(str(root))
    c = cfg(workers_per_rank=2, persistent_workers=True)
    loader = ShardedLoader(index, c, rank=0, world_size=1, seed=0)
    assert loader.worker_pids == []
    keys_of(loader)
    pids = loader.worker_pids
    assert len(pids) == 2 and all(isinstance(p, int) and p > 0 for p in pids)
    loader.set_epoch(1)
    keys_of(loader)
    assert loader.worker_pids == pids  # persistent: the same processes
    loader.close()
    assert loader.worker_pids == []


@pytest.mark.parametrize("new_workers", [0, 1])
def test_state_saved_after_the_last_batch_resumes_into_the_next_epoch(shards, new_workers):
    root, _ = shards
    index = open_index(str(root))
    loader = ShardedLoader(index, cfg(), rank=0, world_size=1, seed=1)
    loader.set_epoch(3)
    epoch3 = keys_of(loader)
    state = loader.state_dict()
    resumed = ShardedLoader(index, cfg(workers_per_rank=new_workers), rank=0, world_size=1, seed=1)
    resumed.load_state_dict(state)
    assert resumed.epoch == 3 and resumed.position == len(resumed)
    assert keys_of(resumed) == []  # epoch 3 is done: a trainer moves on
    resumed.set_epoch(4)
    epoch4 = keys_of(resumed)
    assert len(epoch4) == len(epoch3) and epoch4 != epoch3


def test_evaluation_loader_reruns_the_same_epoch(shards):
    root, _ = shards
    loader = ShardedLoader(open_index(str(root)), cfg(), rank=0, world_size=1, seed=1, train=False)
    loader.set_epoch(0)
    first = keys_of(loader)
    loader.set_epoch(0)  # as a trainer does before each evaluation
    assert keys_of(loader) == first and len(first) > 0


def _child_pids() -> list[int]:
    import os
    from pathlib import Path

    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended while we looked
            continue
    return pids


def test_workers_survive_the_job_signals_slurm_sends_to_every_step_process(shards):
    """SLURM sends USR2/TERM to every process of a step; the training process handles them."""
    import os
    import signal

    root, _sizes = shards
    loader = ShardedLoader(
        open_index(str(root / "index.json")), cfg(workers_per_rank=2), rank=0, world_size=1, seed=0
    )
    loader.set_epoch(0)
    before = set(_child_pids())  # other tests may have left servers running
    it = iter(loader)
    first: list = []
    starting = threading.Thread(target=lambda: first.append(next(it)))
    starting.start()  # the pool starts its workers here, while this thread watches
    # at once, as SLURM may: a worker still starting up (before its own handlers) survives
    # too, because workers start with the job's signals blocked
    workers: list[int] = []
    deadline = time.monotonic() + 60
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = sorted(set(_child_pids()) - before)
        for pid in workers:
            os.kill(pid, signal.SIGUSR2)
            os.kill(pid, signal.SIGTERM)
    starting.join()
    assert len(workers) == 2
    batches = first + list(it)
    assert len(batches) == len(loader)
    assert keys_of(batches) == expected_keys(loader)


def test_a_worker_with_nothing_readable_fills_its_batches_from_another_shard(tmp_path):
    make_shards(tmp_path, [6, 6])
    path = tmp_path / "train-000000.tar"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # the first header: nothing of shard 0 can be read
    path.write_bytes(bytes(data))
    c = cfg(batch_size=3, workers_per_rank=2, on_error="skip")
    loader = ShardedLoader(open_index(str(tmp_path)), c, rank=0, world_size=1, seed=0)
    batches = list(loader)
    assert len(batches) == 4 and loader.stats()["samples_lost"] == 6
    lost = [b for b in batches if not any(b["valid"])]
    assert len(lost) == 2  # shard 0's worker: a stand-in sample, flagged invalid
    assert all(k == sample_key(1, 0) for b in lost for k in b["key"])
    filler = next(b for b in batches if sample_key(1, 0) in b["key"] and any(b["valid"]))
    first = filler["png"][filler["key"].index(sample_key(1, 0))]
    assert all(torch.equal(image, first) for b in lost for image in b["png"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_returning_several_sizes_is_a_clear_error(shards, workers):
    root, _ = shards

    def uneven(sample):
        side = 4 + int(sample["key"][-1]) % 2
        sample["png"] = sample["png"][:, :side, :side]
        return sample

    loader = ShardedLoader(
        open_index(str(root)),
        cfg(workers_per_rank=workers),
        rank=0,
        world_size=1,
        seed=0,
        transform=uneven,
    )
    shape = r"\[3, [45], [45]\] torch.uint8 in sample 's\d{4}-\d{5}'"
    error = f"field 'png' differs within a batch: {shape}, {shape}; the transform must"
    with pytest.raises(BatchError, match=error):
        list(loader)


def test_a_resume_onto_shards_replaced_in_place_is_refused_or_starts_the_next_epoch(tmp_path):
    # The same shard and sample counts, other contents (re-converted in place): read by
    # position, the rest of the epoch would be other samples. Mixtures: test_mixture_loader.
    from hpctrain.data.loader import LoaderStateError

    sizes = [13, 7, 20]
    make_shards(tmp_path, sizes)
    first = ShardedLoader(open_index(str(tmp_path)), cfg(), rank=0, world_size=1, seed=1)
    first.set_epoch(2)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    same = ShardedLoader(open_index(str(tmp_path)), cfg(), rank=0, world_size=1, seed=1)
    same.load_state_dict(state)  # the shards untouched: an exact resume
    assert same.position == 2
    make_shards(tmp_path, sizes, with_json=True)  # re-converted: a json member more
    index = open_index(str(tmp_path))
    refused = ShardedLoader(index, cfg(), rank=0, world_size=1, seed=1)
    with pytest.raises(LoaderStateError) as info:
        refused.load_state_dict(state)
    message = str(info.value)
    assert message.startswith(
        "data.train changed since the checkpoint (the same 3 shards and 40 samples, other "
        "contents: shard list sha256 "
    )
    assert "data.resume_changed=new_epoch to end epoch 2 at the checkpoint" in message
    # the way on: epoch 2 ends at the checkpoint, epoch 3 plans the new shards
    moved_on = ShardedLoader(index, cfg(resume_changed="new_epoch"), rank=0, world_size=1, seed=1)
    moved_on.load_state_dict(state)
    assert list(moved_on) == [] and moved_on.epoch == 2
    moved_on.set_epoch(3)
    assert len(keys_of(moved_on)) == 40 // 4 * 4
    # another shard count: the same rule, the counts named
    make_shards(tmp_path, [*sizes, 5])
    with pytest.raises(LoaderStateError, match=r"\(3 -> 4 shards, 40 -> 45 samples\)"):
        ShardedLoader(
            open_index(str(tmp_path)), cfg(), rank=0, world_size=1, seed=1
        ).load_state_dict(state)


def test_a_state_saved_before_dropped_samples_rotated_finishes_its_epoch_as_planned(shards):
    from hpctrain.data import plan

    root, sizes = shards
    index = open_index(str(root))
    loader = ShardedLoader(index, cfg(), rank=0, world_size=1, seed=4)
    loader.set_epoch(3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del state["drop_rotation_from"], state["index_digest"]  # as the loader saved it then
    resumed = ShardedLoader(index, cfg(), rank=0, world_size=1, seed=4)
    resumed.load_state_dict(state)
    old = plan(
        sizes, world_size=1, workers_per_rank=0, batch_size=4, seed=4, epoch=3, rotate_dropped=False
    )
    assert keys_of(resumed) == [sample_key(s, i) for s, i, _v in old.rank_order(0)][4:]
    resumed.set_epoch(4)  # the next epoch rotates
    assert keys_of(resumed) == expected_keys(resumed)
    assert resumed.state_dict()["drop_rotation_from"] == 4
