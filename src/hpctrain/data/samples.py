"""Each worker's samples: its stream of the epoch plan read, decoded, transformed and batched.

A worker gets a `ReadSpec` (a small frozen description of what to read: shard URLs and
sizes, rank, seed, the stage parameters, how to treat errors) and the user's callables
(`transform`, and a Task's optional `decode` and `collate`) inside a `SampleReader`; the
position of the pass (epoch, earlier stages, batches already consumed) comes from a small
shared-memory tensor it reads each time a pass starts, so that persistent workers follow the
training process's `set_epoch` and resumes.

Per-sample errors (`SampleError`: an undecodable field, a decompression bomb, a label a
transform refuses) are handled under `data.on_error`: `fail` raises naming the key and the
shard; `skip` counts the sample (`samples_skipped`), logs it, and a good sample of the batch
takes its place with `valid=False`. Any other exception from a transform or a Task's decode
is a bug and propagates.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from hpctrain.data.collate import Batch, BatchMemory, Collator, Sample, pack_batch
from hpctrain.data.decode import SampleError, decode_sample
from hpctrain.data.fieldnames import SOURCE_FIELD
from hpctrain.data.index import Counts, redact_url
from hpctrain.data.mixture import Mixture, MixturePlan, interleave, plan_mixture, source_counts
from hpctrain.data.planning import EpochPlan, Segment, StageParams, derive_seed, plan
from hpctrain.data.sequences import iter_sequences, sequence_offset, shard_stem
from hpctrain.data.stream import (
    CorruptShardError,
    ReadStats,
    ShardReadError,
    ShardStream,
    open_shard,
)
from hpctrain.data.tar import iter_samples
from hpctrain.data.transport import report_activity, seed_worker_globals

log = logging.getLogger("hpctrain.data")

Transform = Callable[[Sample], Sample]
Decode = Callable[[str, dict[str, Any]], Sample]
Collate = Callable[[list[Sample]], Batch]
STAT_FIELDS = (
    "retries",
    "shards_failed",
    "samples_lost",
    "samples_skipped",
    "bytes_read",
    "bytes_skipped",
)
# control tensor layout: epoch, number of earlier stages, consumed batches of the current
# stage, then 6 ints per earlier stage (see `encode_stage`)
MAX_STAGES = 64
STAGE_INTS = 6
CONTROL_INTS = 3 + MAX_STAGES * STAGE_INTS


def stage_params(base: StageParams, stages: tuple[StageParams, ...]) -> StageParams:
    """The parameters of the stage after `stages`: an elastic re-plan pads, never drops.

    Dropping again would lose samples the epoch still owes; padded repeats are flagged
    `valid=False` instead (the trainer masks them).
    """
    return replace(base, remainder="pad") if stages else base


def encode_stage(s: StageParams) -> list[int]:
    return [
        s.world_size,
        s.workers_per_rank,
        s.batch_size,
        1 if s.remainder == "pad" else 0,
        s.shuffle_buffer,
        s.consumed,
    ]


def decode_stage(v: list[int]) -> StageParams:
    return StageParams(
        world_size=v[0],
        workers_per_rank=v[1],
        batch_size=v[2],
        remainder="pad" if v[3] else "drop",
        shuffle_buffer=v[4],
        consumed=v[5],
    )


@dataclass(frozen=True, kw_only=True)
class ReadSpec:
    """What a rank's workers read and how: everything a worker needs from the loader."""

    # per shard, in index order: tuples, or (from the compact index) the mapped columns and
    # URLs made on demand (`ShardIndex.shard_urls`): a rank touches only those it reads
    urls: Sequence[str]
    shard_sizes: Counts  # samples per shard
    byte_sizes: Counts  # bytes per shard (0: unknown)
    rank: int
    seed: int
    train: bool  # shards permuted per epoch (else index order)
    params: StageParams  # the first stage's layout (world size, workers, batch size...)
    on_error: str = "fail"  # per-sample and per-shard errors: "fail" or "skip"
    max_retries: int = 5
    allow_pipe: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    backoff_s: float = 0.05
    max_image_pixels: int = 0  # 0: no limit
    in_process: bool = False  # no workers: batches are made in the training process
    mixture: Mixture | None = None  # several sources mixed by weight (`hpctrain.data.mixture`)
    seq_len: int = 0  # > 0: shards are token streams read as sequences (data.sequences)
    vocab_size: int = 0  # with seq_len: ids must lie below it
    eod_id: int | None = None  # with seq_len: the end-of-document id (for positions)
    shard_tokens: tuple[int, ...] = ()  # with seq_len: ids per shard (`sequence_offset`)
    # epochs from this one on rotate which samples `drop` leaves out (`planning.plan`); a
    # loader state saved before the rotation existed finishes its epoch as it was planned
    drop_rotation_from: int = 0
    keep_source: bool = False  # batches carry their samples' `__source__` paths (predict)

    def plan(self, epoch: int, stages: tuple[StageParams, ...]) -> EpochPlan:
        """The plan of the stage after `stages` of `epoch`."""
        p = stage_params(self.params, stages)
        layout: dict[str, Any] = {
            "rotate_dropped": epoch >= self.drop_rotation_from,
            "world_size": p.world_size,
            "workers_per_rank": p.workers_per_rank,
            "batch_size": p.batch_size,
            "seed": self.seed,
            "epoch": epoch,
            "remainder": p.remainder,
            "shuffle_buffer": p.shuffle_buffer,
            "stages": stages,
        }
        if self.mixture is not None:
            return plan_mixture(self.mixture, **layout)
        # the plan reads the counts with np.asarray: a mapped column is not copied
        return plan(cast(Sequence[int], self.shard_sizes), shuffle_shards=self.train, **layout)


class SampleReader:
    """What a worker runs: its stream of the plan, read, decoded, transformed and batched.

    Args:
        spec: what to read.
        control: the shared position tensor (`CONTROL_INTS` int64s, see `encode_stage`).
        transform: `transform(sample) -> sample`, with torch's RNG seeded per sample.
        decode: a Task's `decode(key, members) -> sample` (default: `decode_sample`).
        collate: a Task's `collate(samples) -> batch` (default: `Collator`).
    """

    def __init__(
        self,
        spec: ReadSpec,
        control: torch.Tensor,
        *,
        transform: Transform | None = None,
        decode: Decode | None = None,
        collate: Collate | None = None,
    ) -> None:
        self.spec = spec
        self.control = control
        self.transform = transform
        self.decode = decode
        self.collate = collate
        self.seed = spec.seed  # what get_worker_info() reports in the workers
        self._plan_cache: tuple[tuple[int, tuple[StageParams, ...]], EpochPlan] | None = None
        self._opener: ThreadPoolExecutor | None = None
        self._stats = ReadStats()  # the current pass's counters
        self.worker_id = 0
        self.epoch = 0  # the pass being read (`batches`)
        self._owner: Any = None  # a mixture's source of every shard, made on first use

    def __getstate__(self) -> dict[str, Any]:
        # threads do not cross process boundaries (forkserver pickles the reader)
        return {**self.__dict__, "_opener": None}

    def plan(self, epoch: int, stages: tuple[StageParams, ...]) -> EpochPlan:
        """The plan of the stage after `stages` (the last one computed is kept)."""
        key = (epoch, stages)
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, self.spec.plan(epoch, stages))
        return self._plan_cache[1]

    def batches(self, worker_id: int, memory: BatchMemory) -> Iterator[Any]:
        """Worker `worker_id`'s batches of the pass the control tensor describes, written
        into `memory` (see `hpctrain.data.transport`)."""
        self.worker_id = worker_id
        control = self.control.tolist()
        epoch, num_stages, start = control[0], control[1], control[2]
        self.epoch = epoch  # where packed sequences are cut (`_iter_items`)
        stages = tuple(
            decode_stage(control[3 + i * STAGE_INTS : 3 + (i + 1) * STAGE_INTS])
            for i in range(num_stages)
        )
        the_plan = self.plan(epoch, stages)
        k = the_plan.streams_per_rank
        # The pool restarts its round-robin at worker 0; rotating which stream each worker
        # reads makes the batch after `start` come first, as in an unbroken run.
        stream = (worker_id + start) % k
        done = the_plan.consumed_batches(stream, start)
        num_batches = the_plan.stream_batches(stream) - done
        if num_batches <= 0:
            return
        if not self.spec.in_process:
            seed_worker_globals(derive_seed(self.spec.seed, epoch, self.spec.rank, stream, start))
        stats = self._stats = ReadStats()
        sent = dict.fromkeys(STAT_FIELDS, 0)

        def counters() -> list[int]:
            """What the batch carries: the counters' changes since the last batch."""
            nonlocal sent
            now = stats.as_dict()
            delta = [now[f] - sent[f] for f in STAT_FIELDS]
            sent = now
            return delta

        samples = self._iter_stream(the_plan, stream, done * the_plan.batch_size, stats)
        last_good: tuple[str, Sample] | None = None
        for _ in range(num_batches):
            raw = [next(samples) for _ in range(the_plan.batch_size)]
            if self.spec.in_process:
                # keep the training process's own RNG stream untouched by augmentations
                with torch.random.fork_rng(devices=[]):
                    batch, last_good = self._make_batch(raw, epoch, last_good, memory, counters)
            else:
                batch, last_good = self._make_batch(raw, epoch, last_good, memory, counters)
            yield batch

    # -- reading -------------------------------------------------------------------------

    def _iter_stream(
        self, the_plan: EpochPlan, stream: int, skip: int, stats: ReadStats
    ) -> Iterator[tuple[Segment, int, str | None, dict[str, Any] | None]]:
        """The stream's samples in emission order (after the block shuffle), from `skip` on."""
        segments = the_plan.stream_segments(self.spec.rank, stream)
        length = sum(len(s) for s in segments)
        block = the_plan.block_size
        if block >= length:
            block = max(length, 1)
        if the_plan.params.shuffle_buffer <= 1:
            yield from self._read_items(the_plan, stream, segments, skip, length, stats)
            return
        first_block = skip // block
        # one reader for the whole rest of the stream: a shard that spans two blocks stays
        # open between them instead of being reopened and re-skipped
        items = self._read_items(the_plan, stream, segments, first_block * block, length, stats)
        for b in range(first_block, math.ceil(length / block)):
            lo, hi = b * block, min(length, (b + 1) * block)
            chunk = list(itertools.islice(items, hi - lo))
            order = the_plan.shuffle_order(self.spec.rank, stream, b, hi - lo)
            start = skip - lo if b == first_block else 0
            for j in order[start:]:
                yield chunk[j]

    def _read_items(
        self,
        the_plan: EpochPlan,
        stream: int,
        segments: list[Segment],
        lo: int,
        hi: int,
        stats: ReadStats,
    ) -> Iterator[Any]:
        """Stream items [lo, hi) in reading order; a mixture's sources interleaved."""
        if not isinstance(the_plan, MixturePlan):
            return self._read_range(segments, lo, hi, stats)
        return interleave(
            the_plan,
            self.spec.rank,
            stream,
            lo,
            lambda segs: self._read_range(segs, 0, sum(len(s) for s in segs), stats),
        )

    def _source_counts(self, raw: list[Any], valid: list[bool]) -> list[int]:
        """A mixture's per-source counters of a batch: valid samples, then samples planned
        but lost or skipped (after the `STAT_FIELDS` in `_stats`)."""
        mixture = self.spec.mixture
        if mixture is None:
            return []
        if self._owner is None:
            self._owner = mixture.source_of_shard()
        shards = [seg.shard for seg, _, _, _ in raw]
        missing = [seg.valid and not ok for (seg, _, _, _), ok in zip(raw, valid, strict=True)]
        n = len(mixture.sources)
        return source_counts(self._owner, n, shards, valid) + source_counts(
            self._owner, n, shards, missing
        )

    def _read_range(
        self, segments: list[Segment], lo: int, hi: int, stats: ReadStats
    ) -> Iterator[Any]:
        """Stream items [lo, hi) in reading order; earlier items are skipped, never decoded."""
        wanted: list[Segment] = []
        pos = 0
        for seg in segments:
            a, b = max(lo, pos), min(hi, pos + len(seg))
            if a < b:
                wanted.append(
                    Segment(seg.shard, seg.start + a - pos, seg.start + b - pos, seg.valid)
                )
            pos += len(seg)
        # one pass over a shard for consecutive increasing segments (scattered samples after
        # an elastic re-plan), so a shard is opened once, not once per sample
        groups: list[list[Segment]] = []
        for seg in wanted:
            g = groups[-1] if groups else None
            if g and g[-1].shard == seg.shard and seg.start >= g[-1].end:
                g.append(seg)
            else:
                groups.append([seg])
        # Remote shards: open the next one (request sent, headers awaited) in a thread while
        # this one is read, which hides a request's latency behind the decoding.
        ahead: Future[ShardStream] | None = None
        try:
            for i, group in enumerate(groups):
                opened, ahead = ahead, None
                if i + 1 < len(groups) and is_remote(self.spec.urls[groups[i + 1][0].shard]):
                    ahead = self._open_ahead().submit(self._open, groups[i + 1][0].shard, stats)
                yield from self._read_group(group, stats, opened)
        finally:
            if ahead is not None:
                ahead.add_done_callback(_close_opened)

    def _open_ahead(self) -> ThreadPoolExecutor:
        if self._opener is None:  # made in the worker, after the fork
            self._opener = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-open")
        return self._opener

    def _open(self, shard: int, stats: ReadStats, max_retries: int | None = None) -> ShardStream:
        spec = self.spec
        return open_shard(
            spec.urls[shard],
            size=int(spec.byte_sizes[shard]),
            max_retries=spec.max_retries if max_retries is None else max_retries,
            stats=stats,
            storage_options=dict(spec.storage_options),
            backoff_s=spec.backoff_s,
            allow_pipe=spec.allow_pipe,
        )

    def _read_group(
        self, group: list[Segment], stats: ReadStats, opened: Future[ShardStream] | None = None
    ) -> Iterator[Any]:
        shard = group[0].shard
        url = self.spec.urls[shard]
        valid_of: dict[int, Segment] = {}
        for seg in group:
            for i in range(seg.start, seg.end):
                valid_of[i] = seg
        expected = sorted(valid_of)
        got = 0
        report_activity(f"reading {redact_url(url)}")
        try:
            with opened.result() if opened is not None else self._open(shard, stats) as f:
                for index, key, members in self._iter_items(f, shard, expected):
                    if index != expected[got]:  # cannot happen: `want` filters
                        raise AssertionError((index, expected[got]))
                    got += 1
                    yield valid_of[index], index, key, members
            if got < len(expected):
                raise CorruptShardError(
                    f"has {expected[got]} samples, the index says at least {expected[-1] + 1}"
                )
        except (ShardReadError, CorruptShardError) as exc:
            error = exc if isinstance(exc, ShardReadError) else ShardReadError(url, str(exc))
            if self.spec.on_error == "fail":
                raise error from exc
            lost = len(expected) - got
            stats.shards_failed += 1
            stats.samples_lost += lost
            log.warning("skipping the rest of a shard (%d samples lost): %s", lost, error)
            for index in expected[got:]:
                yield valid_of[index], index, None, None

    def _iter_items(
        self, f: ShardStream, shard: int, wanted: list[int]
    ) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """(index, key, members) of the `wanted` (sorted) samples of an open shard, or of
        its sequences with `data.seq_len` (members then `{"tokens": int64 ids, "positions":
        int64 positions in documents}`, and `"loss_mask"` when the shard has masks)."""
        if not self.spec.seq_len:
            want = set(wanted).__contains__
            yield from iter_samples(f, want=want, stop=wanted[-1] + 1, views=True)
            return
        stem = shard_stem(self.spec.urls[shard])
        spec = self.spec
        offset = (
            sequence_offset(spec.shard_tokens[shard], spec.seq_len, self.epoch)
            if spec.train
            else 0  # evaluation always reads the same windows
        )
        for index, key, ids, positions, mask in iter_sequences(
            f, wanted, spec.seq_len, spec.vocab_size, stem, spec.eod_id, offset
        ):
            members = {"tokens": ids, "positions": positions}
            if mask is not None:
                members["loss_mask"] = mask
            yield index, key, members

    # -- samples and batches -------------------------------------------------------------

    def make_sample(
        self, key: str, members: dict[str, Any], epoch: int, shard: int, index: int
    ) -> Sample:
        """Decode and transform one sample (`SampleError` for bad data, see the module)."""
        members.pop(SOURCE_FIELD, None)  # provenance: never decoded, never a Task's to see
        if self.spec.seq_len:  # a packed sequence: nothing to decode, a Task's decode unused
            sample: Sample = {
                "key": key,
                "tokens": torch.from_numpy(members["tokens"]),
                "positions": torch.from_numpy(members["positions"]),
            }
            if "loss_mask" in members:
                sample["loss_mask"] = torch.from_numpy(members["loss_mask"])
        elif self.decode is not None:
            sample = self.decode(key, members)
            sample.setdefault("key", key)
        else:
            sample = decode_sample(key, members, max_pixels=self.spec.max_image_pixels)
        if self.transform is not None:
            # per-sample seed: augmentations repeat across runs, resumes and world sizes,
            # and differ across samples, workers and ranks (pytorch#5059)
            torch.default_generator.manual_seed(derive_seed(self.spec.seed, epoch, shard, index))
            sample = self.transform(sample)
        return sample

    def _bad_sample(self, exc: SampleError, shard: int, key: str) -> None:
        """Fail naming the key and shard, or count and log the sample (`data.on_error`)."""
        where = redact_url(self.spec.urls[shard])
        text = str(exc)
        reason = text if text.startswith(f"sample {key!r}") else f"sample {key!r}: {text}"
        error = SampleError(f"{where}: {reason}")
        if self.spec.on_error == "fail":
            raise error from exc
        self._stats.samples_skipped += 1
        log.warning("skipping a sample: %s", error)

    def _filler(self, epoch: int, avoid: int) -> tuple[str, Sample]:
        """A stand-in for lost samples when a worker has read nothing yet: the first usable
        sample of another shard (flagged invalid like any filler), so the rank is not short."""
        urls = self.spec.urls
        for shard in [*range(avoid + 1, len(urls)), *range(avoid)]:
            if not self.spec.shard_sizes[shard]:
                continue  # nothing to take (with data.seq_len: shorter than one sequence)
            report_activity(f"reading a filler sample from {redact_url(urls[shard])}")
            try:
                with self._open(shard, ReadStats(), max_retries=0) as f:
                    for index, key, members in self._iter_items(f, shard, [0]):
                        return key, self.make_sample(key, members, epoch, shard, index)
            except (ShardReadError, CorruptShardError, SampleError) as exc:
                log.warning("no filler sample from %s: %s", redact_url(urls[shard]), exc)
        raise ShardReadError(urls[avoid], "no readable shard left to fill batches with")

    def _make_batch(
        self,
        raw: list[Any],
        epoch: int,
        last_good: tuple[str, Sample] | None,
        memory: BatchMemory,
        counters: Callable[[], list[int]],
    ) -> tuple[Any, tuple[str, Sample] | None]:
        """Decode, transform and batch `raw`; lost or unusable samples are replaced by a
        good one (every field), flagged invalid. The batch carries `counters()` as
        `_stats`, which the loader takes out."""
        size = len(raw)
        keys: list[str] = [""] * size
        # `__source__` of each sample ("" for none, lost samples and their stand-ins)
        sources: list[str] | None = [""] * size if self.spec.keep_source else None
        valid: list[bool] = [False] * size
        missing: list[int] = []
        good: tuple[str, Sample] | None = None
        collator: Collator | None = None
        kept: list[Sample | None] = [None] * size  # for a Task's own collate
        for pos, (seg, index, key, members) in enumerate(raw):
            if members is None:
                missing.append(pos)
                continue
            if sources is not None and SOURCE_FIELD in members:
                sources[pos] = bytes(members[SOURCE_FIELD]).decode("utf-8", "replace")
            try:
                sample = self.make_sample(key, members, epoch, seg.shard, index)
            except SampleError as exc:
                self._bad_sample(exc, seg.shard, key)
                missing.append(pos)
                continue
            keys[pos], valid[pos] = key, seg.valid
            if self.collate is not None:
                kept[pos] = sample
            else:
                if collator is None:
                    collator = Collator(sample, key, size, memory)
                collator.put(pos, sample, key)
            if good is None:
                good = (key, sample)
        if good is None:
            good = last_good if last_good is not None else self._filler(epoch, raw[0][0].shard)
        good_key, good_sample = good
        if self.collate is not None:
            for pos in missing:
                kept[pos], keys[pos] = good_sample, good_key
            batch = self.collate(kept)  # type: ignore[arg-type]
            stats = counters() + self._source_counts(raw, valid)
            extra = (
                {"_stats": stats} if sources is None else {"_stats": stats, SOURCE_FIELD: sources}
            )
            return pack_batch(batch, keys, valid, memory, extra), good
        if collator is None:
            collator = Collator(good_sample, good_key, size, memory)
        for pos in missing:
            collator.put(pos, good_sample, good_key)
            keys[pos] = good_key
        stats = counters() + self._source_counts(raw, valid)
        extra = {"_stats": stats} if sources is None else {"_stats": stats, SOURCE_FIELD: sources}
        return collator.finish(keys, valid, extra), good


def is_remote(url: str) -> bool:
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file://"))


def _close_opened(future: Future[ShardStream]) -> None:
    if future.exception() is None:
        future.result().close()
