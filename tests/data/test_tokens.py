"""Token members and the index's token fields (the contract between convert and the loader)."""

from __future__ import annotations

import json

import pytest

from hpctrain.data.index import ShardIndex, ShardIndexError, ShardInfo, index_to_bytes, parse_index
from hpctrain.data.tokens import decode_tokens, encode_tokens, token_field


def test_field_width_follows_the_vocabulary() -> None:
    assert token_field(257) == "tokens.u16"
    assert token_field(65536) == "tokens.u16"
    assert token_field(65537) == "tokens.u32"


@pytest.mark.parametrize("field", ["tokens.u16", "tokens.u32"])
def test_round_trip_little_endian(field: str) -> None:
    ids = [0, 1, 256, 65535]
    data = encode_tokens(ids, field)
    assert len(data) == len(ids) * (2 if field.endswith("16") else 4)
    assert data[:4] == (b"\x00\x00\x01\x00" if field.endswith("16") else b"\x00" * 4)
    assert decode_tokens(data, field).tolist() == ids


def test_bad_ids_and_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="lie in"):
        encode_tokens([65536], "tokens.u16")
    with pytest.raises(ValueError, match="whole number"):
        decode_tokens(b"\x00\x01\x02", "tokens.u16")
    with pytest.raises(ValueError, match="not a token field"):
        decode_tokens(b"", "tokens.npy")


def test_index_keeps_token_counts_and_tokenizer() -> None:
    tok = {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""}
    index = ShardIndex(
        shards=(
            ShardInfo("a.tar", 2, 4096, num_tokens=10),
            ShardInfo("b.tar", 1, 2048, num_tokens=5),
        ),
        tokenizer=tok,
    )
    data = json.loads(index_to_bytes(index))
    assert data["num_tokens"] == 15 and data["shards"][1]["num_tokens"] == 5
    back = parse_index(data, "/d/index.json")
    assert back.num_tokens == 15 and back.tokenizer == tok


def test_index_without_tokens_is_unchanged() -> None:
    index = ShardIndex(shards=(ShardInfo("a.tar", 2, 4096),))
    data = json.loads(index_to_bytes(index))
    assert "num_tokens" not in data and "tokenizer" not in data
    assert "num_tokens" not in data["shards"][0]
    assert parse_index(data, "/d/index.json").num_tokens is None


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"num_tokens": 99}, "num_tokens = 99 but its shards add up to 15"),
        (
            {"tokenizer": {"name": "bytes", "vocab_size": 257, "eod_id": 300, "sha256": ""}},
            "eod_id",
        ),
        (
            {"tokenizer": {"name": "bytes", "vocab_size": "257", "eod_id": 1, "sha256": ""}},
            "vocab_size",
        ),
        ({"tokenizer": []}, "tokenizer must be an object"),
    ],
)
def test_bad_token_fields_name_the_key(patch: dict, message: str) -> None:
    index = ShardIndex(
        shards=(
            ShardInfo("a.tar", 2, 4096, num_tokens=10),
            ShardInfo("b.tar", 1, 2048, num_tokens=5),
        )
    )
    data = {**json.loads(index_to_bytes(index)), **patch}
    with pytest.raises(ShardIndexError, match=message):
        parse_index(data, "/d/index.json")


def test_shard_token_count_must_be_a_count() -> None:
    data = json.loads(
        index_to_bytes(ShardIndex(shards=(ShardInfo("a.tar", 2, 4096, num_tokens=3),)))
    )
    data["shards"][0]["num_tokens"] = -1
    data.pop("num_tokens")
    with pytest.raises(ShardIndexError, match=r"shards\[0\].num_tokens"):
        parse_index(data, "/d/index.json")
