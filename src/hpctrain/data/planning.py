"""The epoch plan: which samples every (rank, worker) reads, decided before the epoch starts.

A pure function of (per-shard sample counts, seed, epoch, world size, workers per rank, batch
size, remainder policy, shuffle buffer). Every rank computes the same plan on its own; no
communication is needed and every rank gets the same number of batches, so the last collective
of an epoch can never hang.

How it works:

1. The epoch's *sequence*: shards in an order permuted from (seed, epoch) (training) or in
   index order (evaluation), each contributing its samples 0..n-1.
2. The sequence is cut into `world_size * streams_per_rank` contiguous *streams*, one per
   (rank, worker), sized in whole batches so that every rank holds `batches_per_rank` batches.
   A stream therefore reads whole shards plus, at its two ends, contiguous sample ranges of
   the shards it shares with its neighbours.
3. Remainder: `drop` leaves out the sequence's tail that does not fill equal batches (fewer
   than `world_size * batch_size` samples, `d`); `pad` wraps around to the sequence's start
   and flags the repeats (`valid=False`). Which samples a training epoch drops rotates with
   the epoch, whatever the number of shards: the tail is a window of `d` samples in index
   order that moves on by `d` every epoch (`drop_window`), taken out of the permuted shards
   and put at the sequence's end. So every sample has its turn, none is left out of two
   epochs in a row, and a one-shard index (where permuting shards changes nothing) does
   not leave the same samples out forever.
4. Inside a stream, samples are shuffled in blocks of `shuffle_buffer`: the stream reads one
   block (raw bytes), then emits it in an order permuted from (seed, epoch, stage, rank,
   worker, block). The output order is thus a pure function of the plan, which makes resume
   exact and cheap: recompute, jump to the block, skip without decoding.

The loader takes batches from its workers round-robin (`hpctrain.data.transport`), so rank-level
batch `j` is batch `j // K` of logical stream `j % K`; workers with fewer batches are the last
ones.

Elastic resume: after `consumed` batches per rank, the samples not yet emitted by any stream
are gathered (in stream order) into the sequence of a new *stage*, which is planned again for
the new world size / workers. A loader state is the epoch plus the list of stages.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np

from hpctrain.errors import DataError

REMAINDER_POLICIES = ("drop", "pad")


class PlanError(DataError, ValueError):
    """Plan parameters that cannot work (no samples, bad remainder policy...)."""


@dataclass(frozen=True)
class StageParams:
    """The parameters one stage of an epoch was planned with, and how far it got.

    Attributes:
        world_size: ranks.
        workers_per_rank: loader worker processes per rank (0: one in-process stream).
        batch_size: samples per batch.
        remainder: "drop" or "pad".
        shuffle_buffer: block size of the in-stream sample shuffle (0 or 1: none).
        consumed: batches per rank already handed to the trainer in this stage.
    """

    world_size: int
    workers_per_rank: int
    batch_size: int
    remainder: str = "drop"
    shuffle_buffer: int = 0
    consumed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageParams:
        return cls(
            world_size=int(data["world_size"]),
            workers_per_rank=int(data["workers_per_rank"]),
            batch_size=int(data["batch_size"]),
            remainder=str(data["remainder"]),
            shuffle_buffer=int(data["shuffle_buffer"]),
            consumed=int(data["consumed"]),
        )

    def same_layout(self, other: StageParams) -> bool:
        """True when `other` reads this stage's streams unchanged (exact resume)."""
        return (
            self.world_size,
            self.workers_per_rank,
            self.batch_size,
            self.remainder,
            self.shuffle_buffer,
        ) == (
            other.world_size,
            other.workers_per_rank,
            other.batch_size,
            other.remainder,
            other.shuffle_buffer,
        )


@dataclass(frozen=True)
class Segment:
    """Samples `start..end-1` of shard `shard`; `valid=False` marks padding repeats."""

    shard: int
    start: int
    end: int
    valid: bool = True

    def __len__(self) -> int:
        return self.end - self.start


def derive_seed(*parts: int) -> int:
    """A 64-bit seed from integers: stable across processes, platforms and Python runs."""
    # one hash of the packed parts (what updating it part by part gives): it runs per sample
    data = struct.pack(f"<{len(parts)}q", *map(int, parts))
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _rng(*parts: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(derive_seed(*parts)))


class SampleSequence:
    """An epoch stage's sample sequence as contiguous segments (numpy arrays, cheap at 100k+)."""

    def __init__(self, shard: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        keep = end > start
        self.shard = shard[keep].astype(np.int64)
        self.start = start[keep].astype(np.int64)
        self.end = end[keep].astype(np.int64)
        lengths = self.end - self.start
        self.offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    def slice(self, lo: int, hi: int, valid: bool = True) -> list[Segment]:
        """Segments covering sequence positions [lo, hi) (0 <= lo <= hi <= num_samples)."""
        if hi <= lo:
            return []
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        last = int(np.searchsorted(self.offsets, hi, side="left"))  # exclusive
        out = []
        for i in range(first, last):
            base = int(self.offsets[i])
            a = max(lo, base)
            b = min(hi, int(self.offsets[i + 1]))
            s0 = int(self.start[i])
            out.append(Segment(int(self.shard[i]), s0 + a - base, s0 + b - base, valid))
        return out

    def positions(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, sample index) of sequence positions `pos`."""
        seg = np.searchsorted(self.offsets, pos, side="right") - 1
        return self.shard[seg], self.start[seg] + (pos - self.offsets[seg])


def num_left_out(num_samples: int, params: StageParams) -> int:
    """Samples `remainder: drop` leaves out of a stage of `num_samples` planned with `params`
    that still fills a batch on every rank (0 otherwise: nothing to rotate)."""
    per_step = params.world_size * params.batch_size
    if params.remainder != "drop" or num_samples < per_step:
        return 0
    return num_samples % per_step


def drop_window(num_samples: int, num_dropped: int, epoch: int) -> int:
    """Where the `num_dropped` samples an epoch leaves out start (positions modulo
    `num_samples`): the last ones at epoch 0, then the next `num_dropped` each epoch."""
    return (num_samples - num_dropped + epoch * num_dropped) % num_samples


def cut_window(
    sequence: SampleSequence, start: int, length: int
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """`sequence` split at positions `start` and `start + length` (modulo its length): the
    pieces outside that window in sequence order, and those inside in window order, each
    as (shard, start, end) arrays. Two cut points in all, so vectorised at any size."""
    n = sequence.num_samples
    ends = np.asarray([start % n, (start + length) % n], dtype=np.int64)
    bounds = np.unique(np.concatenate([sequence.offsets, ends]))
    lo, hi = bounds[:-1], bounds[1:]
    seg = np.searchsorted(sequence.offsets, lo, side="right") - 1
    shard = sequence.shard[seg]
    first = sequence.start[seg] + (lo - sequence.offsets[seg])
    last = first + (hi - lo)
    into = (lo - start) % n  # pieces never straddle a cut: a piece is in or out
    inside = into < length
    order = np.argsort(into[inside], kind="stable")
    window = (shard[inside][order], first[inside][order], last[inside][order])
    return (shard[~inside], first[~inside], last[~inside]), window


def epoch_sequence(
    shard_sizes: Sequence[int],
    seed: int,
    epoch: int,
    shuffle_shards: bool,
    num_dropped: int = 0,
) -> SampleSequence:
    """Stage 0 of an epoch: all shards, permuted from (seed, epoch) when `shuffle_shards`.

    With `num_dropped` (> 0: the stage drops that many samples at its end), the window of
    that many samples in index order that this epoch leaves out (`drop_window`) is taken
    out of the permuted shards and put at the end, in index order.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    order = (
        _rng(seed, epoch, 0x5A4D).permutation(len(sizes))
        if shuffle_shards
        else np.arange(len(sizes))
    )
    if not num_dropped:
        return SampleSequence(order, np.zeros(len(sizes), dtype=np.int64), sizes[order])
    by_index = SampleSequence(np.arange(len(sizes)), np.zeros(len(sizes), dtype=np.int64), sizes)
    start = drop_window(by_index.num_samples, num_dropped, epoch)
    (shard, first, last), window = cut_window(by_index, start, num_dropped)
    place = np.empty(len(sizes), dtype=np.int64)
    place[order] = np.arange(len(sizes))
    kept = np.argsort(place[shard], kind="stable")  # a shard's pieces stay in index order
    return SampleSequence(
        np.concatenate([shard[kept], window[0]]),
        np.concatenate([first[kept], window[1]]),
        np.concatenate([last[kept], window[2]]),
    )


class EpochPlan:
    """One stage's plan: the streams of every (rank, worker), all ranks with equal batches.

    Build it with `plan()`; all methods are cheap (O(log n) per stream) so a worker can compute
    the plan of the whole job and read only its own stream.
    """

    def __init__(
        self,
        sequence: SampleSequence,
        params: StageParams,
        *,
        seed: int = 0,
        epoch: int = 0,
        stage: int = 0,
    ) -> None:
        p = params
        if p.remainder not in REMAINDER_POLICIES:
            raise PlanError(f"data.remainder: {p.remainder!r} is not one of {REMAINDER_POLICIES}")
        if p.world_size < 1 or p.batch_size < 1 or p.workers_per_rank < 0:
            raise PlanError(
                f"plan needs world_size >= 1, batch_size >= 1, workers_per_rank >= 0 (got "
                f"{p.world_size}, {p.batch_size}, {p.workers_per_rank})"
            )
        self.sequence = sequence
        self.params = params
        self.seed, self.epoch, self.stage = seed, epoch, stage
        self.num_samples = sequence.num_samples
        self.world_size = p.world_size
        self.streams_per_rank = max(p.workers_per_rank, 1)
        self.batch_size = p.batch_size
        per_step = p.world_size * p.batch_size
        if p.remainder == "drop":
            self.batches_per_rank = self.num_samples // per_step
        else:
            self.batches_per_rank = -(-self.num_samples // per_step)
        total = self.batches_per_rank * per_step
        self.num_dropped = max(self.num_samples - total, 0)
        self.num_padded = max(total - self.num_samples, 0)
        if self.num_padded and self.num_samples == 0:
            raise PlanError("cannot pad an epoch without samples")

    # -- stream geometry ---------------------------------------------------------------

    def stream_batches(self, worker: Any) -> Any:
        """Batches of stream `worker` on every rank (round-robin: the first ones get more);
        an int, or an array of them."""
        k = self.streams_per_rank
        return self.batches_per_rank // k + (worker < self.batches_per_rank % k)

    def slot_ranges(self, rank: Any, worker: Any) -> tuple[Any, Any]:
        """Slices [a, b) of the padded/cut sequence (slot space) of streams (rank, worker):
        ints, or arrays of them (one stream per element).

        A rank's `batches_per_rank` batches lie after those of the ranks before it; stream
        `worker` holds `stream_batches(worker)` of them, after those of the rank's streams
        before it. The one place of this arithmetic: the other methods ask it.
        """
        k, nb, bsz = self.streams_per_rank, self.batches_per_rank, self.batch_size
        extra = nb % k  # the first `extra` streams of a rank hold one batch more
        # min(worker, extra), written so that it takes ints and arrays alike
        before = worker * (nb // k) + worker - (worker - extra) * (worker > extra)
        a = (rank * nb + before) * bsz
        return a, a + self.stream_batches(worker) * bsz

    def all_streams(self) -> tuple[np.ndarray, np.ndarray]:
        """(rank, worker) of every stream, rank-major."""
        k = self.streams_per_rank
        return np.repeat(np.arange(self.world_size), k), np.tile(np.arange(k), self.world_size)

    def stream_slots(self, rank: int, worker: int) -> tuple[int, int]:
        """The stream's slice [a, b) of the padded/cut sequence (slot space)."""
        a, b = self.slot_ranges(rank, worker)
        return int(a), int(b)

    def stream_segments(self, rank: int, worker: int) -> list[Segment]:
        """What stream (rank, worker) reads, in reading order (before the block shuffle)."""
        a, b = self.stream_slots(rank, worker)
        return self._slot_segments(a, b)

    def _slot_segments(self, a: int, b: int) -> list[Segment]:
        n = self.num_samples
        out = self.sequence.slice(a, min(b, n))
        lo = max(a, n)
        while lo < b:  # padding: wrap around to the sequence's start
            start = (lo - n) % n
            length = min(b - lo, n - start)
            out.extend(self.sequence.slice(start, start + length, valid=False))
            lo += length
        return out

    def consumed_batches(self, worker: int, consumed: int) -> int:
        """Batches of stream `worker` among the first `consumed` rank-level batches."""
        k = self.streams_per_rank
        return consumed // k + (worker < consumed % k)

    def shuffle_order(self, rank: int, worker: int, block: int, length: int) -> np.ndarray:
        """Emission order of one block of a stream (identity without a shuffle buffer)."""
        if self.params.shuffle_buffer <= 1:
            return np.arange(length)
        return _rng(self.seed, self.epoch, self.stage, rank, worker, block, 0xB10C).permutation(
            length
        )

    @property
    def block_size(self) -> int:
        return self.params.shuffle_buffer if self.params.shuffle_buffer > 1 else 1 << 62

    def emission_order(self, rank: int, worker: int) -> list[tuple[int, int, bool]]:
        """(shard, sample, valid) of every sample of a stream, in the order it is emitted.

        What the loader's worker produces; O(stream length), meant for tests and audits.
        """
        items = [
            (seg.shard, i, seg.valid)
            for seg in self.stream_segments(rank, worker)
            for i in range(seg.start, seg.end)
        ]
        if self.params.shuffle_buffer <= 1:
            return items
        buf = self.block_size
        out: list[tuple[int, int, bool]] = []
        for block, lo in enumerate(range(0, len(items), buf)):
            chunk = items[lo : lo + buf]
            out.extend(chunk[j] for j in self.shuffle_order(rank, worker, block, len(chunk)))
        return out

    def rank_order(self, rank: int) -> list[tuple[int, int, bool]]:
        """All samples of a rank in batch order (round-robin over its streams)."""
        k, bsz = self.streams_per_rank, self.batch_size
        streams = [self.emission_order(rank, w) for w in range(k)]
        out = []
        for j in range(self.batches_per_rank):
            w, b = j % k, j // k
            out.extend(streams[w][b * bsz : (b + 1) * bsz])
        return out

    # -- resume --------------------------------------------------------------------------

    def remaining_slots(self, consumed: int) -> Iterator[tuple[np.ndarray, int, int]]:
        """What each stream (rank-major) has not emitted after `consumed` batches per rank:
        the slots left of its partly read shuffle block (sorted; empty when it stopped at a
        block boundary), then the untouched slot range [lo, hi). Slots may lie past
        `num_samples` (padding): the caller keeps the ones it carries over."""
        bsz, buf = self.batch_size, self.block_size
        for rank in range(self.world_size):
            for worker in range(self.streams_per_rank):
                a, b = self.stream_slots(rank, worker)
                m = self.consumed_batches(worker, consumed) * bsz
                length = b - a
                if m >= length:
                    continue
                block = m // buf
                block_lo = block * buf
                if m > block_lo:
                    block_len = min(buf, length - block_lo)
                    order = self.shuffle_order(rank, worker, block, block_len)
                    yield np.sort(order[m - block_lo :]) + a + block_lo, a + block_lo + block_len, b
                else:
                    yield np.zeros(0, dtype=np.int64), a + m, b

    def remaining_sequence(self, consumed: int) -> SampleSequence:
        """Valid samples not yet emitted after `consumed` batches per rank, as a new sequence.

        Order: stream by stream (rank-major), each stream's partial block first (in position
        order), then the rest of the stream. Pads and dropped samples are not carried over.
        """
        n = self.num_samples
        shards: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        ends: list[np.ndarray] = []

        def add_range(lo: int, hi: int) -> None:
            hi = min(hi, n)
            for seg in self.sequence.slice(lo, hi) if hi > lo else []:
                shards.append(np.array([seg.shard]))
                starts.append(np.array([seg.start]))
                ends.append(np.array([seg.end]))

        for left, lo, hi in self.remaining_slots(consumed):
            left = left[left < n]
            if len(left):
                sh, ix = self.sequence.positions(left)
                shards.append(sh)
                starts.append(ix)
                ends.append(ix + 1)
            add_range(lo, hi)
        if not shards:
            empty = np.zeros(0, dtype=np.int64)
            return SampleSequence(empty, empty, empty)
        sh, st, en = np.concatenate(shards), np.concatenate(starts), np.concatenate(ends)
        # Coalesce neighbours (same shard, contiguous) so streams open each shard once.
        if len(sh) > 1:
            join = (sh[1:] == sh[:-1]) & (st[1:] == en[:-1])
            head = np.concatenate([[True], ~join])
            last_of_group = np.concatenate([head[1:], [True]])
            sh, st, en = sh[head], st[head], en[last_of_group]
        return SampleSequence(sh, st, en)

    # -- reporting -----------------------------------------------------------------------

    def stream_table(self) -> dict[str, np.ndarray]:
        """Per-stream figures for all (rank, worker), vectorised (W=4096, K=8 in milliseconds).

        Keys: rank, worker, batches, samples, shards (shards the stream opens, padding
        excluded), partial (shards of which it reads only a part).
        """
        rank, worker = self.all_streams()
        a, b = self.slot_ranges(rank, worker)
        batches = self.stream_batches(worker)
        n = self.num_samples
        va, vb = np.minimum(a, n), np.minimum(b, n)
        offsets = self.sequence.offsets
        first = np.searchsorted(offsets, va, side="right") - 1
        last = np.searchsorted(offsets, vb, side="left")
        shards = np.where(vb > va, last - first, 0)
        cut_start = (vb > va) & (offsets[np.clip(first, 0, len(offsets) - 1)] != va)
        cut_end = (vb > va) & (offsets[np.clip(last, 0, len(offsets) - 1)] != vb)
        partial = cut_start.astype(np.int64) + cut_end.astype(np.int64)
        partial = np.minimum(partial, shards)
        return {
            "rank": rank,
            "worker": worker,
            "batches": batches,
            "samples": b - a,
            "shards": shards,
            "partial": partial,
        }

    def all_segments(self) -> list[list[Segment]]:
        """`stream_segments` of every stream (rank-major), vectorised for big plans."""
        a, b = self.slot_ranges(*self.all_streams())
        n = self.num_samples
        seq = self.sequence
        # cut the valid part of the sequence at every segment and stream boundary
        cuts = np.unique(np.concatenate([seq.offsets, np.minimum(a, n), np.minimum(b, n)]))
        lo, hi = cuts[:-1], cuts[1:]
        seg = np.searchsorted(seq.offsets, lo, side="right") - 1
        stream = np.searchsorted(a, lo, side="right") - 1
        inside = (lo < np.minimum(b[stream], n)) & (lo >= a[stream])
        lo, hi, seg, stream = lo[inside], hi[inside], seg[inside], stream[inside]
        shard = seq.shard[seg]
        start = seq.start[seg] + (lo - seq.offsets[seg])
        end = start + (hi - lo)
        out: list[list[Segment]] = [[] for _ in range(len(a))]
        for s, sh, st, en in zip(
            stream.tolist(), shard.tolist(), start.tolist(), end.tolist(), strict=True
        ):
            out[s].append(Segment(sh, st, en))
        for s in np.nonzero(b > n)[0].tolist():  # padded streams: the slow path, few of them
            out[s] = self._slot_segments(int(a[s]), int(b[s]))
        return out

    @cached_property
    def summary(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "workers_per_rank": self.params.workers_per_rank,
            "batch_size": self.batch_size,
            "remainder": self.params.remainder,
            "batches_per_rank": self.batches_per_rank,
            "samples_per_rank": self.batches_per_rank * self.batch_size,
            "num_dropped": self.num_dropped,
            "num_padded": self.num_padded,
        }


def plan(
    shard_sizes: Sequence[int],
    *,
    world_size: int,
    workers_per_rank: int,
    batch_size: int,
    seed: int = 0,
    epoch: int = 0,
    remainder: str = "drop",
    shuffle_buffer: int = 0,
    shuffle_shards: bool = True,
    stages: Sequence[StageParams] = (),
    rotate_dropped: bool = True,
) -> EpochPlan:
    """The plan of one epoch (pure function; identical on every rank).

    Args:
        shard_sizes: samples per shard, in index order.
        world_size: ranks.
        workers_per_rank: loader workers per rank (0: one stream read in the rank's process).
        batch_size: samples per batch.
        seed: run seed; with `epoch` it fixes the shard permutation and the sample shuffle.
        epoch: epoch number.
        remainder: "drop" (leave out the tail that does not fill equal batches) or "pad"
            (repeat samples from the start, flagged invalid).
        shuffle_buffer: block size of the in-stream sample shuffle (0 or 1: none).
        shuffle_shards: permute shards per epoch (training) or keep index order (evaluation).
        stages: earlier stages of this epoch, when resuming with another world size or worker
            count; each one's `consumed` batches are taken out before planning the rest.
        rotate_dropped: with `shuffle_shards`, rotate which samples `drop` leaves out with
            the epoch (see the module doc); False: the tail of the permuted shards, as
            loader states saved before the rotation planned their epoch.

    Returns:
        The `EpochPlan` of the last stage (`stage == len(stages)`).
    """
    params = StageParams(
        world_size=world_size,
        workers_per_rank=workers_per_rank,
        batch_size=batch_size,
        remainder=remainder,
        shuffle_buffer=shuffle_buffer,
    )
    first = stages[0] if stages else params  # the stage that drops (re-plans pad)
    dropped = num_left_out(sum(shard_sizes), first) if shuffle_shards and rotate_dropped else 0
    sequence = epoch_sequence(shard_sizes, seed, epoch, shuffle_shards, dropped)
    for i, st in enumerate(stages):
        earlier = EpochPlan(sequence, st, seed=seed, epoch=epoch, stage=i)
        sequence = earlier.remaining_sequence(st.consumed)
    return EpochPlan(sequence, params, seed=seed, epoch=epoch, stage=len(stages))
