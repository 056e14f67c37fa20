"""General samples through the loader (issue #12): every field of multi-field samples comes
out exactly as written, with 0 and 2 workers, across resumes, fillers, padding, bombs and a
Task's own decode and collate."""

from __future__ import annotations

import gc
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data import SampleError, ShardedLoader, open_index
from hpctrain.data.collate import BatchError
from tests.support.sample_kit import (
    bomb_png,
    expected_fields,
    field_mismatches,
    multi_key,
    png,
    rgb,
    seed_of,
    write_multi_field_shards,
)

SIZES = [7, 5, 9, 3]
FIELDS = {"img.jpg", "mask.png", "depth.npy", "json", "txt", "left.jpg", "right.jpg", "cls"}


def cfg(**kw) -> DataConfig:
    base = dict(batch_size=4, workers_per_rank=0, shuffle_buffer=0, persistent_workers=False)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multi")
    write_multi_field_shards(root, SIZES)
    return root


def all_multi_keys(sizes=SIZES) -> set[str]:
    return {multi_key(s, i) for s, n in enumerate(sizes) for i in range(n)}


def valid_keys(batches) -> list[str]:
    return [k for b in batches for k, ok in zip(b["key"], b["valid"].tolist(), strict=True) if ok]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_field_round_trips_exactly(shards, workers):
    index = open_index(str(shards))
    loader = ShardedLoader(
        index, cfg(workers_per_rank=workers, shuffle_buffer=5), rank=0, world_size=1, seed=1
    )
    batches = list(loader)
    loader.close()
    assert len(batches) == sum(SIZES) // 4
    b = batches[0]
    assert set(b) == FIELDS | {"key", "valid"}
    assert b["img.jpg"].shape == (4, 3, 6, 5) and b["img.jpg"].dtype == torch.uint8
    assert b["mask.png"].shape == (4, 6, 5) and b["mask.png"].dtype == torch.uint8
    assert b["depth.npy"].shape == (4, 6, 5) and b["depth.npy"].dtype == torch.float32
    assert b["cls"].dtype == torch.int64 and b["valid"].dtype == torch.bool
    assert isinstance(b["json"], list) and isinstance(b["txt"], list)
    for batch in batches:
        assert not field_mismatches(batch)
    if workers:  # every tensor field of a batch lies in one pooled buffer of a worker
        for batch in batches:
            tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
            lo = min(t.data_ptr() for t in tensors)
            hi = max(t.data_ptr() + t.nbytes for t in tensors)
            assert hi - lo <= sum(-(-t.nbytes // 64) * 64 for t in tensors)


def test_python_scalars_become_tensors_and_the_rest_lists(shards):
    def add_fields(sample):
        seed = seed_of(sample["key"])
        return {
            "mask.png": sample["mask.png"],
            "flag": seed % 2 == 0,
            "count": seed,
            "score": seed / 10,
            "name": f"n{seed}",
            "blob": bytes([seed % 256]),
            "meta": {"seed": seed},
            "nothing": None,
            "key": "a transform's key is ignored",
        }

    loader = ShardedLoader(
        open_index(str(shards)), cfg(), rank=0, world_size=1, seed=0, transform=add_fields
    )
    batch = next(iter(loader))
    seeds = [seed_of(k) for k in batch["key"]]
    assert batch["flag"].dtype == torch.bool and batch["flag"].tolist() == [
        s % 2 == 0 for s in seeds
    ]
    assert batch["count"].dtype == torch.int64 and batch["count"].tolist() == seeds
    assert batch["score"].dtype == torch.float64 and batch["score"].tolist() == [
        s / 10 for s in seeds
    ]
    assert batch["name"] == [f"n{s}" for s in seeds]
    assert batch["blob"] == [bytes([s % 256]) for s in seeds]
    assert batch["meta"] == [{"seed": s} for s in seeds] and batch["nothing"] == [None] * 4
    assert batch["key"] == [multi_key(seed // 1000, seed % 1000) for seed in seeds]
    assert all(
        k in all_multi_keys() for k in batch["key"]
    )  # the loader's keys, not the transform's


@pytest.mark.parametrize(("workers", "stop"), [(0, 2), (2, 3)])
def test_exact_resume_gives_identical_fields(shards, workers, stop):
    index = open_index(str(shards))
    c = cfg(workers_per_rank=workers, shuffle_buffer=6)
    full = list(ShardedLoader(index, c, rank=0, world_size=1, seed=5))
    first = ShardedLoader(index, c, rank=0, world_size=1, seed=5)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    first.close()
    resumed = ShardedLoader(index, c, rank=0, world_size=1, seed=5)
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    assert len(rest) == len(full) - stop
    for a, b in zip(full[stop:], rest, strict=True):
        assert a["key"] == b["key"] and a["json"] == b["json"] and a["txt"] == b["txt"]
        for name in ("img.jpg", "mask.png", "depth.npy", "left.jpg", "right.jpg", "cls", "valid"):
            assert torch.equal(a[name], b[name]), name


def test_elastic_resume_two_ranks_to_one_sees_every_sample_once(tmp_path):
    sizes = [8, 8, 8, 8]  # 32 samples: no drop with batch 4 on 1 or 2 ranks
    write_multi_field_shards(tmp_path, sizes)
    index = open_index(str(tmp_path))
    seen: list[str] = []
    states = []
    for rank in range(2):
        loader = ShardedLoader(
            index, cfg(workers_per_rank=1, shuffle_buffer=3), rank=rank, world_size=2, seed=2
        )
        it = iter(loader)
        for _ in range(2):
            batch = next(it)
            assert not field_mismatches(batch)
            seen += valid_keys([batch])
        states.append(loader.state_dict())
        loader.close()
    loader = ShardedLoader(index, cfg(workers_per_rank=2), rank=0, world_size=1, seed=2)
    loader.load_state_dict(states[0])
    rest = list(loader)
    loader.close()
    for batch in rest:
        assert not field_mismatches(batch)
    counts = Counter(seen + valid_keys(rest))
    assert set(counts) == all_multi_keys(sizes) and set(counts.values()) == {1}


def test_eval_padding_repeats_every_field_flagged_invalid(shards):
    seen = []
    for rank in range(3):
        loader = ShardedLoader(
            open_index(str(shards)), cfg(batch_size=3), rank=rank, world_size=3, seed=0, train=False
        )
        for batch in loader:
            assert set(batch) == FIELDS | {"key", "valid"}
            assert not field_mismatches(batch)  # padding repeats real samples, all fields
            seen += valid_keys([batch])
    assert sorted(seen) == sorted(all_multi_keys())


BROKEN = {
    multi_key(0, 1): {"mask.png": b"\x89PNG\r\n\x1a\n broken"},
    multi_key(1, 3): {"depth.npy": b"not an array"},
}


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_samples_fail_naming_key_shard_and_field(tmp_path, workers):
    write_multi_field_shards(tmp_path, SIZES, replace=BROKEN)
    loader = ShardedLoader(
        open_index(str(tmp_path)),
        cfg(workers_per_rank=workers),
        rank=0,
        world_size=1,
        seed=0,
        train=False,
    )
    with pytest.raises(SampleError) as info:
        list(loader)
    loader.close()
    message = str(info.value)
    assert "multi-00000" in message and "sample 'm000-0001': field 'mask.png'" in message


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_samples_are_skipped_counted_and_filled_invalid(tmp_path, workers):
    write_multi_field_shards(tmp_path, SIZES, replace=BROKEN)
    loader = ShardedLoader(
        open_index(str(tmp_path)),
        cfg(workers_per_rank=workers, on_error="skip"),
        rank=0,
        world_size=1,
        seed=0,
    )
    batches = list(loader)
    loader.close()
    assert len(batches) == sum(SIZES) // 4  # the rank is never left short
    assert loader.stats()["samples_skipped"] == 2 and loader.stats()["samples_lost"] == 0
    kept = valid_keys(batches)
    assert not set(BROKEN) & set(kept)
    assert Counter(kept) == Counter(set(kept))  # each kept sample once
    fillers = 0
    for batch in batches:
        assert not field_mismatches(batch)  # fillers carry a good sample's every field
        for pos, ok in enumerate(batch["valid"].tolist()):
            if not ok:
                fillers += 1
                good = batch["key"].index(batch["key"][pos])
                assert batch["valid"][good]  # the good sample it copies is in the batch
    assert fillers == 2


def test_a_transform_refusing_a_sample_is_handled_like_bad_data(shards):
    def refuse_class_3(sample):
        if sample["cls"] == 3:
            raise SampleError(f"label {sample['cls']} is outside the model's 3 classes")
        return sample

    index = open_index(str(shards))
    with pytest.raises(SampleError, match=r"multi-\d+\.tar: sample 'm\d+-\d+': label 3 is outside"):
        list(ShardedLoader(index, cfg(), rank=0, world_size=1, seed=0, transform=refuse_class_3))
    loader = ShardedLoader(
        index, cfg(on_error="skip"), rank=0, world_size=1, seed=0, transform=refuse_class_3
    )
    batches = list(loader)
    refused = {k for k in all_multi_keys() if seed_of(k) % 7 == 3}
    planned = {multi_key(s, i) for s, i, _valid in loader.plan().rank_order(0)}
    assert loader.stats()["samples_skipped"] == len(refused & planned) > 0
    assert not refused & set(valid_keys(batches))


def test_a_transform_bug_propagates_even_when_skipping(shards):
    def buggy(sample):
        raise KeyError("image")

    loader = ShardedLoader(
        open_index(str(shards)), cfg(on_error="skip"), rank=0, world_size=1, seed=0, transform=buggy
    )
    with pytest.raises(KeyError):
        list(loader)


def test_a_missing_field_names_the_field_and_key(shards):
    def drop_txt_sometimes(sample):
        if seed_of(sample["key"]) == 2:
            del sample["txt"]
        return sample

    loader = ShardedLoader(
        open_index(str(shards)),
        cfg(),
        rank=0,
        world_size=1,
        seed=0,
        train=False,
        transform=drop_txt_sometimes,
    )
    with pytest.raises(BatchError, match="sample 'm000-0002' has no field 'txt'"):
        list(loader)


def test_shape_mismatch_of_a_non_image_field_names_field_key_and_shapes(shards):
    def grow_depth(sample):
        if seed_of(sample["key"]) == 1:
            sample["depth.npy"] = torch.zeros(2, 2)
        return sample

    loader = ShardedLoader(
        open_index(str(shards)),
        cfg(),
        rank=0,
        world_size=1,
        seed=0,
        train=False,
        transform=grow_depth,
    )
    error = (
        r"field 'depth.npy' differs within a batch: \[6, 5\] torch.float32 in sample "
        r"'m000-0000', \[2, 2\] torch.float32 in sample 'm000-0001'"
    )
    with pytest.raises(BatchError, match=error):
        list(loader)


# -- a Task's own decode and collate -------------------------------------------------------


class CaptionTask:
    """A task that decodes only what it needs and batches captions of any length."""

    def decode(self, key, members):
        text = bytes(members["txt"]).decode("utf-8")
        return {"tokens": torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)}

    def collate(self, samples):
        longest = max(len(s["tokens"]) for s in samples)
        tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
        for i, s in enumerate(samples):
            tokens[i, : len(s["tokens"])] = s["tokens"]
        return {
            "tokens": tokens,
            "lengths": torch.tensor([len(s["tokens"]) for s in samples]),
            "keys_seen": [s["key"] for s in samples],
        }


@pytest.mark.parametrize("workers", [0, 2])
def test_task_decode_and_collate_hooks(shards, workers):
    task = CaptionTask()
    loader = ShardedLoader(
        open_index(str(shards)),
        cfg(workers_per_rank=workers),
        rank=0,
        world_size=1,
        seed=0,
        decode=task.decode,
        collate=task.collate,
    )
    batches = list(loader)
    loader.close()
    assert len(batches) == sum(SIZES) // 4
    for batch in batches:
        assert set(batch) == {"tokens", "lengths", "keys_seen", "key", "valid"}
        assert batch["keys_seen"] == batch["key"] and batch["valid"].all()
        for row, length, key in zip(batch["tokens"], batch["lengths"], batch["key"], strict=True):
            text = bytes(row[:length].tolist()).decode("utf-8")
            assert text == expected_fields(key)["txt"]


def test_task_collate_gets_fillers_for_lost_samples(tmp_path):
    write_multi_field_shards(tmp_path, SIZES, replace={multi_key(0, 1): {"txt": b"\xff\xfe"}})
    got = []

    def decode(key, members):
        from hpctrain.data.decode import decode_field

        return {"txt": decode_field("txt", members["txt"])}

    def collate(samples):
        got.append([s["key"] for s in samples])
        return {"txt": [s["txt"] for s in samples]}

    loader = ShardedLoader(
        open_index(str(tmp_path)),
        cfg(on_error="skip"),
        rank=0,
        world_size=1,
        seed=0,
        decode=decode,
        collate=collate,
        train=False,
    )
    first = next(iter(loader))
    assert got[0] == ["m000-0000", "m000-0000", "m000-0002", "m000-0003"]
    assert first["valid"].tolist() == [True, False, True, True]
    assert first["key"] == got[0]


# -- decompression bombs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb_shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bomb")
    write_multi_field_shards(
        root, [6, 6], replace={multi_key(1, 2): {"img.jpg": bomb_png(), "extra.png": png(rgb(0))}}
    )
    return root


def _peak_and_current_rss_mb(pid: int) -> tuple[float, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    values = {
        line.split(":")[0]: int(line.split()[1]) / 1024
        for line in status.splitlines()
        if line.startswith(("VmHWM", "VmRSS"))
    }
    return values["VmHWM"], values["VmRSS"]


def test_a_bomb_fails_naming_key_and_shard(bomb_shards):
    loader = ShardedLoader(
        open_index(str(bomb_shards)), cfg(workers_per_rank=1), rank=0, world_size=1, seed=0
    )
    with pytest.raises(SampleError) as info:
        list(loader)
    loader.close()
    message = str(info.value)
    assert "multi-000001.tar" in message and "sample 'm001-0002': field 'img.jpg'" in message
    assert "16000x16000 = 256,000,000 pixels is above data.max_image_pixels" in message


def test_a_bomb_is_skipped_and_counted_with_the_workers_memory_bounded(bomb_shards):
    """The bomb would be 256 MB as grey pixels, 768 MB as RGB: the worker's peak RSS stays
    within a few tens of MB of what it holds after the pass."""
    data = cfg(workers_per_rank=1, on_error="skip", persistent_workers=True)
    loader = ShardedLoader(open_index(str(bomb_shards)), data, rank=0, world_size=1, seed=0)
    batches = list(loader)
    (worker,) = loader.worker_pids
    peak, current = _peak_and_current_rss_mb(worker)
    loader.close()
    assert peak - current < 100, (peak, current)
    assert loader.stats()["samples_skipped"] == 1
    kept = valid_keys(batches)
    assert multi_key(1, 2) not in kept and len(kept) == 11
    del batches
    gc.collect()


def test_the_pixel_limit_comes_from_the_config(bomb_shards):
    # every image of these samples is 5 wide, 6 high: 30 pixels
    loader = ShardedLoader(
        open_index(str(bomb_shards)),
        cfg(max_image_pixels=29),
        rank=0,
        world_size=1,
        seed=0,
    )
    with pytest.raises(SampleError, match="5x6 = 30 pixels is above data.max_image_pixels = 29"):
        list(loader)


def test_json_of_batches_is_plain_python(shards):
    batch = next(iter(ShardedLoader(open_index(str(shards)), cfg(), rank=0, world_size=1, seed=0)))
    json.dumps({"json": batch["json"], "txt": batch["txt"], "key": batch["key"]})
