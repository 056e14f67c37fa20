"""Which committed checkpoints to keep and which is best: pure functions, property-tested."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

MODES = ("max", "min")


def best_steps(scores: Mapping[int, float], *, keep_best: int, mode: str = "max") -> list[int]:
    """The `keep_best` steps with the best scores, best first.

    `mode` "max" prefers higher scores ("val_accuracy"), "min" lower ones ("val_loss"). A tie
    goes to the earlier step: it reached the score first, and a later equal score is no
    improvement. Non-finite scores (a NaN loss) are never best.
    """
    if mode not in MODES:
        raise ValueError(f"checkpoint.mode must be one of {'|'.join(MODES)}, got {mode!r}")
    if keep_best <= 0:
        return []
    sign = -1.0 if mode == "max" else 1.0
    finite = [(sign * score, step) for step, score in scores.items() if math.isfinite(score)]
    return [step for _, step in sorted(finite)[:keep_best]]


def steps_to_delete(
    committed: Iterable[int],
    *,
    keep_last: int,
    keep_every: int = 0,
    protect: Collection[int] = (),
    scores: Mapping[int, float] | None = None,
    keep_best: int = 0,
    mode: str = "max",
) -> list[int]:
    """Steps of committed checkpoints to delete, oldest first.

    Kept: the `keep_last` newest, every step that is a multiple of `keep_every` (milestones,
    when `keep_every` > 0), the steps in `protect` (the one `latest` names), and the
    `keep_best` best of the committed steps that have a score in `scores` (see `best_steps`).
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be at least 1, got {keep_last}")
    steps = sorted(set(committed))
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    if scores:
        scored = {s: scores[s] for s in steps if s in scores}
        keep |= set(best_steps(scored, keep_best=keep_best, mode=mode))
    return [s for s in steps if s not in keep]
