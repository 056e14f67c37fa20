"""Token shards for language-model tests, written directly (tarfile + the token-shard contract).

Byte-tokenized documents (ids 0..255, end-of-document 256) of a small made-up language, so a
tiny GPT learns something in a few steps. Every shard holds exactly `TOKENS_PER_SHARD` ids:
with `SEQ_LEN` 32 that is 16 training sequences of 33 ids (cut every 32) and a tail of 17
ids too short for another, dropped by the loader.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.data.tokens import encode_tokens

SEQ_LEN = 32
SEQUENCES_PER_SHARD = 16
TOKENS_PER_SHARD = SEQUENCES_PER_SHARD * SEQ_LEN + 1 + 16  # + a tail of 17 ids, dropped
EOD = 256
BYTES_TOKENIZER = {"name": "bytes", "vocab_size": 257, "eod_id": EOD, "sha256": ""}
WORDS = ("the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "log", "and", "slept")


def documents(rng: random.Random, num_tokens: int) -> list[list[int]]:
    """Documents (ids, each ending with EOD) holding exactly `num_tokens` ids together."""
    docs: list[list[int]] = []
    left = num_tokens
    while left > 0:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 30))]
        ids = [*(" ".join(words).encode() + b".")[: left - 1], EOD]
        docs.append(ids)
        left -= len(ids)
    return docs


def write_token_shards(
    folder: Path, num_shards: int, seed: int, tokenizer: dict | None = None
) -> Path:
    """`folder/shard-<i>.tar` + `folder/index.json`; returns the index path."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    shards = []
    for i in range(num_shards):
        name = f"shard-{i:06d}.tar"
        with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            docs = documents(rng, TOKENS_PER_SHARD)
            for j, doc in enumerate(docs):
                data = encode_tokens(doc, "tokens.u16")
                member = tarfile.TarInfo(f"{i:03d}-{j:04d}.tokens.u16")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        size = (folder / name).stat().st_size
        shards.append(ShardInfo(name, len(docs), size, num_tokens=TOKENS_PER_SHARD))
    index = ShardIndex(shards=tuple(shards), tokenizer=tokenizer or dict(BYTES_TOKENIZER))
    path = folder / "index.json"
    path.write_bytes(index_to_bytes(index))
    return path
