"""Several sources in one run, mixed by weight: the mixture's part of the pure epoch plan.

A mixture is a list of sources (each an index of shards) with weights. Its shards are
concatenated into one shard list (source `s` owns the global shard ids
`first_shard .. first_shard + num_shards - 1`), so reading, decoding, retries and errors are
the single-source code unchanged; only *which* sample a slot reads differs.

The plan of an epoch (a pure function of the sources' shard sizes, the weights, seed, epoch,
world size, workers, batch size and remainder policy):

1. The epoch has `N` *slots*: `data.samples_per_epoch`, or by default the sources' total
   samples. Each source gets `n_s` of them, the largest-remainder apportionment of `N` by the
   weights (so `|n_s - w_s N| < 1`).
2. Every source is an endless *stream*: pass 0 of its shards (permuted from (seed, source,
   pass)), then pass 1 in another permutation, and so on. Epoch `e` reads positions
   `[e n_s, (e + 1) n_s)` of it: a small source repeats (a new permutation per pass, passes
   counted per source), a large one continues next epoch where this one stopped. A sample
   is thus read at most once per pass of its source.
3. Which source slot `x` draws from is decided by a `Schedule`: a balanced binary tree of
   Bresenham splits over the quotas `n_s`. `C_s(x)`, the slots of source `s` among the first
   `x`, is a closed form, so any slot range maps to one contiguous range of every source's
   stream. Over any window of `n` consecutive slots, `|count_s - w_s n| <= depth + 1`
   (`depth = ceil(log2(number of sources))`: 1 for two sources, 3 for five).
4. The slots are planned exactly like one source's samples (`EpochPlan`: contiguous
   streams per (rank, worker), equal batches per rank, `drop`/`pad`, block shuffle): a stream
   reads one contiguous range of every source and interleaves them by the schedule. Within a
   stream's reading order the window bound of step 3 holds; a shuffle buffer moves samples
   only inside its block, which adds at most the two partial blocks at a window's ends.
5. `drop` leaves out the last slots, which take the last positions of every source's range
   for the epoch; which of the range's samples those are rotates with the epoch (a window
   moving on by the dropped count each epoch is put at the range's end, as
   `planning.drop_window` does for one source), so a one-shard source (whose passes all
   read in one order) does not leave the same samples out of every epoch.

Elastic resume: the samples not yet emitted are gathered per source (stream by stream, as
for one source) and the next stage mixes those with quotas equal to what is left of each, so
every remaining planned sample of every source is read exactly once.

A resume across runs is `hpctrain.data.mixture_resume` (also when the weights changed); the
mixture's sources are opened by `hpctrain.data.mixture_index`; the apportionment and the
`Schedule` of steps 1 and 3 are `hpctrain.data.apportion`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from hpctrain.data.apportion import Schedule, apportion
from hpctrain.data.planning import (
    EpochPlan,
    PlanError,
    SampleSequence,
    Segment,
    StageParams,
    cut_window,
    derive_seed,
    drop_window,
    num_left_out,
)

# slot indices times quotas must fit in int64 (the schedule's closed form multiplies them)
MAX_SLOTS = 3_000_000_000
# An epoch's plan holds one segment per shard per pass of each source (a pass costs ~70 us to
# plan however small its source): these bound a rank's planning time (seconds) and memory (a
# few hundred MB) when a small source repeats, e.g. a large data.samples_per_epoch.
MAX_PASSES_PER_EPOCH = 100_000
MAX_PLAN_SEGMENTS = 1 << 24
_CHUNK = 1 << 16  # slots whose source is computed at once in a worker
T = TypeVar("T")


class MixtureError(PlanError):
    """A mixture that cannot work: a bad weight, sources that disagree on the sample kind."""


@dataclass(frozen=True)
class Source:
    """One source of a mixture.

    Attributes:
        name: unique; names its metrics (`samples_seen/<name>`).
        weight: relative share of the slots (> 0).
        first_shard: global id of its first shard in the mixture's shard list.
        shard_sizes: samples per shard, in its index's order.
        digest: the identity of its shards (`index.shards_digest`; "": unknown), kept in
            loader states so that a resume notices shards replaced in place.
    """

    name: str
    weight: float
    first_shard: int
    shard_sizes: tuple[int, ...]
    digest: str = ""

    @property
    def num_samples(self) -> int:
        return sum(self.shard_sizes)


@dataclass(frozen=True)
class SourceOrigin:
    """Where a source's stream starts at the mixture's origin epoch.

    Attributes:
        leftover: (global shard, start, end) ranges read first: what an interrupted epoch
            had not read when the weights changed.
        position: then its pass sequence from this position on (pass = position // size).
    """

    leftover: tuple[tuple[int, int, int], ...] = ()
    position: int = 0

    @property
    def num_leftover(self) -> int:
        return sum(e - s for _, s, e in self.leftover)


@dataclass(frozen=True)
class Mixture:
    """Sources with weights, and where their streams start (see the module docstring).

    Attributes:
        sources: in config order; their shards are concatenated in this order.
        samples_per_epoch: slots per epoch; 0: the sources' total samples.
        origin_epoch: the epoch at which `origins` hold (0 unless the weights changed).
        origins: one per source (empty: every stream starts at position 0).
    """

    sources: tuple[Source, ...]
    samples_per_epoch: int = 0
    origin_epoch: int = 0
    origins: tuple[SourceOrigin, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.sources:
            raise MixtureError("a mixture needs at least one source")
        names = [s.name for s in self.sources]
        for i, s in enumerate(self.sources):
            if names.index(s.name) != i:
                raise MixtureError(
                    f"data.train[{i}]: name {s.name!r} is also the name of data.train"
                    f"[{names.index(s.name)}]; give each source its own name "
                    "(data.train[i].name; hpctrain plan: --names a,b,...)"
                )
            if not (s.weight > 0 and math.isfinite(s.weight)):
                raise MixtureError(f"data.train[{i}].weight={s.weight!r}: must be > 0")
            if s.num_samples == 0:
                raise MixtureError(
                    f"data.train[{i}] ({s.name}): the source has no samples (or, with "
                    "data.seq_len, no sequence)"
                )
        if self.samples_per_epoch < 0 or self.num_slots > MAX_SLOTS:
            raise MixtureError(
                f"data.samples_per_epoch={self.samples_per_epoch}: must lie in [0, {MAX_SLOTS}]"
            )
        self._check_plan_size()

    def _check_plan_size(self) -> None:
        """Refuse, before any work, an epoch whose plan would repeat a small source so often
        that planning it takes minutes or all memory (the plan holds every pass)."""
        passes = [-(-q // s.num_samples) for q, s in zip(self.quotas(), self.sources, strict=True)]
        costs = [p * len(s.shard_sizes) for p, s in zip(passes, self.sources, strict=True)]
        segments = sum(costs)
        worst = max(range(len(passes)), key=lambda i: passes[i])
        if passes[worst] <= MAX_PASSES_PER_EPOCH:  # the source that adds the most segments
            worst = max(range(len(passes)), key=lambda i: (passes[i] > 1, costs[i]))
        if passes[worst] > MAX_PASSES_PER_EPOCH or (
            segments > MAX_PLAN_SEGMENTS and passes[worst] > 1
        ):
            src = self.sources[worst]
            raise MixtureError(
                f"data.samples_per_epoch={self.samples_per_epoch}: data.train[{worst}] "
                f"({src.name}, {src.num_samples} samples, weight {src.weight:g}) would be read "
                f"{passes[worst]} times per epoch ({segments} shard passes in all); an epoch "
                f"plans at most {MAX_PASSES_PER_EPOCH} passes of a source and "
                f"{MAX_PLAN_SEGMENTS} shard passes: lower data.samples_per_epoch or that "
                "source's weight"
            )

    @property
    def num_slots(self) -> int:
        """Slots (samples) per epoch."""
        return self.samples_per_epoch or sum(s.num_samples for s in self.sources)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def quotas(self) -> list[int]:
        """Slots of each source per epoch: `num_slots` apportioned by the weights."""
        return apportion(self.num_slots, [s.weight for s in self.sources])

    def with_shard_sizes(self, sizes: Sequence[int]) -> Mixture:
        """The same mixture over other items per shard (all shards, in the mixture's order):
        `data.seq_len` counts packed sequences instead of stored samples."""
        sources = tuple(
            replace(s, shard_sizes=tuple(sizes[s.first_shard : s.first_shard + len(s.shard_sizes)]))
            for s in self.sources
        )
        return Mixture(sources, self.samples_per_epoch, self.origin_epoch, self.origins)

    def origin(self, s: int) -> SourceOrigin:
        return self.origins[s] if self.origins else SourceOrigin()

    def source_of_shard(self) -> np.ndarray:
        """The source of every global shard id."""
        return np.repeat(np.arange(len(self.sources)), [len(s.shard_sizes) for s in self.sources])

    def source_slice(self, s: int, seed: int, lo: int, hi: int) -> SampleSequence:
        """Positions [lo, hi) of source `s`'s stream (relative to the origin) as a sequence."""
        src, origin = self.sources[s], self.origin(s)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if origin.leftover:
            left = np.asarray(origin.leftover, dtype=np.int64).reshape(-1, 3)
            seq = SampleSequence(left[:, 0], left[:, 1], left[:, 2])
            parts.append(cut(seq, min(lo, seq.num_samples), min(hi, seq.num_samples)))
            lo, hi = max(lo - seq.num_samples, 0), max(hi - seq.num_samples, 0)
        lo, hi = lo + origin.position, hi + origin.position
        size = src.num_samples
        sizes = np.asarray(src.shard_sizes, dtype=np.int64)
        for p in range(lo // size, -(-hi // size)):
            order = _pass_order(seed, s, p, len(sizes))
            seq = SampleSequence(
                order + src.first_shard, np.zeros(len(order), np.int64), sizes[order]
            )
            parts.append(cut(seq, max(lo - p * size, 0), min(hi - p * size, size)))
        return _sequence(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a loader state: what a resume needs to find the origin again."""
        return {
            "names": list(self.names),
            "weights": [s.weight for s in self.sources],
            "num_shards": [len(s.shard_sizes) for s in self.sources],
            "num_samples": [s.num_samples for s in self.sources],
            "digests": [s.digest for s in self.sources],
            "samples_per_epoch": self.samples_per_epoch,
            "origin_epoch": self.origin_epoch,
            "origins": [
                {"leftover": [list(r) for r in o.leftover], "position": o.position}
                for o in self.origins
            ],
        }


def cut(seq: SampleSequence, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions [lo, hi) of `seq` as (shard, start, end) arrays (vectorised `slice`)."""
    if hi <= lo:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    first = int(np.searchsorted(seq.offsets, lo, side="right")) - 1
    last = int(np.searchsorted(seq.offsets, hi, side="left"))
    shard = seq.shard[first:last]
    start = seq.start[first:last].copy()
    end = seq.end[first:last].copy()
    start[0] += lo - seq.offsets[first]
    end[-1] -= seq.offsets[last] - hi
    return shard, start, end


def _sequence(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> SampleSequence:
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return SampleSequence(empty, empty, empty)
    sh, st, en = (np.concatenate([p[i] for p in parts]) for i in range(3))
    if len(sh) > 1:  # coalesce neighbours (same shard, contiguous): a shard opened once
        join = (sh[1:] == sh[:-1]) & (st[1:] == en[:-1])
        head = np.concatenate([[True], ~join])
        last_of_group = np.concatenate([head[1:], [True]])
        sh, st, en = sh[head], st[head], en[last_of_group]
    return SampleSequence(sh, st, en)


def _pass_order(seed: int, source: int, pass_: int, num_shards: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(derive_seed(seed, source, pass_, 0x313C)))
    return rng.permutation(num_shards)


def _expand(segments: Sequence[Segment]) -> Iterator[tuple[int, int, bool]]:
    for seg in segments:
        for i in range(seg.start, seg.end):
            yield seg.shard, i, seg.valid


def interleave(
    the_plan: MixturePlan,
    rank: int,
    stream: int,
    skip: int,
    read: Callable[[list[Segment]], Iterator[T]],
) -> Iterator[T]:
    """A stream's items from `skip` on in reading order: one reader per source (each keeps
    its shard open), taken from in the order the schedule gives."""
    for per_source, chunks in the_plan.stream_reads(rank, stream, skip):
        readers = [read(segs) for segs in per_source]
        try:
            for chunk in chunks:
                for s in chunk.tolist():
                    yield next(readers[s])
        finally:
            for reader in readers:
                close = getattr(reader, "close", None)
                if close is not None:
                    close()


def source_counts(
    owner: np.ndarray, num_sources: int, shards: list[int], ok: list[bool]
) -> list[int]:
    """Per source, how many of a batch's samples (`shards` with flags `ok`) are valid."""
    counts = np.bincount(
        owner[np.asarray(shards, dtype=np.int64)][np.asarray(ok, dtype=bool)], minlength=num_sources
    )
    return [int(c) for c in counts]


class MixturePlan(EpochPlan):
    """One stage's plan of a mixture: `EpochPlan`'s geometry over slots, each slot mapped to a
    sample of one source by the `Schedule`.

    Its `sequence` is the stage's slot space (one segment, shard -1); `sources[s]` is the
    sequence of source `s`'s samples this stage reads, in the order its slots take them.
    """

    def __init__(
        self,
        sources: Sequence[SampleSequence],
        params: StageParams,
        *,
        seed: int = 0,
        epoch: int = 0,
        stage: int = 0,
    ) -> None:
        self.sources = list(sources)
        self.schedule = Schedule([s.num_samples for s in self.sources])
        n = self.schedule.total
        slots = SampleSequence(np.array([-1]), np.array([0]), np.array([n]))
        super().__init__(slots, params, seed=seed, epoch=epoch, stage=stage)

    # -- what a stream reads -------------------------------------------------------------

    def stream_runs(self, rank: int, worker: int) -> list[Segment]:
        """The stream's slot ranges in reading order (`valid=False`: padding repeats)."""
        a, b = self.stream_slots(rank, worker)
        return self._slot_segments(a, b)

    def run_sources(self, lo: int, hi: int, valid: bool = True) -> list[list[Segment]]:
        """Per source, the segments slots [lo, hi) read (in reading order)."""
        c = self.schedule.counts([lo, hi])
        return [seq.slice(int(c[s, 0]), int(c[s, 1]), valid) for s, seq in enumerate(self.sources)]

    def stream_segments(self, rank: int, worker: int) -> list[Segment]:
        """What stream (rank, worker) reads, source by source (not interleaved)."""
        return [
            seg
            for run in self.stream_runs(rank, worker)
            for segs in self.run_sources(run.start, run.end, run.valid)
            for seg in segs
        ]

    def stream_reads(
        self, rank: int, worker: int, skip: int
    ) -> Iterator[tuple[list[list[Segment]], Iterator[np.ndarray]]]:
        """The stream from item `skip` on, run by run: (per-source segments, the source of
        each item in chunks). What a loader worker reads, interleaving the sources."""
        base = 0
        for run in self.stream_runs(rank, worker):
            length = run.end - run.start
            if skip < base + length:
                lo = run.start + max(skip - base, 0)
                yield self.run_sources(lo, run.end, run.valid), self._chunks(lo, run.end)
            base += length

    def _chunks(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        for a in range(lo, hi, _CHUNK):
            yield self.schedule.sources(a, min(a + _CHUNK, hi))

    def emission_order(self, rank: int, worker: int) -> list[tuple[int, int, bool]]:
        items: list[tuple[int, int, bool]] = []
        for per_source, chunks in self.stream_reads(rank, worker, 0):
            readers = [_expand(segs) for segs in per_source]
            for chunk in chunks:
                items.extend(next(readers[s]) for s in chunk.tolist())
        if self.params.shuffle_buffer <= 1:
            return items
        buf = self.block_size
        out: list[tuple[int, int, bool]] = []
        for block, lo in enumerate(range(0, len(items), buf)):
            chunk_items = items[lo : lo + buf]
            order = self.shuffle_order(rank, worker, block, len(chunk_items))
            out.extend(chunk_items[j] for j in order)
        return out

    # -- resume --------------------------------------------------------------------------

    def remaining_sources(self, consumed: int) -> list[SampleSequence]:
        """Per source, its samples not yet emitted after `consumed` batches per rank.

        Stream by stream (rank-major), as `EpochPlan.remaining_sequence`; padding repeats
        and dropped slots are not carried over.
        """
        n = self.num_samples
        num_sources = len(self.sources)
        parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [
            [] for _ in range(num_sources)
        ]

        def add_slots(lo: int, hi: int) -> None:
            hi = min(hi, n)
            if hi <= lo:
                return
            c = self.schedule.counts([lo, hi])
            for s in range(num_sources):
                parts[s].append(cut(self.sources[s], int(c[s, 0]), int(c[s, 1])))

        def add_single(slots: np.ndarray) -> None:
            slots = slots[slots < n]
            if not len(slots):
                return
            before = self.schedule.counts(slots)
            after = self.schedule.counts(slots + 1)
            which = np.argmax(after - before, axis=0)
            for s in range(num_sources):
                pos = before[s, which == s]
                if len(pos):
                    sh, ix = self.sources[s].positions(pos)
                    parts[s].append((sh, ix, ix + 1))

        for left, lo, hi in self.remaining_slots(consumed):
            add_single(left)
            add_slots(lo, hi)
        return [_sequence(p) for p in parts]

    def remaining_sequence(self, consumed: int) -> SampleSequence:
        raise TypeError("a mixture's stage continues per source: use remaining_sources")

    # -- reporting -----------------------------------------------------------------------

    def source_table(self) -> np.ndarray:
        """Valid samples of every source (columns) in every stream (rows, rank-major),
        vectorised: the realized mixture per stream."""
        a, b = self.slot_ranges(*self.all_streams())
        n = self.num_samples
        lo = self.schedule.counts(np.minimum(a, n))
        hi = self.schedule.counts(np.minimum(b, n))
        return (hi - lo).T

    def stream_table(self) -> dict[str, np.ndarray]:
        table = super().stream_table()
        a, b = self.slot_ranges(*self.all_streams())
        n = self.num_samples
        va, vb = np.minimum(a, n), np.minimum(b, n)
        clo, chi = self.schedule.counts(va), self.schedule.counts(vb)
        shards = np.zeros(len(a), dtype=np.int64)
        partial = np.zeros(len(a), dtype=np.int64)
        for s, seq in enumerate(self.sources):
            lo, hi = clo[s], chi[s]
            first = np.searchsorted(seq.offsets, lo, side="right") - 1
            last = np.searchsorted(seq.offsets, hi, side="left")
            some = hi > lo
            shards += np.where(some, last - first, 0)
            top = len(seq.offsets) - 1
            cut_start = some & (seq.offsets[np.clip(first, 0, top)] != lo)
            cut_end = some & (seq.offsets[np.clip(last, 0, top)] != hi)
            partial += np.minimum(
                cut_start.astype(np.int64) + cut_end, np.where(some, last - first, 0)
            )
        table["shards"], table["partial"] = shards, partial
        return table

    def segment_table(self) -> dict[str, np.ndarray]:
        """Every stream's segments as arrays, streams in rank-major order and each stream's
        segments in `stream_segments` order: stream, shard, start, end, valid. Vectorised
        (W=4096, K=8, 100k shards in a fraction of a second)."""
        a, b = self.slot_ranges(*self.all_streams())
        n = self.num_samples
        clo = self.schedule.counts(np.minimum(a, n))
        chi = self.schedule.counts(np.minimum(b, n))
        pieces = [_split_ranges(seq, clo[s], chi[s]) for s, seq in enumerate(self.sources)]
        stream, shard, start, end = (np.concatenate([p[i] for p in pieces]) for i in range(4))
        valid = np.ones(len(stream), dtype=bool)
        k = self.streams_per_rank
        padded = np.nonzero(b > n)[0]
        if len(padded):  # padded streams: the slow path, few of them
            keep = ~np.isin(stream, padded)
            extra = [
                (i, seg) for i in padded.tolist() for seg in self.stream_segments(i // k, i % k)
            ]
            stream = np.concatenate([stream[keep], [i for i, _ in extra]]).astype(np.int64)
            shard = np.concatenate([shard[keep], [g.shard for _, g in extra]]).astype(np.int64)
            start = np.concatenate([start[keep], [g.start for _, g in extra]]).astype(np.int64)
            end = np.concatenate([end[keep], [g.end for _, g in extra]]).astype(np.int64)
            valid = np.concatenate([valid[keep], [g.valid for _, g in extra]]).astype(bool)
        order = np.argsort(stream, kind="stable")  # sources were cut one after the other
        return {
            "stream": stream[order],
            "shard": shard[order],
            "start": start[order],
            "end": end[order],
            "valid": valid[order],
        }

    def all_segments(self) -> list[list[Segment]]:
        """`stream_segments` of every stream (rank-major), vectorised for big plans."""
        t = self.segment_table()
        out: list[list[Segment]] = [[] for _ in range(self.world_size * self.streams_per_rank)]
        for i, sh, st, en, ok in zip(
            t["stream"].tolist(),
            t["shard"].tolist(),
            t["start"].tolist(),
            t["end"].tolist(),
            t["valid"].tolist(),
            strict=True,
        ):
            out[i].append(Segment(sh, st, en, ok))
        return out


def _split_ranges(
    seq: SampleSequence, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous, nondecreasing position ranges [lo_i, hi_i) of `seq` cut at its segment
    boundaries: (range index, shard, start, end) of every piece, in order."""
    cuts = np.unique(np.concatenate([seq.offsets, lo, hi]))
    plo = cuts[:-1]
    seg = np.searchsorted(seq.offsets, plo, side="right") - 1
    which = np.searchsorted(lo, plo, side="right") - 1
    inside = (which >= 0) & (plo < hi[np.maximum(which, 0)]) & (plo >= lo[np.maximum(which, 0)])
    plo, phi = plo[inside], cuts[1:][inside]
    seg, which = seg[inside], which[inside]
    start = seq.start[seg] + (plo - seq.offsets[seg])
    return which, seq.shard[seg], start, start + (phi - plo)


def plan_mixture(
    mixture: Mixture,
    *,
    world_size: int,
    workers_per_rank: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    remainder: str = "drop",
    shuffle_buffer: int = 0,
    stages: Sequence[StageParams] = (),
    rotate_dropped: bool = True,
) -> MixturePlan:
    """The plan of one epoch of a mixture (pure; identical on every rank).

    Args as `hpctrain.data.planning.plan`; `mixture` replaces the shard sizes (shards are
    always permuted: mixtures are for training).
    """
    if epoch < mixture.origin_epoch:
        raise MixtureError(
            f"epoch {epoch} comes before the mixture's origin (epoch {mixture.origin_epoch}, "
            "where its weights last changed)"
        )
    quotas = mixture.quotas()
    sources = [
        mixture.source_slice(
            s, seed, (epoch - mixture.origin_epoch) * q, (epoch - mixture.origin_epoch + 1) * q
        )
        for s, q in enumerate(quotas)
    ]
    params = StageParams(
        world_size=world_size,
        workers_per_rank=workers_per_rank,
        batch_size=batch_size,
        remainder=remainder,
        shuffle_buffer=shuffle_buffer,
    )
    dropped = num_left_out(sum(quotas), stages[0] if stages else params)
    if dropped and rotate_dropped:
        kept = Schedule(quotas).counts([sum(quotas) - dropped])[:, 0]
        # counted from the origin: its epoch drops the tail, as before the rotation, so
        # an interrupted epoch's leftovers (read first, `rebase`) are all read
        since = epoch - mixture.origin_epoch
        sources = [
            _dropping_last(seq, q - int(k), since)
            for seq, q, k in zip(sources, quotas, kept, strict=True)
        ]
    for i, st in enumerate(stages):
        earlier = MixturePlan(sources, st, seed=seed, epoch=epoch, stage=i)
        sources = earlier.remaining_sources(st.consumed)
    return MixturePlan(sources, params, seed=seed, epoch=epoch, stage=len(stages))


def _dropping_last(sequence: SampleSequence, num_dropped: int, epoch: int) -> SampleSequence:
    """`sequence` with the window of `num_dropped` positions this epoch leaves out
    (`planning.drop_window`) moved to its end."""
    if not num_dropped:
        return sequence
    start = drop_window(sequence.num_samples, num_dropped, epoch)
    kept, window = cut_window(sequence, start, num_dropped)
    return SampleSequence(*(np.concatenate([a, b]) for a, b in zip(kept, window, strict=True)))
