"""Packed sequences (`data.seq_len`): token shards cut into fixed-length windows by the loader."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, ShardIndexError, ShardReadError, open_index
from hpctrain.data.decode import decode_sample
from hpctrain.data.loader import LoaderStateError
from hpctrain.data.sequences import (
    TokenDataError,
    dropped_tokens,
    iter_sequences,
    num_sequences,
    sequence_key,
)
from hpctrain.data.stream import ReadStats, open_shard
from hpctrain.data.tokens import encode_tokens
from hpctrain.launch.preflight import check_data
from tests.support.loader_kit import make_shards
from tests.support.token_kit import (
    EOD,
    SEQ_LEN,
    VOCAB,
    all_sequence_keys,
    positions_window,
    window,
    write_token_shards,
)


def cfg(**kw):
    base = dict(
        seq_len=SEQ_LEN,
        batch_size=3,
        workers_per_rank=0,
        shuffle_buffer=0,
        persistent_workers=False,
    )
    base.update(kw)
    return DataConfig(**base)


def valid_keys(batches) -> list[str]:
    return [k for b in batches for k, ok in zip(b["key"], b["valid"], strict=True) if ok]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    streams = write_token_shards(root)
    return root, streams


def test_counts_and_tail_arithmetic():
    assert [num_sequences(n, 4) for n in (0, 1, 4, 5, 8, 9, 10)] == [0, 0, 0, 1, 1, 2, 2]
    assert [dropped_tokens(n, 4) for n in (0, 4, 5, 8, 9, 10)] == [0, 4, 0, 3, 0, 1]
    # every token is in a sequence or in the dropped tail; every token but the first of a
    # shard with sequences is a target exactly once
    for n in range(40):
        k = num_sequences(n, 4)
        assert k * 4 + (1 if k else 0) + dropped_tokens(n, 4) == n


def test_shard_sequences_joined_are_its_documents_minus_the_tail(tokens):
    root, streams = tokens
    for shard, stream in enumerate(streams):
        count = num_sequences(len(stream), SEQ_LEN)
        with open_shard(str(root / f"train-{shard:06d}.tar")) as f:
            got = list(iter_sequences(f, range(count), SEQ_LEN, VOCAB, "s"))
        assert [i for i, _k, _w, _p, _m in got] == list(range(count))
        assert all(w.dtype == np.int64 and len(w) == SEQ_LEN + 1 for _i, _k, w, _p, _m in got)
        joined = [t for i, _k, w, _p, _m in got for t in (w if i == 0 else w[1:]).tolist()]
        assert joined == stream[: len(stream) - dropped_tokens(len(stream), SEQ_LEN)]
        assert (count == 0) == (len(stream) <= SEQ_LEN)


def test_scattered_sequences_are_read_in_one_pass_skipping_unread_samples(tmp_path):
    # 40 one-document samples of 9-11 tokens: the wanted windows sit far apart
    streams = write_token_shards(tmp_path, [(40, 1)], max_doc_len=10)
    stream = streams[0]
    count = num_sequences(len(stream), SEQ_LEN)
    wanted = [2, 3, count // 2, count - 1]
    stats = ReadStats()
    with open_shard(str(tmp_path / "train-000000.tar"), stats=stats) as f:
        got = list(iter_sequences(f, wanted, SEQ_LEN, VOCAB, "train-000000"))
    assert [k for _i, k, _w, _p, _m in got] == [f"train-000000/{i}" for i in wanted]
    for i, _k, w, _p, _m in got:
        assert w.tolist() == stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1]
    assert stats.bytes_skipped > 0  # samples between the windows were never read


@settings(max_examples=60, deadline=None)
@given(
    sample_lengths=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    seq_len=st.integers(1, 9),
    pick=st.randoms(use_true_random=False),
)
def test_any_wanted_subset_reads_the_windows_of_the_stream(sample_lengths, seq_len, pick):
    stream = [i % 5 for i in range(sum(sample_lengths))]  # 0 plays the EOD
    # positions from the whole stream: 0 at each sample's first id and after each EOD
    firsts = set(np.cumsum([0, *sample_lengths]).tolist())
    expected: list[int] = []
    for t in range(len(stream)):
        restart = t in firsts or stream[t - 1] == 0
        expected.append(0 if restart else expected[-1] + 1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            lo = 0
            for i, n in enumerate(sample_lengths):
                data = encode_tokens(stream[lo : lo + n], "tokens.u32")
                lo += n
                info = tarfile.TarInfo(f"{i:03d}.tokens.u32")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        count = num_sequences(len(stream), seq_len)
        wanted = sorted(pick.sample(range(count), pick.randint(0, count)))
        with open_shard(str(path)) as f:
            got = list(iter_sequences(f, wanted, seq_len, 5, "s", eod_id=0))
    assert [i for i, _k, _w, _p, _m in got] == wanted
    for i, _k, w, p, _m in got:
        assert w.tolist() == stream[i * seq_len : i * seq_len + seq_len + 1]
        assert p.tolist() == expected[i * seq_len : i * seq_len + seq_len + 1]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_follow_the_plan_with_counts_from_num_tokens(tokens, workers):
    root, streams = tokens
    index = open_index(str(root))
    loader = ShardedLoader(
        index, cfg(workers_per_rank=workers, shuffle_buffer=4), rank=0, world_size=1, seed=2
    )
    counts = [num_sequences(len(s), SEQ_LEN) for s in streams]
    assert list(loader.shard_sizes) == counts
    assert loader.dropped_tokens == sum(dropped_tokens(len(s), SEQ_LEN) for s in streams)
    batches = list(loader)
    assert len(batches) == len(loader) == sum(counts) // 3
    keys = [k for b in batches for k in b["key"]]
    stems = [f"train-{i:06d}" for i in range(len(streams))]
    assert keys == [sequence_key(stems[s], i) for s, i, _v in loader.plan().rank_order(0)]
    assert len(set(keys)) == len(keys) and set(keys) <= all_sequence_keys(streams)
    for b in batches:
        assert set(b) == {"tokens", "positions", "key", "valid"} and bool(b["valid"].all())
        assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (3, SEQ_LEN + 1)
        # positions travel like tokens (with workers: through the pooled shared memory)
        assert b["positions"].dtype == torch.int64 and b["positions"].shape == (3, SEQ_LEN + 1)
        for key, row, positions in zip(b["key"], b["tokens"], b["positions"], strict=True):
            assert row.tolist() == window(streams, key)
            assert positions.tolist() == positions_window(streams, key)
            for t in range(1, SEQ_LEN + 1):  # 0 exactly after an EOD, one more elsewhere
                after_eod = int(row[t - 1]) == EOD
                assert int(positions[t]) == (0 if after_eod else int(positions[t - 1]) + 1)
    loader.close()


def test_shuffled_epochs_are_permutations_of_the_sequences(tmp_path):
    streams = write_token_shards(tmp_path, [(6, 1), (7, 2), (5, 3)])
    index = open_index(str(tmp_path))
    total = len(all_sequence_keys(streams))
    loader = ShardedLoader(index, cfg(batch_size=1, shuffle_buffer=5), rank=0, world_size=1, seed=0)
    first = valid_keys(loader)
    loader.set_epoch(1)
    second = valid_keys(loader)
    assert sorted(first) == sorted(second) == sorted(all_sequence_keys(streams))
    assert len(first) == total and first != second
    in_index_order = sorted(first, key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
    assert first != in_index_order


@pytest.mark.parametrize(("workers", "stop"), [(0, 3), (2, 3)])
def test_exact_resume_gives_identical_remaining_batches(tokens, workers, stop):
    root, _ = tokens
    index = open_index(str(root))
    c = cfg(workers_per_rank=workers, shuffle_buffer=5)
    full = list(ShardedLoader(index, c, rank=0, world_size=1, seed=7))
    first = ShardedLoader(index, c, rank=0, world_size=1, seed=7)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    first.close()
    resumed = ShardedLoader(index, c, rank=0, world_size=1, seed=7)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - stop
    for a, b in zip(full[stop:], rest, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["positions"], b["positions"])
    with pytest.raises(LoaderStateError, match="seq_len = 8"):
        ShardedLoader(index, cfg(seq_len=4), rank=0, world_size=1, seed=7).load_state_dict(state)


def test_elastic_resume_two_ranks_to_one_sees_every_sequence_once(tokens):
    root, streams = tokens
    index = open_index(str(root))
    c = cfg(batch_size=2, shuffle_buffer=3)
    seen: list[str] = []
    states = []
    for rank in range(2):
        loader = ShardedLoader(index, c, rank=rank, world_size=2, seed=1)
        it = iter(loader)
        for _ in range(2):
            seen.extend(next(it)["key"])
        states.append(loader.state_dict())
    assert states[0] == states[1]
    dropped_by_plan = ShardedLoader(index, c, rank=0, world_size=2, seed=1).plan().num_dropped
    loader = ShardedLoader(index, c, rank=0, world_size=1, seed=1)
    loader.load_state_dict(states[0])
    rest = list(loader)
    seen += valid_keys(rest)
    for b in rest:  # re-planned sequences keep their positions aligned with their tokens
        for key, positions in zip(b["key"], b["positions"], strict=True):
            assert positions.tolist() == positions_window(streams, key)
    counts = Counter(seen)
    assert set(counts.values()) == {1}
    assert len(counts) == len(all_sequence_keys(streams)) - dropped_by_plan
    assert set(counts) <= all_sequence_keys(streams)


def test_corrupt_shard_fails_naming_it_or_gives_invalid_fillers(tmp_path):
    streams = write_token_shards(tmp_path, [(6, 1), (6, 1), (6, 1)], max_doc_len=8)
    path = tmp_path / "train-000001.tar"
    data = bytearray(path.read_bytes())
    data[512 * 4 + 10] ^= 0xFF  # the header of the third sample: checksum mismatch
    path.write_bytes(bytes(data))
    index = open_index(str(tmp_path))
    with pytest.raises(ShardReadError, match="train-000001.tar: bad tar header checksum"):
        list(ShardedLoader(index, cfg(batch_size=2), rank=0, world_size=1, seed=0))
    loader = ShardedLoader(index, cfg(batch_size=2, on_error="skip"), rank=0, world_size=1, seed=0)
    batches = list(loader)
    assert len(batches) == len(loader)  # the rank is never left short
    valid = valid_keys(batches)
    lost = loader.stats()["samples_lost"]
    assert loader.stats()["shards_failed"] == 1 and lost > 0
    assert len(valid) + lost == len(batches) * 2
    assert all(not k.startswith("train-000001/") or int(k.split("/")[1]) < 3 for k in valid)
    for b in batches:  # fillers are real sequences, flagged invalid
        for key, row in zip(b["key"], b["tokens"], strict=True):
            assert row.tolist() == window(streams, key)


def test_a_worker_with_nothing_readable_fills_with_a_sequence_of_another_shard(tmp_path, caplog):
    # shard 1 is too short for a sequence: the filler search passes over it, unread
    streams = write_token_shards(tmp_path, [(6, 1), (1, 1), (6, 1)], max_doc_len=8)
    path = tmp_path / "train-000000.tar"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # the first header: nothing of shard 0 can be read
    path.write_bytes(bytes(data))
    (tmp_path / "train-000001.tar").unlink()  # opening it would log a failure
    c = cfg(batch_size=2, on_error="skip")
    loader = ShardedLoader(open_index(str(tmp_path)), c, rank=0, world_size=1, seed=0, train=False)
    batches = list(loader)
    lost = [b for b in batches if not any(b["valid"])]
    assert lost and loader.stats()["shards_failed"] >= 1  # eval padding reads shard 0 again
    assert "train-000001" not in caplog.text and "train-000000" in caplog.text
    assert all(k == "train-000002/0" for b in lost for k in b["key"])
    assert all(
        row.tolist() == window(streams, "train-000002/0") for b in lost for row in b["tokens"]
    )


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"tokens.u16": encode_tokens([1, 2, VOCAB], "tokens.u16")}, "token id 300 is outside"),
        ({"json": b"{}"}, "has no token member"),
        ({"tokens.u16": b"\x01\x00\x02"}, "3 bytes, not a whole number of 2-byte ids"),
    ],
)
def test_a_sample_that_breaks_the_token_contract_is_a_data_error(tmp_path, members, message):
    write_token_shards(tmp_path, [(4, 1), (4, 1)], bad={(1, 1): members})
    index = open_index(str(tmp_path))
    loader = ShardedLoader(index, cfg(batch_size=1), rank=0, world_size=1, seed=0, train=False)
    with pytest.raises(ShardReadError, match=rf"train-000001.tar: sample 'doc-01-0001'.*{message}"):
        list(loader)
    with open_shard(str(tmp_path / "train-000001.tar")) as f, pytest.raises(TokenDataError):
        list(iter_sequences(f, [0, 1, 2], SEQ_LEN, VOCAB, "x"))


def test_a_shard_with_fewer_tokens_than_the_index_says_is_a_shard_error(tmp_path):
    streams = write_token_shards(tmp_path, [(4, 1), (4, 2)])
    data = json.loads((tmp_path / "index.json").read_text())
    data["shards"][1]["num_tokens"] += 2 * SEQ_LEN
    data["num_tokens"] += 2 * SEQ_LEN
    (tmp_path / "index.json").write_text(json.dumps(data))
    loader = ShardedLoader(
        open_index(str(tmp_path)), cfg(batch_size=1), rank=0, world_size=1, seed=0, train=False
    )
    with pytest.raises(ShardReadError, match=rf"train-000001.tar: ends after {len(streams[1])} "):
        list(loader)


def test_seq_len_needs_a_token_index_naming_it(tmp_path):
    make_shards(tmp_path, [3])
    with pytest.raises(ShardIndexError, match=r"index.json: .*not a token index.*--tokenizer"):
        ShardedLoader(open_index(str(tmp_path)), cfg(), rank=0, world_size=1, seed=0)
    write_token_shards(tmp_path / "t", tokenizer=False)
    with pytest.raises(ShardIndexError, match="not a token index"):
        ShardedLoader(open_index(str(tmp_path / "t")), cfg(), rank=0, world_size=1, seed=0)


def test_preflight_refuses_seq_len_on_a_non_token_index(tmp_path, tokens):
    make_shards(tmp_path, [3])
    for data, ok in ((tmp_path, False), (tokens[0], True)):
        cfg_ = with_overrides(Config(), [f"data.train={data}", "data.seq_len=8"])
        (check,) = check_data(cfg_)
        assert check.ok is ok
        assert ok or ("index.json" in check.message and "not a token index" in check.message)


def test_without_seq_len_token_members_decode_to_documents(tokens):
    root, streams = tokens
    ids = [5, EOD, 7]
    sample = decode_sample("k", {"tokens.u16": encode_tokens(ids, "tokens.u16")})
    assert sample["tokens.u16"].dtype == torch.int64 and sample["tokens.u16"].tolist() == ids
    u32 = decode_sample("k", {"tokens.u32": encode_tokens([70000], "tokens.u32")})
    assert u32["tokens.u32"].tolist() == [70000]

    def pad(samples):  # documents differ in length: a task's collate pads them
        docs = [s["tokens.u16"] for s in samples]
        out = torch.full((len(docs), max(len(d) for d in docs)), -1, dtype=torch.int64)
        for row, doc in zip(out, docs, strict=True):
            row[: len(doc)] = doc
        return {"tokens": out}

    index = open_index(str(root))
    loader = ShardedLoader(
        index, cfg(seq_len=0, batch_size=1), rank=0, world_size=1, seed=0, collate=pad, train=False
    )
    first = next(iter(loader))
    assert first["tokens"][0].tolist() == streams[0][: first["tokens"].shape[1]]
    assert first["tokens"][0, -1] == EOD


def test_plan_cli_shows_sequences_and_dropped_tokens(tokens, capsys):
    root, streams = tokens
    total = len(all_sequence_keys(streams))
    dropped = sum(dropped_tokens(len(s), SEQ_LEN) for s in streams)
    args = ["plan", str(root), "--world-size", "2", "--batch-size", "2", "--seq-len", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{total} samples" in out
    assert f"{total // 4 * 2} sequences per rank" in out
    assert f"{dropped} of {sum(len(s) for s in streams)} tokens dropped" in out
    assert main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == total and summary["tokens_dropped"] == dropped


@pytest.mark.parametrize("workers", [0, 2])
def test_the_tokens_too_few_for_a_sequence_alternate_between_a_shards_end_and_start(
    tmp_path, workers
):
    # Sibling of #37 item 1: the tail of a shard's stream shorter than a sequence was the
    # same every epoch, so a one-shard set never trained on its last tokens.
    streams = write_token_shards(tmp_path, [(9, 2), (7, 3)])
    index = open_index(str(tmp_path))
    c = cfg(batch_size=1, workers_per_rank=workers, shuffle_buffer=3)
    loader = ShardedLoader(index, c, rank=0, world_size=1, seed=1)
    tails = [dropped_tokens(len(s), SEQ_LEN) for s in streams]
    assert all(tails), tails  # both shards have tokens left over
    targets: list[set[tuple[int, int]]] = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        seen = set()
        for b in loader:
            key, row, positions = b["key"][0], b["tokens"][0], b["positions"][0]
            assert row.tolist() == window(streams, key, epoch=epoch)
            assert positions.tolist() == positions_window(streams, key, epoch=epoch)
            shard, i = int(key.split("/")[0][-6:]), int(key.split("/")[1])
            start = (tails[shard] if epoch % 2 else 0) + i * SEQ_LEN
            seen |= {(shard, t) for t in range(start + 1, start + SEQ_LEN + 1)}
        targets.append(seen)
    loader.close()
    every = {(s, t) for s, stream in enumerate(streams) for t in range(1, len(stream))}
    assert targets[0] != targets[1] and targets[0] == targets[2]
    assert targets[0] | targets[1] == every  # every token a target every other epoch
    # evaluation reads the same windows in every epoch
    evaluation = ShardedLoader(index, c, rank=0, world_size=1, seed=1, train=False)
    evaluation.set_epoch(1)
    for b in evaluation:
        assert b["tokens"][0].tolist() == window(streams, b["key"][0])
