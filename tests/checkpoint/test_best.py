"""Best checkpoints: `best_steps`/`steps_to_delete` with scores (pure, property-tested) and
the manager's `best` pointer and retention on disk."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checkpoint import CheckpointManager, committed_steps
from hpctrain.checkpoint.retention import best_steps, steps_to_delete
from hpctrain.checkpoint.storage import open_store
from tests.checkpoint.test_manager import make_model, states_of


def test_best_steps_examples():
    scores = {10: 0.5, 20: 0.9, 30: 0.7, 40: 0.9}
    assert best_steps(scores, keep_best=2, mode="max") == [20, 40]  # a tie: the earlier first
    assert best_steps(scores, keep_best=1, mode="min") == [10]
    assert best_steps({1: math.nan, 2: 3.0, 3: math.inf}, keep_best=3, mode="min") == [2]
    assert best_steps(scores, keep_best=0) == []
    with pytest.raises(ValueError, match="checkpoint.mode"):
        best_steps(scores, keep_best=1, mode="maximum")


def test_keep_last_never_deletes_the_best():
    scores = {1: 0.99, 2: 0.98, 3: 0.2, 4: 0.3, 5: 0.4}
    assert steps_to_delete([1, 2, 3, 4, 5], keep_last=2, scores=scores, keep_best=1) == [2, 3]
    assert steps_to_delete([1, 2, 3, 4, 5], keep_last=2, scores=scores, keep_best=2) == [3]
    # keep_best=0: scores do not matter
    assert steps_to_delete([1, 2, 3], keep_last=1, scores=scores) == [1, 2]


scores_strategy = st.dictionaries(
    st.integers(0, 300),
    st.one_of(st.floats(-5, 5), st.just(math.nan)),
    max_size=30,
)


# No deadline: one failure on a loaded 2-core machine did not reproduce; hypothesis's 200 ms
# deadline per example is the likely cause, and the function's speed is not what is tested.
@settings(deadline=None)
@given(
    steps=st.sets(st.integers(0, 300), max_size=30),
    scores=scores_strategy,
    keep_last=st.integers(1, 5),
    keep_best=st.integers(0, 4),
    mode=st.sampled_from(["max", "min"]),
)
def test_retention_with_scores_properties(steps, scores, keep_last, keep_best, mode):
    deleted = steps_to_delete(
        steps, keep_last=keep_last, scores=scores, keep_best=keep_best, mode=mode
    )
    kept = set(steps) - set(deleted)
    scored = {s: v for s, v in scores.items() if s in steps}
    best = best_steps(scored, keep_best=keep_best, mode=mode)
    # Exactly the K newest plus the best of the committed ones: nothing else survives.
    assert kept == set(sorted(steps)[-keep_last:]) | set(best)
    finite = [v for v in scored.values() if math.isfinite(v)]
    assert len(best) == min(keep_best, len(finite))
    if best:
        top = max(finite) if mode == "max" else min(finite)
        assert scored[best[0]] == top  # `best` names a checkpoint with the best score
        # every deleted scored checkpoint is no better than the worst one kept as best
        worst_kept = scored[best[-1]]
        for s in deleted:
            if s in scored and math.isfinite(scored[s]):
                assert (scored[s] <= worst_kept) if mode == "max" else (scored[s] >= worst_kept)


def _save(manager, model, optimizer, step, score):
    manager.save(step, states_of(model, optimizer, step), score=score)


def test_manager_keeps_best_and_points_to_it(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(
        str(root), keep_last=1, monitor="val_accuracy", mode="max", keep_best=2
    )
    for step, score in [(1, 0.3), (2, 0.8), (3, None), (4, 0.5), (5, 0.6), (6, 0.1)]:
        _save(manager, model, optimizer, step, score)
    store = open_store(str(root))
    # newest (6) by keep_last, 2 (0.8) and 5 (0.6) as the best two; 4 fell out when 5 came
    assert committed_steps(store) == [2, 5, 6]
    assert (root / "best").read_text() == "step-2\n"
    assert manager.best_step() == 2
    manifest = json.loads((root / "step-5" / "manifest.json").read_text())
    assert manifest["score"] == {"monitor": "val_accuracy", "value": 0.6}
    manager.close()

    # A later run ranking by another metric does not compare val_accuracy scores with its own.
    manager = CheckpointManager(str(root), keep_last=1, monitor="val_loss", mode="min", keep_best=1)
    _save(manager, model, optimizer, 7, 0.9)
    assert committed_steps(store) == [7]
    assert (root / "best").read_text() == "step-7\n"
    manager.close()


def test_rollback_repoints_best(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=5, monitor="val_loss", mode="min", keep_best=1)
    for step, score in [(1, 2.0), (2, 1.0), (3, 0.5)]:
        _save(manager, model, optimizer, step, score)
    assert manager.best_step() == 3
    manager.close()
    # Resuming from step 2 sets step 3 aside: `best` must not name it any more.
    manager = CheckpointManager(str(root), keep_last=5, monitor="val_loss", mode="min", keep_best=1)
    assert manager.load(states_of(model, optimizer), which=str(root / "step-2")) == 2
    assert manager.best_step() == 2
    manager.close()


def test_bad_best_settings(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.monitor"):
        CheckpointManager(str(tmp_path / "a"), keep_last=1, keep_best=1)
    with pytest.raises(ValueError, match="checkpoint.mode"):
        CheckpointManager(str(tmp_path / "b"), keep_last=1, monitor="x", mode="up", keep_best=1)
