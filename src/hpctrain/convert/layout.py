"""The shard layout of a conversion: split, order and cut into shards (pure functions of the listing and options).

Everything that decides which sample goes into which shard happens here, before any shard is
written, so that shards can be written in any order by any number of processes and still come
out byte-identical, and so that `--resume` can check it continues the same plan.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence

from hpctrain.convert.errors import ConvertOptionError
from hpctrain.convert.sources.base import SampleRef
from hpctrain.convert.tar import BLOCK_SIZE

DEFAULT_SHARD_SIZE = 256 * 10**6  # bytes: ~256 MB streams well and keeps shard counts modest

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """Parse `512MB`, `1.5GB`, `64MiB`, `1000000` into bytes (MB = 10^6, MiB = 2^20)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConvertOptionError(f"--shard-size {text!r}: expected a size like 512MB, 1GB or 64MiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConvertOptionError(f"--shard-size {text!r}: must be positive")
    return size


def split_train_val(
    samples: Sequence[SampleRef], val_fraction: float, seed: int
) -> tuple[list[SampleRef], list[SampleRef]]:
    """Deterministic split, stratified by label: round(F * n_c) samples of each class go to val.

    Both parts keep source order (shuffling is a separate step).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConvertOptionError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if val_fraction == 0.0:
        return list(samples), []
    by_label: dict[int | None, list[int]] = {}
    for position, sample in enumerate(samples):
        by_label.setdefault(sample.label, []).append(position)
    val_positions: set[int] = set()
    # Sorting labels (None first) makes the RNG draw order independent of dict insertion order.
    for label in sorted(by_label, key=lambda v: (v is not None, v or 0)):
        positions = by_label[label]
        rng = random.Random(f"hpctrain-split:{seed}:{label}")
        num_val = round(val_fraction * len(positions))
        val_positions.update(rng.sample(positions, num_val))
    train = [s for p, s in enumerate(samples) if p not in val_positions]
    val = [s for p, s in enumerate(samples) if p in val_positions]
    return train, val


def order_samples(
    samples: Sequence[SampleRef], *, shuffle: bool, seed: int, split: str
) -> list[SampleRef]:
    """Source order, or a permutation that depends only on (seed, split name)."""
    ordered = list(samples)
    if shuffle:
        random.Random(f"hpctrain-shuffle:{seed}:{split}").shuffle(ordered)
    return ordered


def estimated_bytes(sample: SampleRef) -> int:
    """Archive bytes of a sample as planned (headers + padded data), before reading it."""

    def padded(n: int) -> int:
        return BLOCK_SIZE + -(-n // BLOCK_SIZE) * BLOCK_SIZE

    if sample.members:
        return sum(padded(size) for _, _, size in sample.members)
    total = padded(sample.size) if sample.url else 0
    if sample.label is not None:
        total += padded(len(str(sample.label)))
    if sample.meta is not None:
        total += padded(len(sample.meta.encode()))
    return total + sum(padded(f.size) for f in sample.fields)


def assign_shards(
    samples: Sequence[SampleRef], *, samples_per_shard: int | None, shard_size: int | None
) -> list[list[SampleRef]]:
    """Cut the ordered samples into shards: a fixed count each, or up to `shard_size` bytes.

    With a byte target, a shard is closed before the sample that would push it past the
    target (a single larger sample gets a shard of its own). Sizes are the planned ones
    (source sizes; re-encoded images may end up smaller).
    """
    if samples_per_shard is not None:
        if samples_per_shard < 1:
            raise ConvertOptionError("--samples-per-shard must be >= 1")
        return [
            list(samples[i : i + samples_per_shard])
            for i in range(0, len(samples), samples_per_shard)
        ]
    target = shard_size or DEFAULT_SHARD_SIZE
    shards: list[list[SampleRef]] = []
    current: list[SampleRef] = []
    current_bytes = 0
    for sample in samples:
        size = estimated_bytes(sample)
        if current and current_bytes + size > target:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(sample)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def plan_fingerprint(
    shard_plans: dict[str, list[list[SampleRef]]], settings: dict[str, object]
) -> str:
    """A digest of what would be written: `--resume` refuses to continue a different plan."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for split in sorted(shard_plans):
        for i, shard in enumerate(shard_plans[split]):
            digest.update(f"\n{split}:{i}:".encode())
            for sample in shard:
                # generated sources spool to a temporary file: their origin names them instead
                where = sample.origin if sample.members and sample.origin else sample.url
                digest.update(
                    f"{sample.key}\t{where}\t{sample.label}\t{sample.meta}\t{sample.members}\t"
                    f"{sample.fields}\t{sample.error}\n".encode()
                )
    return digest.hexdigest()
