"""A mixture through the real loader: 2 gloo ranks x 2 workers over three sources of different
sizes (exposure per source as planned, exact resume, elastic 2 -> 1, weights changed at
resume), and the checks made before any work (config form, sample kinds, tokenizers)."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.config.load import ConfigError, load_config
from hpctrain.config.schema import DataConfig, SourceConfig
from hpctrain.data import ShardedLoader
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.data.mixture import MixtureError
from hpctrain.data.mixture_index import open_mixture
from hpctrain.launch.local import free_port
from tests.support.loader_kit import sample_key, write_shard
from tests.support.token_kit import SEQ_LEN, write_token_shards

# name -> (shard sizes, first shard number: keys stay unique across sources, weight)
SOURCES = {
    "big": ([9, 11, 7, 10], 0, 0.5),
    "mid": ([6, 8], 100, 0.3),
    "small": ([5], 200, 0.2),  # 5 samples for 11 slots per epoch: repeats, pass by pass
}
CUT = 4  # batches per rank before the checkpoint


def make_source(root: Path, sizes: list[int], first: int, tokenizer=None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    infos = []
    for i, n in enumerate(sizes):
        name = f"train-{i:06d}.tar"
        write_shard(root / name, first + i, n)
        data = (root / name).read_bytes()
        infos.append(ShardInfo(name, n, len(data), hashlib.sha256(data).hexdigest()))
    index = ShardIndex(
        shards=tuple(infos), base_url=str(root), class_names=tuple("abcdefg"), tokenizer=tokenizer
    )
    (root / "index.json").write_bytes(index_to_bytes(index))


def sources(root: str, weights: dict[str, float] | None = None) -> list[SourceConfig]:
    return [
        SourceConfig(path=str(Path(root) / name), weight=(weights or {}).get(name, w))
        for name, (_, _, w) in SOURCES.items()
    ]


def data_cfg(workers: int) -> DataConfig:
    return DataConfig(batch_size=3, workers_per_rank=workers, shuffle_buffer=4)


def keys_of(batch) -> list[str]:
    return [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]


def rank_main(rank: int, world_size: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    index = open_mixture(sources(root))
    out: dict[str, object] = {}
    loader = ShardedLoader(index, data_cfg(2), rank=rank, world_size=world_size, seed=5)
    full = []
    for batch in loader:
        dist.all_reduce(torch.ones(1))  # as DDP does: unequal batch counts would hang here
        full.append(keys_of(batch))
        if len(full) == CUT:  # the checkpoint of an interrupted run
            state = loader.state_dict()
            torch.save(state, Path(root) / f"state-{rank}.pt")
    out["full"], out["len"], out["stats"] = full, len(loader), loader.stats()
    # resumed on the same world (the same, persistent workers): identical batches
    loader.load_state_dict(state)
    out["resumed"] = [keys_of(b) for b in loader]
    loader.close()
    Path(root, f"rank-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    for name, (sizes, first, _) in SOURCES.items():
        make_source(root / name, sizes, first)
    mp.spawn(rank_main, args=(2, free_port(), str(root)), nprocs=2, join=True)
    ranks = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(2)]
    return root, ranks


def source_of_key(key: str) -> str:
    shard = int(key[1:5])
    return "big" if shard < 100 else "mid" if shard < 200 else "small"


def planned_keys(loader: ShardedLoader, rank: int) -> list[str]:
    shard_number = [first + i for sizes, first, _ in SOURCES.values() for i in range(len(sizes))]
    return [sample_key(shard_number[s], i) for s, i, ok in loader.plan().rank_order(rank) if ok]


@pytest.mark.distributed
@pytest.mark.slow
def test_exposure_per_source_matches_the_plan(two_ranks):
    root, ranks = two_ranks
    index = open_mixture(sources(str(root)))
    reference = ShardedLoader(index, data_cfg(2), rank=0, world_size=2, seed=5)
    assert ranks[0]["len"] == ranks[1]["len"] == len(ranks[0]["full"]) == len(ranks[1]["full"])
    for rank in range(2):
        got = [k for batch in ranks[rank]["full"] for k in batch]
        assert got == planned_keys(reference, rank)  # sample for sample, in order
        seen = Counter(source_of_key(k) for k in got)
        stats = ranks[rank]["stats"]
        assert {n: stats[f"samples_seen/{n}"] for n in SOURCES} == {n: seen[n] for n in SOURCES}
    # realized proportions: 56 slots a epoch, 54 read (2 ranks x 9 batches x 3): 28/17/11 planned
    both = Counter(source_of_key(k) for r in ranks for b in r["full"] for k in b)
    assert (
        abs(both["big"] - 27) <= 2 and abs(both["mid"] - 16) <= 2 and abs(both["small"] - 11) <= 2
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_exact_elastic_and_reweighted_resume(two_ranks):
    root, ranks = two_ranks
    for r in ranks:
        assert r["resumed"] == r["full"][CUT:]  # exact: identical remaining batches
    index = open_mixture(sources(str(root)))
    state = torch.load(root / "state-0.pt", weights_only=True)
    done = Counter(k for r in ranks for b in r["full"][:CUT] for k in b)
    unread = Counter(k for r in ranks for b in r["full"][CUT:] for k in b)
    # elastic: 2 ranks x 2 workers -> 1 rank x 1 worker; every remaining sample exactly once
    one = ShardedLoader(index, data_cfg(1), rank=0, world_size=1, seed=5)
    one.load_state_dict(state)
    rest = Counter(k for b in one for k in keys_of(b))
    assert rest == unread
    assert done + rest == Counter(k for r in ranks for b in r["full"] for k in b)
    one.close()
    # weights changed at resume: the epoch ends at the checkpoint; the next one reads every
    # source's unread samples first, then continues it, with the new weights
    reweighted = open_mixture(sources(str(root), {"big": 0.2, "mid": 0.3, "small": 0.5}))
    new = ShardedLoader(reweighted, data_cfg(0), rank=0, world_size=1, seed=5)
    new.load_state_dict(state)
    assert list(new) == []
    new.set_epoch(1)
    assert new.mixture is not None and new.mixture.origin_epoch == 1
    epoch1 = [k for b in new for k in keys_of(b)]
    assert epoch1 == planned_keys(new, 0)
    by_source = Counter(source_of_key(k) for k in epoch1)
    assert by_source["small"] > by_source["big"]  # the new weights apply
    unread_by_source = Counter(source_of_key(k) for k in unread)
    for name in SOURCES:
        # the first samples of each source in the new epoch are exactly its unread ones
        mine = [k for k in planned_keys(new, 0) if source_of_key(k) == name]
        quota = new.mixture.quotas()[list(SOURCES).index(name)]
        if quota >= unread_by_source[name]:
            assert Counter({k: v for k, v in unread.items() if source_of_key(k) == name}) <= (
                Counter(mine)
            )


def test_sources_must_agree_on_kind_and_tokenizer(tmp_path):
    tok = {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""}
    other = {**tok, "name": "gpt2", "vocab_size": 50257, "eod_id": 50256}
    make_source(tmp_path / "images", [3], 0)
    make_source(tmp_path / "code", [3], 100, tokenizer=tok)
    make_source(tmp_path / "web", [3], 200, tokenizer=other)
    with pytest.raises(MixtureError, match=r"'images' and 'code' hold different sample kinds"):
        open_mixture([SourceConfig(path=str(tmp_path / n)) for n in ("images", "code")])
    with pytest.raises(MixtureError, match=r"'code' and 'web' use different tokenizers"):
        open_mixture([SourceConfig(path=str(tmp_path / n)) for n in ("code", "web")])
    with pytest.raises(MixtureError, match=r"data.train\[1\].path is empty"):
        open_mixture([SourceConfig(path=str(tmp_path / "code")), SourceConfig(path="")])


def test_config_list_form_and_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  train:\n    - {path: a, weight: 0.7}\n    - {path: b, name: bee}\n")
    train = load_config(cfg).data.train
    assert isinstance(train, list) and [s.weight for s in train] == [0.7, 1.0]
    with pytest.raises(ConfigError, match=r"data.train\[1\].weight=-1.0 \(command line\)"):
        load_config(None, ["data.train=[{path: a}, {path: b, weight: -1}]"])
    with pytest.raises(ConfigError, match=r"unknown key 'data.train\[0\].wieght'"):
        load_config(None, ["data.train=[{path: a, wieght: 1}]"])
    assert load_config(None, ["data.train=x"]).data.train == "x"


def test_state_of_other_sources_is_refused(tmp_path):
    for name, (sizes, first, _) in SOURCES.items():
        make_source(tmp_path / name, sizes, first)
    index = open_mixture(sources(str(tmp_path)))
    state = ShardedLoader(index, data_cfg(0), rank=0, world_size=1, seed=5).state_dict()
    swapped = open_mixture(list(reversed(sources(str(tmp_path)))))
    loader = ShardedLoader(swapped, data_cfg(0), rank=0, world_size=1, seed=5)
    with pytest.raises(MixtureError, match=r"sources changed since the checkpoint: reordered"):
        loader.load_state_dict(state)
    # a source re-converted in place: the same counts, other samples (its shards' digest)
    make_source(tmp_path / "mid", SOURCES["mid"][0], 300)
    replaced = ShardedLoader(
        open_mixture(sources(str(tmp_path))), data_cfg(0), rank=0, world_size=1, seed=5
    )
    with pytest.raises(MixtureError) as info:
        replaced.load_state_dict(state)
    assert str(info.value).startswith(
        "the mixture's sources changed since the checkpoint: changed mid (the same 2 shards "
        "and 14 samples, other contents)."
    )


def test_token_sources_mix_as_packed_sequences(tmp_path):
    code = write_token_shards(tmp_path / "code")
    web = write_token_shards(tmp_path / "web", [(9, 2), (3, 1)], max_doc_len=7)
    index = open_mixture(
        [
            SourceConfig(path=str(tmp_path / "code"), weight=2.0),
            SourceConfig(path=str(tmp_path / "web"), weight=1.0),
        ]
    )
    cfg = DataConfig(batch_size=2, workers_per_rank=0, shuffle_buffer=0, seq_len=SEQ_LEN)
    loader = ShardedLoader(index, cfg, rank=0, world_size=1, seed=1)
    mixture = loader.mixture
    assert mixture is not None
    # the plan counts sequences: each source's per-shard counts from its num_tokens
    assert sum(mixture.sources[1].shard_sizes) == sum(max(len(s) - 1, 0) // SEQ_LEN for s in web)
    owner = mixture.source_of_shard()
    planned = loader.plan().rank_order(0)
    got = [(k, t) for b in loader for k, t in zip(b["key"], b["tokens"].tolist(), strict=True)]
    assert len(got) == len(planned) > 0
    for (shard, i, _), (key, tokens) in zip(planned, got, strict=True):
        src = int(owner[shard])
        local = shard - mixture.sources[src].first_shard
        streams = code if src == 0 else web
        assert key == f"train-{local:06d}/{i}"
        assert tokens == streams[local][i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1]


def test_a_broken_shard_is_counted_against_its_source_under_skip(tmp_path):
    for name, (sizes, first, _) in SOURCES.items():
        make_source(tmp_path / name, sizes, first)
    broken = tmp_path / "mid" / "train-000001.tar"
    broken.write_bytes(broken.read_bytes()[:700])  # truncated inside its first sample
    index = open_mixture(sources(str(tmp_path)))
    strict = ShardedLoader(index, data_cfg(0), rank=0, world_size=1, seed=5)
    with pytest.raises(Exception, match="train-000001.tar"):
        for _ in strict:
            pass
    cfg = DataConfig(batch_size=3, workers_per_rank=0, shuffle_buffer=4, on_error="skip")
    loader = ShardedLoader(index, cfg, rank=0, world_size=1, seed=5)
    keys = [k for b in loader for k in keys_of(b)]
    stats = loader.stats()
    assert stats["samples_missing/mid"] == stats["samples_lost"] > 0
    assert stats["samples_missing/big"] == stats["samples_missing/small"] == 0
    seen = Counter(source_of_key(k) for k in keys)
    assert {n: stats[f"samples_seen/{n}"] for n in SOURCES} == {n: seen[n] for n in SOURCES}
