"""A mixture's slots shared out by weight: integer quotas, and which source every slot draws from.

`apportion` gives each source its share `n_s` of an epoch's `N` slots (largest remainder, so
`|n_s - w_s N| < 1`); a `Schedule` interleaves the quotas so that `C_s(x)`, the slots of source
`s` among the first `x`, is a closed form (steps 1 and 3 of `hpctrain.data.mixture`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Weights become integers in these units before apportioning (exact, platform-independent;
# fine enough that the rounding adds less than N / 2**52 samples to any source's count).
WEIGHT_UNITS = 1 << 52


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split by `weights` with the largest-remainder method, in integers.

    Weights first become integers in `WEIGHT_UNITS` (largest remainder too), so the result is
    exact and the same on every platform; ties go to the earlier source.
    """
    units = _largest_remainder(WEIGHT_UNITS, [float(w) for w in weights], float(sum(weights)))
    return _largest_remainder_int(total, units)


def _largest_remainder(total: int, weights: list[float], weight_sum: float) -> list[int]:
    shares = [w / weight_sum * total for w in weights]
    base = [math.floor(x) for x in shares]
    left = total - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(shares[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return base


def _largest_remainder_int(total: int, units: list[int]) -> list[int]:
    unit_sum = sum(units)
    base = [total * u // unit_sum for u in units]
    rest = [total * u % unit_sum for u in units]
    left = total - sum(base)
    for i in sorted(range(len(units)), key=lambda i: (-rest[i], i))[:left]:
        base[i] += 1
    return base


class Schedule:
    """Which source every slot of a stage draws from: Bresenham splits in a binary tree.

    At a tree node holding sources `lo..hi-1` with quota `q` (left half `a`), the first `y`
    slots of the node give `(y a + q // 2) // q` to the left half: monotone, steps of 0 or 1,
    within 1/2 of `y a / q`, and exactly `a` at `y = q`. A source's count `C_s(x)` is that
    split applied down the tree, so `C_s(total) = quota_s` exactly.
    """

    def __init__(self, quotas: Sequence[int]) -> None:
        self.quotas = np.asarray(quotas, dtype=np.int64)
        self.total = int(self.quotas.sum())
        self.depth = math.ceil(math.log2(len(self.quotas))) if len(self.quotas) > 1 else 0

    def counts(self, x: np.ndarray | Sequence[int]) -> np.ndarray:
        """`C_s(x)` for every source (rows) and slot count in `x` (columns, clipped to
        [0, total])."""
        y = np.clip(np.asarray(x, dtype=np.int64), 0, self.total)
        out = np.empty((len(self.quotas), len(y)), dtype=np.int64)
        cumulative = np.concatenate([[0], np.cumsum(self.quotas)])

        def split(lo: int, hi: int, y: np.ndarray) -> None:
            if hi - lo == 1:
                out[lo] = y
                return
            mid = (lo + hi) // 2
            a = int(cumulative[mid] - cumulative[lo])
            q = int(cumulative[hi] - cumulative[lo])
            left = (y * a + q // 2) // q if q else np.zeros_like(y)
            split(lo, mid, left)
            split(mid, hi, y - left)

        split(0, len(self.quotas), y)
        return out

    def sources(self, lo: int, hi: int) -> np.ndarray:
        """The source of each slot in [lo, hi) (0 <= lo <= hi <= total)."""
        steps = np.diff(self.counts(np.arange(lo, hi + 1)), axis=1)
        return np.argmax(steps, axis=0) if hi > lo else np.zeros(0, dtype=np.int64)
