"""Token shards for language-model tests, written directly (tarfile + the token-shard contract).

Byte-tokenized documents (ids 0..255, end-of-document 256) of a small made-up language, so a
tiny GPT learns something in a few steps. Every shard holds exactly `TOKENS_PER_SHARD` ids:
with `SEQ_LEN` 32 that is 16 training sequences of 33 ids (cut every 32) and a tail of 17
ids too short for another, dropped by the loader.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from pathlib import Path

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
    entries = []
    for i in range(num_shards):
        name = f"shard-{i:06d}.tar"
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for j, doc in enumerate(documents(rng, TOKENS_PER_SHARD)):
                data = encode_tokens(doc, "tokens.u16")
                member = tarfile.TarInfo(f"{i:03d}-{j:04d}.tokens.u16")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
            count = j + 1
        data = buffer.getvalue()
        (folder / name).write_bytes(data)
        entries.append(
            {
                "url": name,
                "num_samples": count,
                "num_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "num_tokens": TOKENS_PER_SHARD,
            }
        )
    index = {
        "format": "hpctrain-shards",
        "version": 1,
        "num_samples": sum(e["num_samples"] for e in entries),
        "num_bytes": sum(e["num_bytes"] for e in entries),
        "num_tokens": TOKENS_PER_SHARD * num_shards,
        "shards": entries,
        "tokenizer": tokenizer or BYTES_TOKENIZER,
    }
    path = folder / "index.json"
    path.write_text(json.dumps(index))
    return path
