"""Properties of the epoch plan: equal batches, every sample once, determinism, resume."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.data import PlanError, StageParams, plan


def test_bad_remainder_is_a_value_error():
    with pytest.raises(PlanError, match="remainder"):
        plan([3], world_size=1, workers_per_rank=0, batch_size=1, remainder="keep")


def stream_items(p, rank, worker):
    return [
        (s.shard, i, s.valid)
        for s in p.stream_segments(rank, worker)
        for i in range(s.start, s.end)
    ]


def all_items(p):
    return [
        item
        for rank in range(p.world_size)
        for worker in range(p.streams_per_rank)
        for item in stream_items(p, rank, worker)
    ]


plan_args = st.fixed_dictionaries(
    {
        "shard_sizes": st.lists(st.integers(0, 40), min_size=1, max_size=25),
        "world_size": st.integers(1, 512),
        "workers_per_rank": st.integers(0, 16),
        "batch_size": st.integers(1, 9),
        "seed": st.integers(0, 2**32),
        "epoch": st.integers(0, 1000),
        "remainder": st.sampled_from(["drop", "pad"]),
        "shuffle_buffer": st.sampled_from([0, 1, 3, 16]),
    }
)


@settings(max_examples=150, deadline=None)
@given(plan_args)
def test_every_rank_equal_batches_and_every_sample_once(args):
    total = sum(args["shard_sizes"])
    p = plan(**args)
    w, k, b = args["world_size"], max(args["workers_per_rank"], 1), args["batch_size"]
    per_rank = []
    for rank in range(w):
        n = sum(len(stream_items(p, rank, worker)) for worker in range(k))
        per_rank.append(n)
        for worker in range(k):
            assert len(stream_items(p, rank, worker)) == p.stream_batches(worker) * b
    assert per_rank == [p.batches_per_rank * b] * w
    items = all_items(p)
    valid = Counter((s, i) for s, i, ok in items if ok)
    assert all(c == 1 for c in valid.values()), "a sample is read twice"
    assert all(0 <= i < args["shard_sizes"][s] for s, i in valid)
    if args["remainder"] == "drop":
        assert len(items) == len(valid) == total - p.num_dropped
        assert 0 <= p.num_dropped < w * b  # less than one step's worth for the whole job
        assert p.num_padded == 0
    else:
        assert len(valid) == total  # every sample, exactly once
        assert len(items) - len(valid) == p.num_padded < w * b
    # emission order is a permutation of the stream (the block shuffle loses nothing)
    for rank in range(min(w, 3)):
        for worker in range(k):
            assert sorted(p.emission_order(rank, worker)) == sorted(stream_items(p, rank, worker))


@settings(max_examples=60, deadline=None)
@given(plan_args)
def test_plan_is_deterministic(args):
    a, b = plan(**args), plan(**args)  # e.g. on two different ranks
    assert all_items(a) == all_items(b)
    assert a.summary == b.summary
    assert [a.emission_order(0, w) for w in range(a.streams_per_rank)] == [
        b.emission_order(0, w) for w in range(b.streams_per_rank)
    ]


def test_shards_permute_per_epoch_and_dropped_samples_rotate():
    sizes = [10] * 20
    kw = dict(world_size=3, workers_per_rank=2, batch_size=7, seed=1)
    orders, dropped = [], []
    for epoch in range(4):
        p = plan(sizes, epoch=epoch, **kw)
        orders.append([s for s, _i, _v in all_items(p)])
        kept = {(s, i) for s, i, _v in all_items(p)}
        dropped.append({(s, i) for s in range(20) for i in range(10)} - kept)
        assert len(dropped[-1]) == p.num_dropped == 200 - (200 // 21) * 21
    assert len({tuple(o) for o in orders}) == 4
    assert len({frozenset(d) for d in dropped}) > 1
    evaluation = plan(sizes, shuffle_shards=False, remainder="pad", **kw)
    assert [s for s, _i, _v in all_items(evaluation)][:10] == [0] * 10


def test_balance_with_equal_shards_drops_less_than_a_shard_per_rank():
    p = plan([100] * 103, world_size=8, workers_per_rank=3, batch_size=16)
    assert p.num_dropped / 8 < 100
    assert p.batches_per_rank == 10300 // 128


def test_big_plan_is_fast():
    import time

    t = time.perf_counter()
    p = plan(
        [1000 + (i % 7) for i in range(100_000)], world_size=4096, workers_per_rank=8, batch_size=64
    )
    segs = p.stream_segments(4095, 7)
    assert time.perf_counter() - t < 2.0
    assert sum(len(s) for s in segs) == p.stream_batches(7) * 64


def consumed_items(p, consumed):
    """Samples the trainer got in the first `consumed` batches of every rank."""
    out = []
    for rank in range(p.world_size):
        out.extend(p.rank_order(rank)[: consumed * p.batch_size])
    return out


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    old=st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(1, 5)),
    new=st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(1, 5)),
    buf=st.sampled_from([0, 4, 7]),
    fraction=st.floats(0, 1),
    seed=st.integers(0, 100),
)
def test_elastic_replan_sees_every_remaining_sample_exactly_once(
    sizes, old, new, buf, fraction, seed
):
    common = dict(seed=seed, epoch=3, shuffle_buffer=buf)
    first = plan(sizes, world_size=old[0], workers_per_rank=old[1], batch_size=old[2], **common)
    consumed = int(fraction * first.batches_per_rank)
    seen = consumed_items(first, consumed)
    stage = StageParams(old[0], old[1], old[2], "drop", buf, consumed)
    second = plan(
        sizes,
        world_size=new[0],
        workers_per_rank=new[1],
        batch_size=new[2],
        stages=[stage],
        **common,
    )
    rest = [item for r in range(new[0]) for item in second.rank_order(r)]
    kept = {(s, i) for s, i, _v in all_items(first)}
    both = Counter((s, i) for s, i, _v in seen + rest)
    assert all(c == 1 for c in both.values())
    assert set(both) | set() <= kept
    # everything the first stage kept is either seen, re-planned, or dropped by the second
    assert len(kept) - len(seen) == len(rest) + second.num_dropped


@settings(max_examples=60, deadline=None)
@given(plan_args)
def test_vectorised_segments_equal_per_stream_ones(args):
    p = plan(**args)
    fast = p.all_segments()
    slow = [p.stream_segments(r, w) for r in range(p.world_size) for w in range(p.streams_per_rank)]
    assert fast == slow
    table = p.stream_table()
    assert [sum(len(s) for s in segs) for segs in fast] == table["samples"].tolist()


def dropped_items(p) -> set[tuple[int, int]]:
    """The samples of the whole data (every shard's) that no stream of `p` reads."""
    sizes = p.sequence.end - p.sequence.start
    everything = {
        (int(s), i)
        for s, a, n in zip(p.sequence.shard, p.sequence.start, sizes, strict=True)
        for i in range(int(a), int(a + n))
    }
    return everything - {(s, i) for s, i, _v in all_items(p)}


@pytest.mark.parametrize("sizes", [[46], [20, 26], [5, 7, 9, 11, 14]])
def test_which_samples_are_dropped_rotates_with_the_epoch_for_any_number_of_shards(sizes):
    # 46 samples, batch 16: 14 left out of each epoch. With one shard the shard permutation
    # cannot move them: before, samples 32-45 were left out of every epoch, never trained on.
    kw = dict(world_size=1, workers_per_rank=0, batch_size=16, seed=5)
    everything = {(s, i) for s, n in enumerate(sizes) for i in range(n)}
    dropped = [dropped_items(plan(sizes, epoch=e, **kw)) for e in range(4)]
    assert [len(d) for d in dropped] == [14] * 4
    for before, after in itertools.pairwise(dropped):
        assert not before & after, "a sample left out of two epochs in a row"
    assert set().union(*dropped) == everything  # in 4 epochs every sample had its turn


def test_the_dropped_window_walks_through_the_data_in_index_order():
    kw = dict(world_size=2, workers_per_rank=3, batch_size=4, seed=0)  # 8 a step: 6 of 46
    windows = [sorted(dropped_items(plan([20, 26], epoch=e, **kw))) for e in range(3)]
    assert windows == [
        [(1, i) for i in range(20, 26)],
        [(0, i) for i in range(6)],
        [(0, i) for i in range(6, 12)],
    ]
    # epoch 8 starts at sample 40 + 8 * 6 = 88 = 46 + 42: the window wraps around the end
    assert sorted(dropped_items(plan([20, 26], epoch=8, **kw))) == [
        *((0, i) for i in range(2)),
        *((1, i) for i in range(22, 26)),
    ]


def test_evaluation_and_padding_plans_do_not_rotate():
    kw = dict(world_size=1, workers_per_rank=0, batch_size=16, seed=5, epoch=3)
    evaluation = plan([46], shuffle_shards=False, remainder="pad", **kw)
    assert [i for _s, i, _v in all_items(evaluation)][:46] == list(range(46))
    padded = plan([46], remainder="pad", **kw)
    assert [i for _s, i, _v in all_items(padded)][:46] == list(range(46))
