"""`ShardedLoader`: the per-rank loader over an epoch plan, with exact and elastic resume.

Each worker process (`hpctrain.data.workers`) reads one stream of the plan (see
`hpctrain.data.planning`), decodes, transforms and batches its samples itself, and hands uint8
batches to the training process (normalisation belongs on the device: 4x fewer bytes between
processes than float32).

Where the epoch and resume position live: in a small shared-memory tensor the workers read
each time an iteration starts. Persistent workers keep their copy of the dataset across
epochs, so `set_epoch` on the main process's copy alone would never reach them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple

import fsspec
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data.index import ShardIndex, ShardIndexError, redact_url
from hpctrain.data.planning import EpochPlan, Segment, StageParams, derive_seed, plan
from hpctrain.data.stream import (
    PIPE_RULE,
    CorruptShardError,
    ReadStats,
    ShardReadError,
    ShardStream,
    iter_samples,
    open_shard,
)
from hpctrain.data.workers import (
    WorkerPool,
    report_activity,
    run_ahead,
    seed_worker_globals,
    worker_start_method,
)
from hpctrain.errors import DataError

try:
    # imported here, not in the workers: forked workers then share it instead of each paying
    # the import (1-3 s here, 10 s before a 2x2-worker job's first batch when it was lazy)
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as tv_decode
except ImportError:  # a torchvision without image decoders: PIL decodes
    tv_decode = None

log = logging.getLogger("hpctrain.data")

Transform = Callable[[dict[str, Any]], dict[str, Any]]
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "gif")
# control tensor layout: epoch, number of earlier stages, consumed batches of the current
# stage, then 6 ints per earlier stage (see `_encode_stage`)
MAX_STAGES = 64
_STAGE_INTS = 6
_STAT_FIELDS = ("retries", "shards_failed", "samples_lost", "bytes_read", "bytes_skipped")
STATE_VERSION = 1


class LoaderStateError(DataError, ValueError):
    """A loader state that does not belong to this data (other shards or another seed)."""


def decode_image(data: bytes | memoryview) -> torch.Tensor:
    """Encoded image bytes (or a view of them) -> uint8 RGB tensor [3, H, W].

    torchvision.io.decode_image rather than PIL: 1,600 vs 1,280 JPEG/s (400x300, one core,
    libjpeg-turbo in both) on this project's machine, and it gives the CHW tensor that
    `transforms.v2` wants without a copy. torchvision 0.29 warns on every call that these
    decoders move to torchcodec (not installed here); PIL takes over once they are gone.
    The encoded bytes are read in place: torch warns that the tensor over a read-only buffer
    must not be written to, and the decoder only reads it.
    """
    if tv_decode is None:
        return _decode_with_pil(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return tv_decode(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)


def _decode_with_pil(data: bytes | memoryview) -> torch.Tensor:
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        array = np.array(im.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def decode_sample(key: str, members: dict[str, bytes]) -> dict[str, Any]:
    """Raw tar members -> {"image": uint8 CHW RGB tensor, "label": int, "key", "meta"}."""
    image = None
    for ext in IMAGE_EXTENSIONS:
        data = members.get(ext)
        if data is not None:
            image = decode_image(data)
            break
    if image is None:
        raise CorruptShardError(f"sample {key!r} has no image member (got {sorted(members)})")
    label = -1
    if "cls" in members:
        label = int(bytes(members["cls"]).strip() or -1)
    meta = json.loads(bytes(members["json"])) if "json" in members else {}
    return {"image": image, "label": label, "key": key, "meta": meta}


def stage_params(base: StageParams, stages: tuple[StageParams, ...]) -> StageParams:
    """The parameters of the stage after `stages`: an elastic re-plan pads, never drops.

    Dropping again would lose samples the epoch still owes; padded repeats are flagged
    `valid=False` instead (the trainer masks them).
    """
    return replace(base, remainder="pad") if stages else base


def _encode_stage(s: StageParams) -> list[int]:
    return [
        s.world_size,
        s.workers_per_rank,
        s.batch_size,
        1 if s.remainder == "pad" else 0,
        s.shuffle_buffer,
        s.consumed,
    ]


def _decode_stage(v: list[int]) -> StageParams:
    return StageParams(
        world_size=v[0],
        workers_per_rank=v[1],
        batch_size=v[2],
        remainder="pad" if v[3] else "drop",
        shuffle_buffer=v[4],
        consumed=v[5],
    )


class _StreamDataset:
    """What a worker runs: its stream of the plan, read, decoded, transformed and batched."""

    def __init__(self, loader: ShardedLoader) -> None:
        self.urls = loader.urls
        self.shard_sizes = loader.shard_sizes
        self.byte_sizes = loader.byte_sizes
        self.rank = loader.rank
        self.seed = loader.seed
        self.train = loader.train
        self.params = loader.params
        self.transform = loader.transform
        self.on_error = loader.cfg.on_error
        self.max_retries = loader.cfg.max_retries
        self.allow_pipe = loader.cfg.allow_pipe
        self.storage_options = loader.storage_options
        self.in_process = loader.cfg.workers_per_rank == 0
        self.control = loader.control
        self.backoff_s = loader.backoff_s
        self._plan_cache: tuple[Any, EpochPlan] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = BatchBuffers(keep=loader.cfg.prefetch_factor + 2)
        self.worker_id = 0

    def __getstate__(self) -> dict[str, Any]:
        # threads do not cross process boundaries; each worker keeps buffers of its own
        return {**self.__dict__, "_pool": None, "_buffers": BatchBuffers(self._buffers.keep)}

    def _plan(self, epoch: int, stages: tuple[StageParams, ...]) -> EpochPlan:
        key = (epoch, stages)
        if self._plan_cache is None or self._plan_cache[0] != key:
            p = stage_params(self.params, stages)
            self._plan_cache = (
                key,
                plan(
                    self.shard_sizes,
                    world_size=p.world_size,
                    workers_per_rank=p.workers_per_rank,
                    batch_size=p.batch_size,
                    seed=self.seed,
                    epoch=epoch,
                    remainder=p.remainder,
                    shuffle_buffer=p.shuffle_buffer,
                    shuffle_shards=self.train,
                    stages=stages,
                ),
            )
        return self._plan_cache[1]

    def batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        """What worker `worker_id` of the pool runs: its stream's batches of the pass."""
        self.worker_id = worker_id
        return iter(self)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        control = self.control.tolist()
        epoch, num_stages, start = control[0], control[1], control[2]
        stages = tuple(
            _decode_stage(control[3 + i * _STAGE_INTS : 3 + (i + 1) * _STAGE_INTS])
            for i in range(num_stages)
        )
        the_plan = self._plan(epoch, stages)
        k = the_plan.streams_per_rank
        # The pool restarts its round-robin at worker 0; rotating which stream each worker
        # reads makes the batch after `start` come first, as in an unbroken run.
        stream = (self.worker_id + start) % k
        done = the_plan.consumed_batches(stream, start)
        num_batches = the_plan.stream_batches(stream) - done
        if num_batches <= 0:
            return
        if not self.in_process:
            seed_worker_globals(derive_seed(self.seed, epoch, self.rank, stream, start))
        stats = ReadStats()
        samples = self._iter_stream(the_plan, stream, done * the_plan.batch_size, stats)
        last_good: dict[str, Any] | None = None
        sent = dict.fromkeys(_STAT_FIELDS, 0)
        for _ in range(num_batches):
            raw = [next(samples) for _ in range(the_plan.batch_size)]
            if self.in_process:
                # keep the training process's own RNG stream untouched by augmentations
                with torch.random.fork_rng(devices=[]):
                    batch, last_good = self._make_batch(raw, epoch, last_good)
            else:
                batch, last_good = self._make_batch(raw, epoch, last_good)
            now = stats.as_dict()
            batch["_stats"] = [now[f] - sent[f] for f in _STAT_FIELDS]
            sent = now
            yield batch

    # -- reading -------------------------------------------------------------------------

    def _iter_stream(
        self, the_plan: EpochPlan, stream: int, skip: int, stats: ReadStats
    ) -> Iterator[tuple[Segment, int, str, dict[str, bytes]] | tuple[Segment, int, None, None]]:
        """The stream's samples in emission order (after the block shuffle), from `skip` on."""
        segments = the_plan.stream_segments(self.rank, stream)
        length = sum(len(s) for s in segments)
        block = the_plan.block_size
        if block >= length:
            block = max(length, 1)
        if the_plan.params.shuffle_buffer <= 1:
            yield from self._read_range(segments, skip, length, stats)
            return
        first_block = skip // block
        # one reader for the whole rest of the stream: a shard that spans two blocks stays
        # open between them instead of being reopened and re-skipped
        items = self._read_range(segments, first_block * block, length, stats)
        for b in range(first_block, math.ceil(length / block)):
            lo, hi = b * block, min(length, (b + 1) * block)
            chunk = list(itertools.islice(items, hi - lo))
            order = the_plan.shuffle_order(self.rank, stream, b, hi - lo)
            start = skip - lo if b == first_block else 0
            for j in order[start:]:
                yield chunk[j]

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
                if i + 1 < len(groups) and is_remote(self.urls[groups[i + 1][0].shard]):
                    ahead = self._opener().submit(self._open, groups[i + 1][0].shard, stats)
                yield from self._read_group(group, stats, opened)
        finally:
            if ahead is not None:
                ahead.add_done_callback(_close_opened)

    def _opener(self) -> ThreadPoolExecutor:
        if self._pool is None:  # made in the worker, after the fork
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-open")
        return self._pool

    def _open(self, shard: int, stats: ReadStats) -> ShardStream:
        return open_shard(
            self.urls[shard],
            size=self.byte_sizes[shard],
            max_retries=self.max_retries,
            stats=stats,
            storage_options=self.storage_options,
            backoff_s=self.backoff_s,
            allow_pipe=self.allow_pipe,
        )

    def _read_group(
        self, group: list[Segment], stats: ReadStats, opened: Future[ShardStream] | None = None
    ) -> Iterator[Any]:
        shard = group[0].shard
        url = self.urls[shard]
        valid_of: dict[int, Segment] = {}
        for seg in group:
            for i in range(seg.start, seg.end):
                valid_of[i] = seg
        expected = sorted(valid_of)
        got = 0
        report_activity(f"reading {redact_url(url)}")
        try:
            with opened.result() if opened is not None else self._open(shard, stats) as f:
                for index, key, members in iter_samples(
                    f, want=valid_of.__contains__, stop=expected[-1] + 1, views=True
                ):
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
            if self.on_error == "fail":
                raise error from exc
            lost = len(expected) - got
            stats.shards_failed += 1
            stats.samples_lost += lost
            log.warning("skipping the rest of a shard (%d samples lost): %s", lost, error)
            for index in expected[got:]:
                yield valid_of[index], index, None, None

    # -- batching ------------------------------------------------------------------------

    def _filler(self, epoch: int, avoid: int) -> dict[str, Any]:
        """A stand-in for lost samples when a worker has read nothing yet: the first readable
        sample of another shard (flagged invalid like any filler), so the rank is not short."""
        for shard in [*range(avoid + 1, len(self.urls)), *range(avoid)]:
            report_activity(f"reading a filler sample from {redact_url(self.urls[shard])}")
            try:
                with open_shard(
                    self.urls[shard],
                    size=self.byte_sizes[shard],
                    max_retries=0,
                    storage_options=self.storage_options,
                    allow_pipe=self.allow_pipe,
                ) as f:
                    for index, key, members in iter_samples(f, stop=1):
                        sample = decode_sample(key, members)
                        if self.transform is not None:
                            torch.default_generator.manual_seed(
                                derive_seed(self.seed, epoch, shard, index)
                            )
                            sample = self.transform(sample)
                        return sample
            except Exception as exc:
                log.warning("no filler sample from %s: %s", redact_url(self.urls[shard]), exc)
        raise ShardReadError(self.urls[avoid], "no readable shard left to fill batches with")

    def _make_batch(
        self, raw: list[Any], epoch: int, last_good: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Decode, transform and batch `raw`; lost or undecodable samples are replaced by a
        good one, flagged invalid.

        Each image goes into the batch's memory as soon as it is made, and is dropped: the
        next one then reuses the same (cache-hot) memory. Holding a batch of images until a
        final `torch.stack` cost ~15 us more per image here (page faults as the heap grows
        and shrinks by a batch each time, then a copy from cold memory).
        """
        size = len(raw)
        out: torch.Tensor | None = None
        send: Callable[[], torch.Tensor | PooledBatch] | None = None
        labels: list[int] = [0] * size
        keys: list[str] = [""] * size
        valid: list[bool] = [False] * size
        missing: list[int] = []
        good: dict[str, Any] | None = None
        for pos, (seg, index, key, members) in enumerate(raw):
            if members is None:
                missing.append(pos)
                continue
            try:
                sample = decode_sample(key, members)
            except Exception as exc:
                error = ShardReadError(self.urls[seg.shard], f"sample {key!r}: {exc}")
                if self.on_error == "fail":
                    raise error from exc
                log.warning("skipping an undecodable sample: %s", error)
                missing.append(pos)
                continue
            if self.transform is not None:
                # per-sample seed: augmentations repeat across runs, resumes and world sizes,
                # and differ across samples, workers and ranks (pytorch#5059)
                torch.default_generator.manual_seed(derive_seed(self.seed, epoch, seg.shard, index))
                sample = self.transform(sample)
            if out is None:
                out, send = self._batch_memory(sample["image"], size)
            _put(out, pos, sample["image"])
            labels[pos], keys[pos], valid[pos] = int(sample["label"]), str(sample["key"]), seg.valid
            if good is None:
                good = sample
        if good is None:
            good = last_good if last_good is not None else self._filler(epoch, raw[0][0].shard)
        if out is None:
            out, send = self._batch_memory(good["image"], size)
        for pos in missing:
            _put(out, pos, good["image"])
            labels[pos], keys[pos] = int(good["label"]), str(good["key"])
        assert send is not None
        # Labels and flags travel as lists; the training process makes the tensors. Every
        # tensor a worker sends is a shared-memory segment of its own whose descriptor is
        # handed over on a fresh authenticated connection (torch's file_descriptor sharing):
        # three more per batch for a few bytes each.
        batch = {"image": send(), "label": labels, "key": keys, "valid": valid}
        return batch, good

    def _batch_memory(
        self, first: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor | PooledBatch]]:
        """Where a batch of `size` images like `first` goes, and what to send once it is full:
        a plain tensor in-process, one of the worker's reused shared buffers otherwise."""
        shape = (size, *first.shape)
        if self.in_process:
            plain = torch.empty(shape, dtype=first.dtype)
            return plain, lambda: plain
        return self._buffers.acquire(shape, first.dtype)


def new_shared(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor in a new shared-memory segment (uninitialised; torch's sharing strategy),
    which a pipe passes as a file descriptor, without a copy."""
    empty = torch.empty(0, dtype=dtype)
    return empty.new(empty._typed_storage()._new_shared(numel, device=empty.device))


def _put(out: torch.Tensor, pos: int, image: torch.Tensor) -> None:
    if image.shape != out.shape[1:] or image.dtype != out.dtype:
        raise ValueError(
            f"images of one batch differ: {list(out.shape[1:])} {out.dtype} and "
            f"{list(image.shape)} {image.dtype}; the transform must return one size and type "
            "(e.g. a crop or resize)"
        )
    out[pos].copy_(image)


def _close_opened(future: Future[ShardStream]) -> None:
    if future.exception() is None:
        future.result().close()


def import_filesystems(urls: list[str]) -> None:
    """Import the fsspec filesystems the shards need here, before the workers start.

    Forked workers then share the modules instead of each importing them again whenever
    it starts: fsspec's HTTP filesystem (aiohttp) costs 0.13 s of CPU per import here, ~20%
    of a worker's CPU for a 960-image epoch when workers start each epoch. An unknown
    protocol is left to fail when its shard is read, with the shard's URL.
    """
    remote = (u for u in urls if is_remote(u) and not u.startswith("pipe:"))
    for protocol in {u.split("://", 1)[0] for u in remote}:
        with contextlib.suppress(ImportError, ValueError):
            fsspec.get_filesystem_class(protocol)


def is_remote(url: str) -> bool:
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file://"))


class PooledBatch(NamedTuple):
    """What a worker sends for a batch stacked into one of its reused buffers.

    `buffer` (the shared-memory tensor) travels only until the training process has mapped
    it; after that the batch is named by (owner, serial) alone. torch passes a shared tensor
    as a file descriptor over a fresh authenticated connection to a thread of the sender,
    then maps it again: ~0.6 ms of CPU per batch (training process and worker) against a
    few microseconds for this tuple, and the training process keeps the pages it mapped.
    """

    owner: int  # the worker's pid
    serial: int  # which of its buffers
    shape: tuple[int, ...]
    live: tuple[int, ...]  # the owner's buffers still in use: the receiver forgets the rest
    buffer: torch.Tensor | None


class BatchBuffers:
    """A worker's shared-memory batch buffers, reused once the training process let go.

    Stacking each batch into a new shared-memory segment costs more than the stacking: its
    pages are allocated, zeroed and faulted in one by one in the worker, and freed again in
    the training process (2.9 ms against 0.4 ms for a 32x3x224x224 uint8 batch here, i.e.
    ~0.08 ms per image beside ~1.2 ms of decode + crop). So each buffer carries two elements
    more than the batch, flags that only the training process sets: [n] once nothing of the
    batch is left there (the buffer is free again), [n + 1] once it has mapped the buffer (the
    worker then sends a `PooledBatch` without it). A worker never waits for a buffer: with
    none released it makes a new one, and it forgets the oldest beyond `keep`, so a batch the
    training process keeps is never overwritten. When batches are pinned, the pinned copy is
    made from the lent view, which is then dropped: the buffer goes back at once.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.buffers: list[tuple[int, torch.Tensor]] = []  # (serial, flat buffer)
        self.serial = 0

    def acquire(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, Callable[[], PooledBatch]]:
        """A released (or new) shared buffer for a batch of `shape`, flagged in use: the
        tensor to fill, and the function that names it for sending once it is full."""
        n = math.prod(shape)
        found = next(
            (
                (serial, b)
                for serial, b in self.buffers
                if b.numel() == n + 2 and b.dtype == dtype and b[n].item() == 1
            ),
            None,
        )
        if found is None:
            flat = new_shared(n + 2, dtype)
            flat[n + 1] = 0
            self.serial += 1
            found = (self.serial, flat)
            self.buffers.append(found)
            del self.buffers[: -self.keep]
        serial, flat = found
        flat[n] = 0

        def send() -> PooledBatch:
            mapped = flat[n + 1].item() == 1
            live = tuple(s for s, _ in self.buffers)
            return PooledBatch(os.getpid(), serial, shape, live, None if mapped else flat)

        return flat[:n].view(shape), send


class MappedBuffers:
    """The training process's side: workers' buffers mapped once, batches lent out of them."""

    def __init__(self) -> None:
        self.mapped: dict[tuple[int, int], torch.Tensor] = {}

    def clear(self) -> None:
        """Forget every mapping (new workers; lent batches keep their own reference)."""
        self.mapped.clear()

    def receive(self, ref: PooledBatch) -> torch.Tensor:
        """The batch `ref` names, lent: released to its worker when its last view is gone."""
        key = (ref.owner, ref.serial)
        n = math.prod(ref.shape)
        if ref.buffer is not None:
            self.mapped[key] = ref.buffer
            ref.buffer[n + 1] = 1  # written before any release, so seen by the worker first
        flat = self.mapped.get(key)
        if flat is None:  # a worker sends the buffer until it sees the flag: cannot happen
            raise RuntimeError(f"batch buffer {key} of a loader worker was never received")
        for stale in [k for k in self.mapped if k[0] == ref.owner and k[1] not in ref.live]:
            del self.mapped[stale]
        return lend(flat, n, ref.shape)

    def drop(self, batch: dict[str, Any]) -> None:
        """A batch nobody will see (its pass was called off): its buffer goes back at once."""
        if isinstance(batch.get("image"), PooledBatch):
            self.receive(batch["image"])


def lend(flat: torch.Tensor, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of `flat[:n]` that frees the buffer (flag `flat[n]`) when its last tensor or
    view is gone, not before: no copy, and nothing the trainer still holds is overwritten."""
    try:
        array = flat[:n].numpy()  # a buffer object whose life torch.frombuffer extends
    except TypeError:  # a dtype numpy lacks (bfloat16): copy out and release now
        copy = flat[:n].view(shape).clone()
        release(flat, n)
        return copy
    weakref.finalize(array, release, flat, n)
    return torch.frombuffer(array, dtype=flat.dtype).view(shape)


def release(flat: torch.Tensor, n: int) -> None:
    """Hand a buffer back to its worker (once nothing reads its batch any more)."""
    flat[n] = 1


class ShardedLoader:
    """The per-rank loader: equal batch counts on every rank, exact and elastic resume.

    Args:
        index: the shards (see `open_index`).
        cfg: `data.*` config: batch_size, workers_per_rank, shuffle_buffer, remainder,
            on_error, max_retries, prefetch_factor, pin_memory, persistent_workers,
            allow_pipe (pipe: shard URLs run only with it), timeout_s (the wait for a
            worker's next batch).
        rank: this process's rank.
        world_size: ranks in the job.
        seed: run seed (shard permutation, sample shuffle, augmentation seeds).
        transform: `transform(sample) -> sample` run in the workers on
            {"image": uint8 CHW, "label": int, "key": str, "meta": dict}, with torch's RNG
            seeded from (seed, epoch, shard, sample). Must be picklable when CUDA is
            initialised (workers then start with forkserver).
        train: training (shards permuted per epoch, sample shuffle, `cfg.remainder`) or
            evaluation (index order, no shuffle, remainder "pad" with `valid` flags).
        device: where batches go; pinned memory is used only for CUDA devices.
        storage_options: fsspec options for remote shards (credentials, endpoint_url).
    """

    def __init__(
        self,
        index: ShardIndex,
        cfg: DataConfig,
        *,
        rank: int,
        world_size: int,
        seed: int,
        transform: Transform | None = None,
        train: bool = True,
        device: torch.device | str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not index.shards:
            raise ValueError("the shard index lists no shards")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.index = index
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.transform = transform
        self.train = train
        self.device = torch.device(device) if device is not None else None
        self.storage_options = storage_options or {}
        self.backoff_s = 0.05
        self.urls = [index.shard_url(i) for i in range(len(index.shards))]
        self.shard_sizes = [s.num_samples for s in index.shards]
        self.byte_sizes = [s.num_bytes for s in index.shards]
        if not cfg.allow_pipe:
            # before any worker starts: a pipe: URL here came from code, not from an index
            # (`parse_index` refuses them), and still runs only with the user's opt-in
            for i, url in enumerate(self.urls):
                if url.startswith("pipe:"):
                    raise ShardIndexError(f"shard {i} of the index is a pipe: command: {PIPE_RULE}")
        import_filesystems(self.urls)
        self.params = StageParams(
            world_size=world_size,
            workers_per_rank=cfg.workers_per_rank,
            batch_size=cfg.batch_size,
            remainder=cfg.remainder if train else "pad",
            shuffle_buffer=cfg.shuffle_buffer if train else 0,
        )
        self.epoch = 0
        self._stages: tuple[StageParams, ...] = ()  # earlier stages of this epoch
        self._consumed = 0  # batches of the current stage handed out
        self._stats = dict.fromkeys(_STAT_FIELDS, 0)
        self._finished_on_load = False
        self.control = torch.zeros(3 + MAX_STAGES * _STAGE_INTS, dtype=torch.int64)
        self.control.share_memory_()
        self._dataset = _StreamDataset(self)
        self._pool: WorkerPool | None = None  # the worker processes, while they run
        self._mapped = MappedBuffers()  # the workers' batch buffers
        self._plan_cache: tuple[Any, EpochPlan] | None = None

    # -- the plan ------------------------------------------------------------------------

    def plan(self) -> EpochPlan:
        """The current stage's plan (the whole epoch unless resumed elastically)."""
        return self._dataset._plan(self.epoch, self._stages)

    def __len__(self) -> int:
        """Batches per rank in the current epoch (equal on every rank)."""
        return sum(s.consumed for s in self._stages) + self.plan().batches_per_rank

    @property
    def position(self) -> int:
        """Batches of the current epoch handed to the trainer so far."""
        return sum(s.consumed for s in self._stages) + self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at its first batch; the epoch being resumed keeps its position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._stages = ()
            self._consumed = 0
            self._finished_on_load = False

    # -- iteration -----------------------------------------------------------------------

    def _start_workers(self) -> WorkerPool:
        # Workers fork here. Freezing the GC first keeps the children's collector off the
        # parent's objects, whose refcount/GC writes would otherwise copy their pages.
        gc.freeze()
        try:
            return WorkerPool(
                self._dataset,
                self.cfg.workers_per_rank,
                prefetch=self.cfg.prefetch_factor,
                context=worker_start_method(),
                discard=self._mapped.drop,
                timeout_s=self.cfg.timeout_s,
            )
        finally:
            gc.unfreeze()

    def _raw_batches(self) -> Iterator[dict[str, Any]]:
        """The pass's batches as the workers send them (or as made here, without workers)."""
        if self.cfg.workers_per_rank == 0:
            yield from self._dataset.batches(0)
            return
        persistent = self.cfg.persistent_workers
        if self._pool is not None and (self._pool.broken or not persistent):
            self._stop(self._pool)
        if self._pool is None:
            self._pool = self._start_workers()
        pool = self._pool
        try:
            yield from pool.run()
        finally:
            if not persistent or pool.broken:
                self._stop(pool)

    def _stop(self, pool: WorkerPool) -> None:
        """Stop `pool`'s workers; the current pool's buffers are forgotten with it (an
        older pool, stopped late by its abandoned iterator, leaves the current one alone)."""
        pool.close()
        if self._pool is pool:
            self._pool = None
            self._mapped.clear()

    def _receive(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch from a worker as the trainer gets it: tensors, stats counted."""
        if isinstance(batch["image"], PooledBatch):
            batch["image"] = self._mapped.receive(batch["image"])
        for name, value in zip(_STAT_FIELDS, batch.pop("_stats"), strict=True):
            self._stats[name] += value
        batch["label"] = torch.tensor(batch["label"], dtype=torch.int64)
        batch["valid"] = torch.tensor(batch["valid"], dtype=torch.bool)
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._finished_on_load:
            # resumed from a checkpoint taken after the epoch's last batch: nothing is left of
            # it (a trainer then moves to the next epoch; iterating again restarts this one)
            self._finished_on_load = False
            return
        the_plan = self.plan()
        if self._consumed >= the_plan.batches_per_rank:
            # a finished epoch iterated again (no set_epoch): the same epoch from its start
            self._stages = ()
            self._consumed = 0
            the_plan = self.plan()
        if len(self._stages) > MAX_STAGES:
            raise LoaderStateError(f"more than {MAX_STAGES} elastic re-plans in one epoch")
        values = [self.epoch, len(self._stages), self._consumed]
        for s in self._stages:
            values.extend(_encode_stage(s))
        self.control[: len(values)] = torch.tensor(values, dtype=torch.int64)
        remaining = the_plan.batches_per_rank - self._consumed
        batches: Iterator[dict[str, Any]] = map(self._receive, self._raw_batches())
        pin = self.cfg.pin_memory and self.device is not None and self.device.type == "cuda"
        if pin:
            # a thread makes the pinned copies (the copy releases the GIL, so it overlaps the
            # training step), up to prefetch_factor batches ahead
            batches = run_ahead(batches, pin_batch, self.cfg.prefetch_factor, "hpctrain-pin")
        for batch in batches:
            self._consumed += 1
            remaining -= 1
            yield batch
        # a worker dying or a planning bug must not leave this rank short: DDP would hang
        if remaining:
            raise RuntimeError(f"loader ended {remaining} batches early on rank {self.rank}")

    def close(self) -> None:
        """Stop the worker processes now (persistent ones included); iterating starts new ones.

        Also done at interpreter exit for every loader still holding workers.
        """
        if self._pool is not None:
            self._stop(self._pool)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of this loader's workers while they run ([] without workers, before
        the first pass, after `close`, and between passes unless workers are persistent).

        For accounting outside the loader, such as their CPU time from /proc.
        """
        return self._pool.pids if self._pool is not None else []

    def stats(self) -> dict[str, int]:
        """Counters since the loader was built: retries, shards_failed, samples_lost, bytes."""
        return dict(self._stats)

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Position of this rank: epoch and stages (all ranks hold the same values)."""
        current = replace(stage_params(self.params, self._stages), consumed=self._consumed)
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "num_shards": len(self.shard_sizes),
            "num_samples": sum(self.shard_sizes),
            "epoch": self.epoch,
            "stages": [s.to_dict() for s in (*self._stages, current)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: exactly when world size and workers match, else re-plan the rest."""
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state.get('version')!r} unknown")
        if (state["num_shards"], state["num_samples"]) != (
            len(self.shard_sizes),
            sum(self.shard_sizes),
        ):
            raise LoaderStateError(
                "the loader state was saved for other shards "
                f"({state['num_shards']} shards, {state['num_samples']} samples)"
            )
        if int(state["seed"]) != self.seed:
            raise LoaderStateError(f"the loader state was saved with seed {state['seed']}")
        stages = [StageParams.from_dict(s) for s in state["stages"]]
        self.epoch = int(state["epoch"])
        last = stages[-1]
        if last.same_layout(stage_params(self.params, tuple(stages[:-1]))):
            self._stages = tuple(stages[:-1])
            self._consumed = last.consumed
        else:
            # stages that consumed nothing need no re-plan (and must not drop twice)
            self._stages = tuple(s for s in stages if s.consumed > 0)
            self._consumed = 0
        self._finished_on_load = self.position >= len(self)


def pin_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors copied into page-locked memory (fast, asynchronous host-to-GPU
    copies); the originals, lent buffers included, are dropped."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
