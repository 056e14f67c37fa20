"""The whole documents of a token index, in index order, with their loss masks (torch-free).

Training reads token shards as fixed-length windows (`hpctrain.data.sequences`), which cut
documents at window boundaries. Answering a validation prompt needs each document whole: a
sample of a token shard holds whole documents, each ending with the end-of-document id
(`hpctrain.data.tokens`), so splitting every sample at that id gives them back exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain.data.index import ShardIndex
from hpctrain.data.sequences import TokenDataError
from hpctrain.data.stream import open_shard
from hpctrain.data.tar import iter_samples
from hpctrain.data.tokens import LOSS_MASK_FIELD, TOKEN_FIELDS, decode_loss_mask, decode_tokens


@dataclass(frozen=True)
class Document:
    """One document: its ids (the end-of-document id last) and, for instruction data, which
    of them are targets (None for plain text). `key` names it: `<shard>:<sample key>#<n>`."""

    key: str
    ids: np.ndarray
    mask: np.ndarray | None


def iter_documents(
    index: ShardIndex,
    *,
    storage_options: dict[str, Any] | None = None,
    max_retries: int = 5,
    allow_pipe: bool = False,
) -> Iterator[Document]:
    """Every document of the token `index`, shard by shard, in order.

    Raises:
        TokenDataError: a sample without a token member, or a mask that does not fit it.
        ShardReadError: a shard that cannot be read.
    """
    eod = int((index.tokenizer or {}).get("eod_id", -1))
    for i, shard in enumerate(index.shards):
        url = index.shard_url(i)
        with open_shard(
            url,
            size=shard.num_bytes,
            max_retries=max_retries,
            storage_options=storage_options,
            allow_pipe=allow_pipe,
        ) as stream:
            for _, key, members in iter_samples(stream):
                field = next((f for f in members if f in TOKEN_FIELDS), None)
                if field is None:
                    raise TokenDataError(f"{url}: sample {key!r} holds no token member")
                ids = decode_tokens(members[field], field).astype(np.int64)
                mask = None
                if LOSS_MASK_FIELD in members:
                    try:
                        mask = decode_loss_mask(members[LOSS_MASK_FIELD], ids.size)
                    except ValueError as exc:
                        raise TokenDataError(f"{url}: sample {key!r}: {exc}") from None
                ends = np.flatnonzero(ids == eod) + 1
                starts = np.concatenate([[0], ends[:-1]]) if ends.size else np.zeros(0, int)
                if not ends.size or ends[-1] != ids.size:  # text after the last EOD
                    starts = np.append(starts, ends[-1] if ends.size else 0)
                    ends = np.append(ends, ids.size)
                name = url.rsplit("/", 1)[-1]
                for n, (start, end) in enumerate(zip(starts, ends, strict=True)):
                    yield Document(
                        f"{name}:{key}#{n}",
                        ids[start:end],
                        None if mask is None else mask[start:end],
                    )
