"""Token shards: how a language model's token ids are stored in a sample (torch-free).

A token shard is an ordinary hpctrain shard whose samples each hold ONE member, `tokens.u16`
(vocabularies of at most 65536 ids) or `tokens.u32`: raw little-endian unsigned ids, one or
several whole documents, each followed by the tokenizer's end-of-document id. A shard's token
stream is the concatenation of its samples' ids in shard order; its length is the shard's
`num_tokens` in the index (`hpctrain.data.index`), which also names the tokenizer. Training
sequences are cut from that stream (`data.seq_len`), never across shards.
"""

from __future__ import annotations

import numpy as np

from hpctrain.data.fieldnames import last_extension

TOKEN_EXTENSIONS: dict[str, np.dtype[np.unsignedinteger]] = {
    "u16": np.dtype("<u2"),
    "u32": np.dtype("<u4"),
}
TOKEN_FIELDS = {f"tokens.{ext}": dtype for ext, dtype in TOKEN_EXTENSIONS.items()}


def token_field(vocab_size: int) -> str:
    """The member name for ids below `vocab_size`: `tokens.u16` when they fit, else `tokens.u32`."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size = {vocab_size}: must lie in [1, 2**32]")
    return "tokens.u16" if vocab_size <= 2**16 else "tokens.u32"


def encode_tokens(ids: np.ndarray | list[int], field: str) -> bytes:
    """The member bytes of `ids` for `field` (`tokens.u16` or `tokens.u32`).

    Raises:
        ValueError: an id that does not fit the field's width, or an unknown field.
    """
    dtype = TOKEN_FIELDS.get(field)
    if dtype is None:
        raise ValueError(f"{field!r} is not a token field ({', '.join(TOKEN_FIELDS)})")
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids must lie in [0, {np.iinfo(dtype).max}] for {field}")
    return arr.astype(dtype).tobytes()


def decode_tokens(data: bytes | memoryview, field: str) -> np.ndarray:
    """The ids held by a token member (read-only view when `data` is), by its last extension.

    Raises:
        ValueError: a length that is not a whole number of ids, or not a token extension.
    """
    dtype = TOKEN_EXTENSIONS.get(last_extension(field))
    if dtype is None:
        raise ValueError(f"{field!r} is not a token field ({', '.join(TOKEN_FIELDS)})")
    if len(data) % dtype.itemsize:
        raise ValueError(
            f"{field}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte ids"
        )
    return np.frombuffer(data, dtype=dtype)


# A sample's loss mask (instruction data, `hpctrain.convert.instructions`): one bit per token
# of its token member, set for the tokens the loss learns (targets), packed little-endian
# (`numpy.packbits(..., bitorder="little")`), the last byte's unused bits 0. The member is
# written before the token member, so a reader knows it when the ids come.
LOSS_MASK_FIELD = "loss_mask.bits"


def encode_loss_mask(mask: np.ndarray | list[bool]) -> bytes:
    """The member bytes of a per-token boolean mask."""
    return np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()


def decode_loss_mask(data: bytes | memoryview, count: int) -> np.ndarray:
    """The boolean mask of `count` tokens held by a loss-mask member.

    Raises:
        ValueError: a length that is not that of `count` bits, or unused bits set.
    """
    if len(data) != (count + 7) // 8:
        raise ValueError(
            f"{LOSS_MASK_FIELD}: {len(data)} bytes, but {count} tokens need {(count + 7) // 8}"
        )
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[count:].any():
        raise ValueError(f"{LOSS_MASK_FIELD}: bits set beyond its {count} tokens")
    return bits[:count].astype(bool)
