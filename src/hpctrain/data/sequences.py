"""Packed training sequences: token shards read as fixed-length windows (`data.seq_len`).

With `data.seq_len = N > 0` the loader reads every shard of a token index
(`hpctrain.data.tokens`) as a run of sequences of N+1 token ids (inputs = the first N,
targets = the last N). Sequence `i` of a shard is `stream[i*N : i*N + N + 1]` of the shard's
token stream (its samples' ids, end-of-document ids included, in shard order): consecutive
sequences share one token, so every token of the shard but its first is a target exactly
once, and no token is read only as an input. Sequences never cross shards.

A shard of `num_tokens` ids thus holds `(num_tokens - 1) // N` sequences, computable from the
index alone: the epoch plan (`hpctrain.data.planning`) runs unchanged over per-shard
*sequence* counts, so equal batches per rank, seeded shuffling, exact and elastic resume all
hold per sequence. The tail shorter than a sequence (fewer than N tokens after the last
full sequence, or a whole shard shorter than N+1 tokens) is dropped and counted
(`dropped_tokens`, shown by `hpctrain plan --seq-len N` and logged by the loader). Which
tokens those are alternates with the training epoch (`sequence_offset`): odd epochs cut the
stream from `t` on, `t` being the tail's length, so the tokens left out are its start
instead of its end, and every token is a target at least every other epoch (a one-shard
instruction set would otherwise never train on its last response's end). Evaluation always
cuts from the start.

Reading (`iter_sequences`) is one pass over a shard: a token member's length comes from its
tar header, so samples before the first wanted sequence (or between scattered wanted
sequences after an elastic re-plan) are skipped without being read; only members overlapping
a wanted sequence are read, checked (width, ids below the vocabulary size) and cut into
windows. Torch-free, like the rest of the plan: `hpctrain plan` imports it.

Each sequence comes with its `positions` (int64 [N+1]): every token's position inside its
document, 0 at a document's first token, counting on across the sequence start when the
document began in an earlier sequence. Documents are the shards' own structure
(`hpctrain.data.tokens`): a sample holds whole documents, each followed by the tokenizer's
end-of-document (EOD) id, so a document starts at a sample's first token and after each EOD.
Splitting on the EOD id is safe because it is that structure, not a guess from the text:
`hpctrain convert` refuses a document whose text encodes to the EOD id (and re-packing an
index splits its samples at the same ids), so the id never occurs inside a document, unlike a
separator such as a chat-turn token (torchtitan#3130). Since a document never starts before
the sample that holds it, a member's positions are known from the member alone: skipping the
samples before a wanted sequence (resume, elastic re-plan) leaves them unchanged.

Instruction data (`hpctrain.convert.instructions`) has a loss mask: every sample of its shards
holds a `loss_mask.bits` member before its token member (`hpctrain.data.tokens`), one bit per
id, set for the targets. Its windows are cut like the ids' (so they stay aligned through
skipping, resume and elastic re-plans) and come as a bool [N+1] array beside them; a shard
without the members gives None. A mask is read with its sample's ids (a sample skipped
unread skips its mask too, which takes an eighth of the bytes its ids take at most).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterator, Sequence

import numpy as np

from hpctrain.data.index import INDEX_NAME, ShardIndex, ShardIndexError, join_url, redact_url
from hpctrain.data.stream import CorruptShardError, ShardStream
from hpctrain.data.tar import iter_members, split_key
from hpctrain.data.tokens import LOSS_MASK_FIELD, TOKEN_FIELDS, decode_loss_mask

log = logging.getLogger("hpctrain.data")

NOT_A_TOKEN_INDEX = "not a token index: convert text with `hpctrain convert --tokenizer ...`"


class TokenDataError(CorruptShardError):
    """A token shard whose content breaks the token contract: a sample without a token
    member, a member length that is not a whole number of ids, an id outside the
    vocabulary, or fewer tokens than the index counts. A shard error (`data.on_error`)."""


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """Sequences of `seq_len + 1` tokens (overlapping by one) in a stream of `num_tokens`."""
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len}: must be >= 1")
    return max(num_tokens - 1, 0) // seq_len


def dropped_tokens(num_tokens: int, seq_len: int) -> int:
    """Tokens of a shard that are in no sequence (its tail; the whole shard if too short)."""
    n = num_sequences(num_tokens, seq_len)
    return num_tokens - (n * seq_len + 1) if n else num_tokens


def sequence_offset(num_tokens: int, seq_len: int, epoch: int) -> int:
    """Where a training epoch starts cutting a shard of `num_tokens` into sequences: token 0
    in even epochs, the length of the tail too short for a sequence in odd ones (see the
    module doc)."""
    n = num_sequences(num_tokens, seq_len)
    return num_tokens - (n * seq_len + 1) if n and epoch % 2 else 0


def index_label(index: ShardIndex) -> str:
    """How an error names an index (credentials stripped)."""
    if index.base_url:
        return redact_url(join_url(index.base_url, INDEX_NAME))
    return index.command or "the shard index"


def sequence_counts(index: ShardIndex, seq_len: int) -> np.ndarray:
    """Sequences per shard (index order, int64) for `data.seq_len = seq_len`.

    Raises:
        ShardIndexError: the index has no tokenizer or a shard without `num_tokens` (it
            names the index).
    """
    if index.tokenizer is None or index.num_tokens is None:
        raise ShardIndexError(
            f"{index_label(index)}: data.seq_len = {seq_len} needs token shards, but this is "
            f"{NOT_A_TOKEN_INDEX}"
        )
    tokens = index.counts("num_tokens")
    assert tokens is not None  # num_tokens is not None: every shard has one
    # `num_sequences` over the column (a million shards: no Python int per shard)
    return np.maximum(tokens - 1, 0) // seq_len


def total_dropped_tokens(index: ShardIndex, seq_len: int) -> int:
    """Tokens in no sequence over all shards of a token index (an epoch-independent figure)."""
    tokens = index.counts("num_tokens")
    if tokens is None:
        return 0
    # `dropped_tokens` over the column: a shard with a sequence drops what is past its last
    counts = np.maximum(tokens - 1, 0) // seq_len
    return int(np.where(counts > 0, tokens - (counts * seq_len + 1), tokens).sum())


def shard_stem(url: str) -> str:
    """`.../train-000003.tar` -> `train-000003`: the first part of a sequence's key."""
    name = posixpath.basename(url.rstrip("/").split("?", 1)[0])
    return name[: -len(".tar")] if name.endswith(".tar") else name


def sequence_key(stem: str, index: int) -> str:
    """A sequence's key, unique within a dataset of distinctly named shards."""
    return f"{stem}/{index}"


def iter_sequences(
    stream: ShardStream,
    wanted: Sequence[int],
    seq_len: int,
    vocab_size: int,
    stem: str,
    eod_id: int | None = None,
    offset: int = 0,
) -> Iterator[tuple[int, str, np.ndarray, np.ndarray, np.ndarray | None]]:
    """The wanted sequences of one shard as (sequence index, key, int64 ids [seq_len + 1],
    int64 positions [seq_len + 1], bool loss mask [seq_len + 1] or None) (positions and
    masks: see the module doc).

    Args:
        stream: the open shard.
        wanted: sequence indices, sorted, no repeats (scattered after an elastic re-plan).
        seq_len: N; a sequence holds N+1 ids and starts N ids after the previous one.
        vocab_size: the index tokenizer's vocabulary size; every id read must be below it.
        stem: the shard's name without `.tar`, for the keys.
        eod_id: the end-of-document id (None: documents start only at samples' starts).
        offset: where sequence 0 starts in the stream (`sequence_offset`; at most the tail).

    Raises:
        TokenDataError: see the class (the message names the sample's key).
        CorruptShardError: a malformed tar.
    """
    if not wanted:
        return
    targets = iter(wanted)
    current: int | None = next(targets)
    pieces: list[np.ndarray] = []  # tokens read from `held_from` on, contiguous
    position_pieces: list[np.ndarray] = []  # their positions in their documents
    mask_pieces: list[np.ndarray] = []  # their loss mask (a shard with masks)
    masked: bool | None = None  # whether the shard's samples have masks (its first says)
    mask_data: bytes | None = None  # the current sample's mask member, when read
    has_mask = False
    held_from = 0
    pos = 0  # tokens of the stream before the member being looked at
    key: str | None = None
    has_tokens = False
    for member, read_data in iter_members(stream, views=True):
        k, field = split_key(member.name)
        if k != key:
            if key is not None and not has_tokens:
                raise TokenDataError(f"sample {key!r} has no token member ({_fields()})")
            key, has_tokens, has_mask, mask_data = k, False, False, None
        dtype = TOKEN_FIELDS.get(field)
        if dtype is None:
            if field == LOSS_MASK_FIELD:
                if has_tokens:
                    raise TokenDataError(f"sample {key!r}: {field} comes after its token member")
                has_mask = True
                assert current is not None
                if pos + 8 * member.size > offset + current * seq_len:  # may hold wanted ids
                    mask_data = bytes(read_data())
            continue  # other members (metadata) are not part of the token stream
        if has_tokens:
            raise TokenDataError(f"sample {key!r} has more than one token member")
        has_tokens = True
        if masked is None:
            masked = has_mask
        elif masked != has_mask:
            raise TokenDataError(
                f"sample {key!r} {'has no' if masked else 'has a'} {LOSS_MASK_FIELD} member, "
                "unlike the samples before it"
            )
        if member.size % dtype.itemsize:
            raise TokenDataError(
                f"sample {key!r}: {field} holds {member.size} bytes, not a whole number of "
                f"{dtype.itemsize}-byte ids"
            )
        count = member.size // dtype.itemsize
        assert current is not None  # the loop returns once the last wanted sequence is out
        start = offset + current * seq_len
        if pos + count <= start:
            pos += count  # entirely before the next wanted sequence: skipped unread
            continue
        ids = np.frombuffer(read_data(), dtype=dtype)
        if ids.size and int(ids.max()) >= vocab_size:
            bad = int(ids[ids >= vocab_size][0])
            raise TokenDataError(
                f"sample {key!r}: token id {bad} is outside the index tokenizer's vocabulary "
                f"(vocab_size {vocab_size})"
            )
        positions = document_positions(ids, eod_id)
        mask = np.zeros(0, dtype=bool)
        if masked:
            if mask_data is None:  # skipped: 8 bits a byte could not hold the ids
                raise TokenDataError(f"sample {key!r}: {LOSS_MASK_FIELD} is shorter than its ids")
            try:
                mask = decode_loss_mask(mask_data, ids.size)
            except ValueError as exc:
                raise TokenDataError(f"sample {key!r}: {exc}") from None
        if not pieces:
            held_from = max(start, pos)
            cut = slice(held_from - pos, None)
            ids, positions, mask = ids[cut], positions[cut], mask[cut]
        pieces.append(ids)
        position_pieces.append(positions)
        mask_pieces.append(mask)
        pos += count
        if pos < start + seq_len + 1:
            continue
        held = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        held_positions = np.concatenate(position_pieces)
        held_mask = np.concatenate(mask_pieces)
        while current is not None and offset + current * seq_len + seq_len + 1 <= pos:
            lo = offset + current * seq_len - held_from
            window = slice(lo, lo + seq_len + 1)
            name = sequence_key(stem, current)
            window_mask = held_mask[window].copy() if masked else None
            ids_out = held[window].astype(np.int64)
            yield current, name, ids_out, held_positions[window].copy(), window_mask
            current = next(targets, None)
        if current is None:
            return  # no need to read the rest of the shard
        start = offset + current * seq_len
        kept = slice(start - held_from, None)
        pieces = [held[kept]] if start < pos else []
        position_pieces = [held_positions[kept]] if start < pos else []
        mask_pieces = [held_mask[kept]] if start < pos else []
        held_from = start
    if key is not None and not has_tokens:
        raise TokenDataError(f"sample {key!r} has no token member ({_fields()})")
    if current is not None:
        raise TokenDataError(
            f"ends after {pos} tokens, before sequence {current} (tokens "
            f"{offset + current * seq_len} to {offset + current * seq_len + seq_len}) that the "
            "index's num_tokens promises"
        )


def document_positions(ids: np.ndarray, eod_id: int | None) -> np.ndarray:
    """Each id's position (int64) in its document, for the ids of one sample: 0 at the
    sample's first id and after each `eod_id` (see the module doc)."""
    index = np.arange(ids.size, dtype=np.int64)
    starts = np.zeros(ids.size, dtype=bool)  # after an EOD (the first id's start is index 0)
    if eod_id is not None:
        starts[1:] = ids[:-1] == eod_id
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def _fields() -> str:
    return " or ".join(TOKEN_FIELDS)


def sequence_layout(index: ShardIndex, seq_len: int) -> tuple[np.ndarray, int, int]:
    """What a loader with `data.seq_len = seq_len` needs of a token index: sequences per
    shard, the vocabulary size, and the tokens per epoch in no sequence (logged here).

    Raises:
        ShardIndexError: not a token index (see `sequence_counts`).
    """
    counts = sequence_counts(index, seq_len)
    assert index.tokenizer is not None  # sequence_counts refuses an index without one
    dropped = total_dropped_tokens(index, seq_len)
    log.info(
        "%s: %d sequences of %d+1 tokens; %d of %d tokens, too few for one more per shard, "
        "are left out of every epoch (a shard's end in even epochs, its start in odd ones)",
        index_label(index),
        int(counts.sum()),
        seq_len,
        dropped,
        index.num_tokens,
    )
    return counts, int(index.tokenizer["vocab_size"]), dropped
