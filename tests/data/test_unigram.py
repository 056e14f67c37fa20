"""The unigram baseline: token counts read from shards, entropy and cross-entropy in bits."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hpctrain.convert.tar import ShardTarWriter
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes, read_index
from hpctrain.data.tokens import encode_tokens
from hpctrain.data.unigram import (
    TokenCountError,
    count_tokens,
    unigram_baseline,
    unigram_bits,
)

BYTES = {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""}


def write_token_index(
    folder: Path,
    shards: list[list[list[int]]],
    tokenizer: dict | None = BYTES,
    num_tokens: list[int] | None = None,
) -> str:
    """One shard per list of samples, each sample one `tokens.u16` member; the index path."""
    folder.mkdir(parents=True)
    infos = []
    for i, samples in enumerate(shards):
        name = f"shard-{i}.tar"
        with (folder / name).open("wb") as f:
            writer = ShardTarWriter(f)
            for j, ids in enumerate(samples):
                writer.add(f"s{i}-{j}.tokens.u16", encode_tokens(ids, "tokens.u16"))
            sha = writer.finish()
        tokens = sum(len(ids) for ids in samples) if num_tokens is None else num_tokens[i]
        infos.append(ShardInfo(name, len(samples), writer.num_bytes, sha256=sha, num_tokens=tokens))
    index = ShardIndex(shards=tuple(infos), tokenizer=tokenizer)
    (folder / "index.json").write_bytes(index_to_bytes(index))
    return str(folder / "index.json")


def test_counts_every_id_of_every_shard(tmp_path: Path) -> None:
    url = write_token_index(tmp_path / "t", [[[1, 2, 3, 256]], [[1, 1, 256], [7, 256]]])
    counts = count_tokens(read_index(url), url)
    assert counts.shape == (257,) and counts.sum() == 9
    assert (counts[1], counts[2], counts[3], counts[7], counts[256]) == (3, 1, 1, 1, 3)


def test_entropy_by_hand() -> None:
    counts = np.zeros(257, dtype=np.int64)
    counts[[10, 11, 256]] = [2, 1, 1]  # "aab" + end of document
    per_token = -(2 * math.log2(0.5) + 2 * math.log2(0.25)) / 4
    assert unigram_bits(counts, counts, smoothing=0.0) == pytest.approx(per_token)
    # An id never seen in training costs finite bits under add-one smoothing.
    unseen = np.zeros(257, dtype=np.int64)
    unseen[12] = 1
    assert unigram_bits(counts, unseen) == pytest.approx(-math.log2(1 / (4 + 257)))
    with pytest.raises(ValueError, match="probability 0"):
        unigram_bits(counts, unseen, smoothing=0.0)


def test_baseline_of_a_split_pair(tmp_path: Path) -> None:
    train = write_token_index(tmp_path / "train", [[[1, 1, 2, 256]]])
    val = write_token_index(tmp_path / "val", [[[1, 2, 2, 256]]])
    baseline = unigram_baseline(read_index(train), train, read_index(val), val)
    assert baseline.unit == "byte"
    assert (baseline.train_tokens, baseline.val_tokens) == (4, 4)
    # Bits per id: the end-of-document id is the separator byte between documents.
    assert baseline.train_entropy == pytest.approx(-(2 * math.log2(0.5) + 2 * math.log2(0.25)) / 4)
    p = {1: 3 / 261, 2: 2 / 261, 256: 2 / 261}
    expected = -(math.log2(p[1]) + 2 * math.log2(p[2]) + math.log2(p[256])) / 4
    assert baseline.val_cross_entropy == pytest.approx(expected)
    assert "bits per byte" in baseline.describe()
    other = write_token_index(tmp_path / "other", [[[1, 256]]], tokenizer={**BYTES, "sha256": "x"})
    with pytest.raises(TokenCountError, match="differs"):
        unigram_baseline(read_index(train), train, read_index(other), other)


def test_bad_shards_are_named(tmp_path: Path) -> None:
    lying = write_token_index(tmp_path / "lying", [[[1, 2, 256]]], num_tokens=[4])
    with pytest.raises(TokenCountError, match=r"shard-0.tar: holds 3 tokens.*num_tokens = 4"):
        count_tokens(read_index(lying), lying)
    outside = write_token_index(tmp_path / "outside", [[[1, 300]]])
    with pytest.raises(TokenCountError, match=r"shard-0.tar: sample 's0-0' holds id 300"):
        count_tokens(read_index(outside), outside)
    images = write_token_index(tmp_path / "images", [[[1]]], tokenizer=None)
    with pytest.raises(TokenCountError, match="not a token index"):
        unigram_baseline(read_index(images), images)
    empty = write_token_index(tmp_path / "empty", [[[]]])
    with pytest.raises(TokenCountError, match="holds no tokens"):
        unigram_baseline(read_index(empty), empty)
