"""Retention choice: a pure function, property-tested."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.checkpoint import steps_to_delete


def test_examples():
    assert steps_to_delete([1, 2, 3, 4], keep_last=2) == [1, 2]
    assert steps_to_delete([10, 20, 30, 40, 50], keep_last=1, keep_every=20) == [10, 30]
    assert steps_to_delete([1, 2, 3], keep_last=1, protect={1}) == [2]
    assert steps_to_delete([], keep_last=3) == []
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_delete([1], keep_last=0)


@given(
    steps=st.sets(st.integers(0, 500), max_size=40),
    keep_last=st.integers(1, 6),
    keep_every=st.integers(0, 50),
    protect=st.sets(st.integers(0, 500), max_size=2),
)
def test_properties(steps, keep_last, keep_every, protect):
    deleted = steps_to_delete(steps, keep_last=keep_last, keep_every=keep_every, protect=protect)
    kept = set(steps) - set(deleted)
    assert deleted == sorted(deleted) and set(deleted) <= set(steps)
    newest = sorted(steps)[-keep_last:]
    assert set(newest) <= kept  # the K newest stay
    assert not (set(deleted) & set(protect))  # never the protected (latest) one
    if keep_every:
        assert all(s % keep_every for s in deleted)  # milestones stay
    # Exactly K plus milestones plus protected: nothing else survives.
    expected = set(newest) | (set(protect) & set(steps))
    if keep_every:
        expected |= {s for s in steps if s % keep_every == 0}
    assert kept == expected
