"""`__source__`, the path a sample was converted from (#43 item 13): never decoded, never in a
training or evaluation batch (shards with and without it batch together), and carried beside
the keys only when the loader is asked (`keep_source`, what `hpctrain predict` uses)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader
from hpctrain.data.decode import decode_sample
from hpctrain.data.fieldnames import SOURCE_FIELD
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from tests.support.loader_kit import image_bytes


def write_shard(path: Path, shard: int, num_samples: int, *, with_source: bool) -> ShardInfo:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(num_samples):
            members = {"png": image_bytes(shard * 100 + i), "cls": str(i % 3).encode()}
            if with_source:
                members[SOURCE_FIELD] = f"class-{i % 3}/photo {shard}-{i}.png".encode()
            for ext, data in members.items():
                info = tarfile.TarInfo(f"k{shard}-{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return ShardInfo(url=path.name, num_samples=num_samples, num_bytes=path.stat().st_size)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> ShardIndex:
    """An older shard without sources and a newer one with them, in one index."""
    root = tmp_path_factory.mktemp("sources")
    shards = (
        write_shard(root / "old.tar", 0, 3, with_source=False),
        write_shard(root / "new.tar", 1, 3, with_source=True),
    )
    index = ShardIndex(shards=shards, base_url=str(root), class_names=("a", "b", "c"))
    (root / "index.json").write_bytes(index_to_bytes(index))
    return index


def loader(index: ShardIndex, **kwargs: object) -> ShardedLoader:
    cfg = DataConfig(batch_size=6, workers_per_rank=0, shuffle_buffer=0)
    return ShardedLoader(index, cfg, rank=0, world_size=1, seed=0, train=False, **kwargs)  # type: ignore[arg-type]


def test_training_and_evaluation_batches_never_see_it(index: ShardIndex) -> None:
    seen_by_decode: list[set[str]] = []

    def decode(key: str, members: dict) -> dict:
        seen_by_decode.append(set(members))
        return decode_sample(key, members)

    for hooks in ({}, {"decode": decode}):
        batch = next(iter(loader(index, **hooks)))  # both shards in one batch
        assert len(batch["key"]) == 6 and SOURCE_FIELD not in batch
        assert set(batch) >= {"png", "cls", "key", "valid"}
    assert seen_by_decode and all(SOURCE_FIELD not in fields for fields in seen_by_decode)
    members = {"png": image_bytes(1), SOURCE_FIELD: b"a.png"}
    assert set(decode_sample("k", members)) == {"key", "png"}


def test_predict_s_loader_carries_each_sample_s_source(index: ShardIndex) -> None:
    batch = next(iter(loader(index, keep_source=True)))
    by_key = dict(zip(batch["key"], batch[SOURCE_FIELD], strict=True))
    assert by_key["k0-000"] == ""  # converted before sources were kept
    assert by_key["k1-002"] == "class-2/photo 1-2.png"
