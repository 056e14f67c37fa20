"""The unigram baseline of token shards: what a model that ignores all context achieves.

A language model is only worth its compute once it beats predicting every token from its
frequency alone. `count_tokens` reads every token member of every shard of an index (with the
loader's own tar reader) and counts each id; `unigram_bits` turns counts into bits per token
or, for the byte tokenizer, bits per byte. `unigram_baseline` gives the two figures `make
demo-lm` prints next to the model's validation bits per byte: the entropy of the training
split's frequencies, and the cross-entropy of the validation split's tokens under them (the
figure a context-free model trained on the training split would reach on the validation
split, the one to compare a model's validation loss with).

Bits per byte, byte tokenizer: every id is one byte of the stream the shards hold, the
end-of-document id standing for the separator between documents; the figure is bits per id,
as `causal_lm`'s `val_bits_per_byte` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain.data.index import ShardIndex
from hpctrain.data.stream import open_shard
from hpctrain.data.tar import iter_samples
from hpctrain.data.tokens import TOKEN_FIELDS, decode_tokens
from hpctrain.errors import DataError

BYTES_TOKENIZER = "bytes"


class TokenCountError(DataError, ValueError):
    """Token shards whose ids or counts disagree with their index (names the shard)."""


def tokenizer_facts(index: ShardIndex, where: str) -> dict[str, Any]:
    """The index's tokenizer object, or a `TokenCountError` naming `where` if it has none."""
    if index.tokenizer is None:
        raise TokenCountError(
            f"{where}: not a token index (no tokenizer); convert text with --tokenizer"
        )
    return index.tokenizer


def count_tokens(
    index: ShardIndex,
    where: str,
    *,
    storage_options: dict[str, Any] | None = None,
    max_retries: int = 5,
) -> np.ndarray:
    """How often each id of the tokenizer's vocabulary occurs in the shards of `index`.

    Args:
        index: a token index (`hpctrain convert ... --tokenizer`).
        where: the index's path or URL, for error messages.
        storage_options: fsspec options for remote shards.
        max_retries: retries of a failed shard read.

    Returns:
        int64 counts of shape [vocab_size].

    Raises:
        TokenCountError: no tokenizer in the index, an id outside the vocabulary, or a shard
            whose ids do not add up to its `num_tokens`.
        ShardReadError: a shard that cannot be read.
    """
    vocab_size = int(tokenizer_facts(index, where)["vocab_size"])
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, shard in enumerate(index.shards):
        url = index.shard_url(i)
        seen = 0
        with open_shard(
            url,
            size=shard.num_bytes,
            max_retries=max_retries,
            storage_options=storage_options,
        ) as stream:
            for _, key, members in iter_samples(stream):
                for field, data in members.items():
                    if field not in TOKEN_FIELDS:
                        continue
                    ids = decode_tokens(data, field)
                    if ids.size and int(ids.max()) >= vocab_size:
                        raise TokenCountError(
                            f"{url}: sample {key!r} holds id {int(ids.max())}, outside the "
                            f"tokenizer's vocabulary of {vocab_size} ({where})"
                        )
                    counts += np.bincount(ids, minlength=vocab_size)
                    seen += ids.size
        if shard.num_tokens is not None and seen != shard.num_tokens:
            raise TokenCountError(
                f"{url}: holds {seen} tokens, its index entry says num_tokens = "
                f"{shard.num_tokens} ({where})"
            )
    return counts


def unigram_bits(
    model_counts: np.ndarray, eval_counts: np.ndarray, *, smoothing: float = 1.0
) -> float:
    """Cross-entropy of `eval_counts`' tokens under the frequencies of `model_counts`.

    Args:
        model_counts: token counts the unigram model is estimated from.
        eval_counts: token counts of the text it is scored on (the same array for the entropy
            of one split).
        smoothing: added to every count (Laplace), so that an id absent from `model_counts`
            costs finite bits; 0 gives the plain entropy when both arrays are the same.

    Returns:
        Bits per token (per byte for the byte tokenizer).
    """
    if model_counts.shape != eval_counts.shape:
        raise ValueError(
            f"count arrays differ in vocabulary: {model_counts.shape} vs {eval_counts.shape}"
        )
    probs = (model_counts + smoothing) / (model_counts.sum() + smoothing * model_counts.size)
    used = eval_counts > 0
    if (probs[used] <= 0).any():
        raise ValueError("an evaluated id has probability 0: give smoothing > 0")
    total_bits = float(-(eval_counts[used] * np.log2(probs[used])).sum())
    return total_bits / max(1, int(eval_counts.sum()))


@dataclass(frozen=True)
class UnigramBaseline:
    """The unigram figures of a training split and, optionally, its validation split."""

    unit: str  # "byte" (byte tokenizer) or "token"
    train_entropy: float  # bits per unit of the training split under its own frequencies
    val_cross_entropy: float | None  # bits per unit of the validation split, train frequencies
    train_tokens: int
    val_tokens: int

    def describe(self) -> str:
        """One line for a report."""
        text = (
            f"unigram baseline: training split entropy {self.train_entropy:.3f} bits per "
            f"{self.unit} ({self.train_tokens:,} tokens)"
        )
        if self.val_cross_entropy is not None:
            text += (
                f"; validation split under the training frequencies "
                f"{self.val_cross_entropy:.3f} bits per {self.unit} ({self.val_tokens:,} tokens)"
            )
        return text


def unigram_baseline(
    train: ShardIndex,
    train_where: str,
    val: ShardIndex | None = None,
    val_where: str = "",
    *,
    storage_options: dict[str, Any] | None = None,
) -> UnigramBaseline:
    """The unigram figures of `train` (and `val`), in bits per byte for the byte tokenizer.

    Raises:
        TokenCountError: see `count_tokens`, or a validation index of another tokenizer.
    """
    tokenizer = tokenizer_facts(train, train_where)
    train_counts = count_tokens(train, train_where, storage_options=storage_options)
    if not train_counts.any():
        raise TokenCountError(f"{train_where}: holds no tokens")
    val_bits, val_tokens = None, 0
    if val is not None:
        if tokenizer_facts(val, val_where) != tokenizer:
            raise TokenCountError(
                f"{val_where}: tokenizer {val.tokenizer} differs from {train_where}'s {tokenizer}"
            )
        val_counts = count_tokens(val, val_where, storage_options=storage_options)
        val_bits = unigram_bits(train_counts, val_counts)
        val_tokens = int(val_counts.sum())
    entropy = unigram_bits(train_counts, train_counts, smoothing=0.0)
    return UnigramBaseline(
        unit="byte" if tokenizer["name"] == BYTES_TOKENIZER else "token",
        train_entropy=entropy,
        val_cross_entropy=val_bits,
        train_tokens=int(train_counts.sum()),
        val_tokens=val_tokens,
    )
