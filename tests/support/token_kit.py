"""Token shards for tests: documents of random ids, one or several per sample, with an index
holding per-shard token counts and a tokenizer (`hpctrain.data.tokens`)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.data.sequences import num_sequences, sequence_key, sequence_offset
from hpctrain.data.tokens import encode_tokens

SEQ_LEN = 8
VOCAB = 300  # > 256: ids need u16
EOD = 299
# token-stream lengths come from these documents; shard 2 is shorter than one sequence
DOCS_PER_SHARD = [(5, 3), (7, 4), (1, 2), (4, 3), (6, 2)]


def _documents(shard: int, num_docs: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(shard)
    return [
        rng.integers(0, EOD, int(rng.integers(1, max_len + 1))).tolist() for _ in range(num_docs)
    ]


def write_token_shards(
    root: Path,
    docs_per_shard: list[tuple[int, int]] = DOCS_PER_SHARD,
    *,
    max_doc_len: int = 11,
    field: str = "tokens.u16",
    tokenizer: bool = True,
    bad: dict[tuple[int, int], dict[str, bytes]] | None = None,
) -> list[list[int]]:
    """Token shards `root/train-<i>.tar` and `root/index.json`; returns each shard's stream.

    Shard i holds `docs_per_shard[i] = (documents, documents per sample)`: samples of one or
    several whole documents, each followed by EOD. `bad[(shard, sample)]` replaces that
    sample's members (to break the contract on purpose).
    """
    root.mkdir(parents=True, exist_ok=True)
    infos, streams = [], []
    for shard, (num_docs, per_sample) in enumerate(docs_per_shard):
        docs = _documents(shard, num_docs, max_doc_len)
        stream: list[int] = []
        name = f"train-{shard:06d}.tar"
        with tarfile.open(root / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for sample, lo in enumerate(range(0, num_docs, per_sample)):
                ids = [t for doc in docs[lo : lo + per_sample] for t in (*doc, EOD)]
                stream += ids
                members = {field: encode_tokens(ids, field)}
                members = (bad or {}).get((shard, sample), members)
                for member, data in members.items():
                    info = tarfile.TarInfo(f"doc-{shard:02d}-{sample:04d}.{member}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        streams.append(stream)
        infos.append(
            ShardInfo(
                url=name,
                num_samples=-(-num_docs // per_sample),
                num_bytes=(root / name).stat().st_size,
                num_tokens=len(stream),
            )
        )
    tok = {"name": "test", "vocab_size": VOCAB, "eod_id": EOD, "sha256": ""}
    index = ShardIndex(shards=tuple(infos), tokenizer=tok if tokenizer else None)
    (root / "index.json").write_bytes(index_to_bytes(index))
    return streams


def window(streams: list[list[int]], key: str, seq_len: int = SEQ_LEN, epoch: int = 0) -> list[int]:
    """The ids sequence `key` (`train-<shard>/<i>`) must hold in a training `epoch`."""
    stem, i = key.split("/")
    stream = streams[int(stem[-6:])]
    start = sequence_offset(len(stream), seq_len, epoch) + int(i) * seq_len
    return stream[start : start + seq_len + 1]


def positions_window(
    streams: list[list[int]], key: str, seq_len: int = SEQ_LEN, epoch: int = 0
) -> list[int]:
    """The positions in documents sequence `key` must hold in a training `epoch`, from its
    shard's whole stream (0 at the shard's first id and after each EOD, one more elsewhere)."""
    stem, i = key.split("/")
    stream, positions = streams[int(stem[-6:])], []
    for t in range(len(stream)):
        positions.append(0 if t == 0 or stream[t - 1] == EOD else positions[-1] + 1)
    start = sequence_offset(len(stream), seq_len, epoch) + int(i) * seq_len
    return positions[start : start + seq_len + 1]


def all_sequence_keys(streams: list[list[int]], seq_len: int = SEQ_LEN) -> set[str]:
    return {
        sequence_key(f"train-{s:06d}", i)
        for s, stream in enumerate(streams)
        for i in range(num_sequences(len(stream), seq_len))
    }
