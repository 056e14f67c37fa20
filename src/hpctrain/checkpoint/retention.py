"""Which committed checkpoints to delete: a pure function, property-tested."""

from __future__ import annotations

from collections.abc import Collection, Iterable


def steps_to_delete(
    committed: Iterable[int],
    *,
    keep_last: int,
    keep_every: int = 0,
    protect: Collection[int] = (),
) -> list[int]:
    """Steps of committed checkpoints to delete, oldest first.

    Kept: the `keep_last` newest, every step that is a multiple of `keep_every` (milestones,
    when `keep_every` > 0), and the steps in `protect` (the one `latest` names).
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be at least 1, got {keep_last}")
    steps = sorted(set(committed))
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]
