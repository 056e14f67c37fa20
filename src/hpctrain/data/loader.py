"""`ShardedLoader`: the per-rank loader over an epoch plan, with exact and elastic resume.

The parts it drives, one module each: the epoch plan (`hpctrain.data.planning`), each
worker's samples, read, decoded, transformed and batched (`SampleReader` in
`hpctrain.data.samples`, decoding in `hpctrain.data.decode`, batching in
`hpctrain.data.collate`), and the batch transport: the worker processes
(`hpctrain.data.transport`) and the pooled shared-memory buffers batches travel in
(`hpctrain.data.buffers`). Workers hand over uint8 images (normalisation belongs on the
device: 4x fewer bytes between processes than float32).

Where the epoch and resume position live: in a small shared-memory tensor the workers read
each time an iteration starts. Persistent workers keep their copy of the `SampleReader` across
epochs, so `set_epoch` on the main process's copy alone would never reach them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import cached_property
from typing import Any

import fsspec
import numpy as np
import torch

from hpctrain.config.schema import DataConfig
from hpctrain.data.buffers import PlainMemory
from hpctrain.data.index import Counts, ShardIndex, ShardIndexError, shards_digest
from hpctrain.data.mixture import Mixture
from hpctrain.data.mixture_resume import (
    check_state_sources,
    rebase,
    same_weights,
    with_state_origin,
)
from hpctrain.data.planning import EpochPlan, StageParams
from hpctrain.data.samples import (
    CONTROL_INTS,
    MAX_STAGES,
    STAT_FIELDS,
    Collate,
    Decode,
    ReadSpec,
    SampleReader,
    Transform,
    encode_stage,
    stage_params,
)
from hpctrain.data.sequences import sequence_layout
from hpctrain.data.stream import PIPE_RULE
from hpctrain.data.transport import WorkerPool, run_ahead, worker_start_method
from hpctrain.errors import DataError

log = logging.getLogger("hpctrain.data")

STATE_VERSION = 1


class LoaderStateError(DataError, ValueError):
    """A loader state that does not belong to this data (other shards or another seed)."""


class ShardedLoader:
    """The per-rank loader: equal batch counts on every rank, exact and elastic resume.

    Args:
        index: the shards (see `open_index`).
        cfg: `data.*` config: batch_size, workers_per_rank, shuffle_buffer, remainder,
            on_error (per shard and per sample), max_retries, prefetch_factor, pin_memory,
            persistent_workers, allow_pipe (pipe: shard URLs run only with it), timeout_s
            (the wait for a worker's next batch), max_image_pixels.
        rank: this process's rank.
        world_size: ranks in the job.
        seed: run seed (shard permutation, sample shuffle, augmentation seeds).
        transform: `transform(sample) -> sample` run in the workers on the decoded sample
            (`{"key": str, <field>: value}`, see `hpctrain.data.decode`), with torch's RNG
            seeded from (seed, epoch, shard, sample). It may raise `SampleError` for a sample
            it refuses (handled under `cfg.on_error`). Must be picklable when CUDA is
            initialised (workers then start with forkserver).
        decode: replaces the default decoding: `decode(key, members) -> sample`, members
            being {field name: bytes or memoryview}; run in the workers. Unused with
            `cfg.seq_len > 0`: the index's token shards are then read as packed sequences,
            samples `{"key": "<shard stem>/<sequence index>", "tokens": int64 [seq_len + 1],
            "positions": int64 [seq_len + 1]}` (positions in documents: data/sequences.py)
            (`hpctrain.data.sequences`), and the plan counts sequences, not samples.
        collate: replaces the default collate (see `hpctrain.data.collate`):
            `collate(samples) -> batch`; the batch's top-level tensors travel in the pooled
            buffers, and `key` and `valid` are set by the loader.
        train: training (shards permuted per epoch, sample shuffle, `cfg.remainder`) or
            evaluation (index order, no shuffle, remainder "pad" with `valid` flags).
        device: where batches go; pinned memory is used only for CUDA devices.
        storage_options: fsspec options for remote shards (credentials, endpoint_url).
        batches_held: batches the consumer keeps at once (the trainer: a step's
            `train.grad_accum_steps` micro-batches), for the workers' buffer pools.
        keep_source: each batch also carries `__source__`, its samples' source paths as
            `hpctrain convert` recorded them ("" where none; see
            `hpctrain.data.fieldnames.SOURCE_FIELD`): what `hpctrain predict` writes.
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
        decode: Decode | None = None,
        collate: Collate | None = None,
        train: bool = True,
        device: torch.device | str | None = None,
        storage_options: dict[str, Any] | None = None,
        batches_held: int = 1,
        keep_source: bool = False,
    ) -> None:
        if not index.num_shards:
            raise ValueError("the shard index lists no shards")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.index = index
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.train = train
        self.batches_held = batches_held
        self.device = torch.device(device) if device is not None else None
        # resolved when read: a tuple from index.json, made on demand from the compact form
        urls = index.shard_urls()
        protocols = index.url_protocols()
        if not cfg.allow_pipe and "pipe" in protocols:
            # before any worker starts: a pipe: URL here came from code, not from an index
            # (`parse_index` refuses them), and still runs only with the user's opt-in
            i = next(i for i, url in enumerate(urls) if url.startswith("pipe:"))
            raise ShardIndexError(f"shard {i} of the index is a pipe: command: {PIPE_RULE}")
        import_filesystems(protocols)
        self.params = StageParams(
            world_size=world_size,
            workers_per_rank=cfg.workers_per_rank,
            batch_size=cfg.batch_size,
            remainder=cfg.remainder if train else "pad",
            shuffle_buffer=cfg.shuffle_buffer if train else 0,
        )
        # columns, not one object per shard: at a million shards the plan reads these alone
        samples, byte_sizes = index.counts("num_samples"), index.counts("num_bytes")
        assert samples is not None and byte_sizes is not None  # every shard has both
        shard_sizes: Counts = samples
        vocab_size, eod_id = 0, None
        self.dropped_tokens = 0  # per epoch: token-stream tails too short for a sequence
        shard_tokens: tuple[int, ...] = ()
        if cfg.seq_len:  # token shards read as packed sequences (data/sequences.py)
            shard_sizes, vocab_size, self.dropped_tokens = sequence_layout(index, cfg.seq_len)
            eod_id = (index.tokenizer or {}).get("eod_id")  # documents end there (positions)
            shard_tokens = tuple(s.num_tokens or 0 for s in index.shards)
        # a mixture (`hpctrain.data.mixture_index.MixtureIndex`) plans training only, over the
        # items the plan counts (packed sequences with data.seq_len)
        mixture = getattr(index, "mixture", None) if train else None
        if mixture is not None:
            mixture = mixture.with_shard_sizes(np.asarray(shard_sizes).tolist())
        spec = ReadSpec(
            urls=urls,
            shard_sizes=shard_sizes,
            byte_sizes=byte_sizes,
            rank=rank,
            seed=seed,
            train=train,
            params=self.params,
            on_error=cfg.on_error,
            max_retries=cfg.max_retries,
            allow_pipe=cfg.allow_pipe,
            storage_options=dict(storage_options or {}),
            max_image_pixels=cfg.max_image_pixels,
            in_process=cfg.workers_per_rank == 0,
            mixture=mixture,
            seq_len=cfg.seq_len,
            vocab_size=vocab_size,
            eod_id=None if eod_id is None else int(eod_id),
            shard_tokens=shard_tokens,
            keep_source=keep_source,
        )
        self.epoch = 0
        self._stages: tuple[StageParams, ...] = ()  # earlier stages of this epoch
        self._consumed = 0  # batches of the current stage handed out
        self._stats = dict.fromkeys(STAT_FIELDS, 0)
        self._source_stats = [0] * (2 * len(spec.mixture.sources) if spec.mixture else 0)
        self._finished_on_load = False
        # the position of a pass, read by the workers when it starts (see `__iter__`)
        self.control = torch.zeros(CONTROL_INTS, dtype=torch.int64)
        self.control.share_memory_()
        self._reader = SampleReader(
            spec, self.control, transform=transform, decode=decode, collate=collate
        )
        self._pool: WorkerPool | None = None  # the worker processes, while they run

    @property
    def backoff_s(self) -> float:
        """First wait before a shard read is retried (doubles each time); for workers
        started after it is set."""
        return self._reader.spec.backoff_s

    @backoff_s.setter
    def backoff_s(self, value: float) -> None:
        self._reader.spec = replace(self._reader.spec, backoff_s=value)

    @property
    def shard_sizes(self) -> Counts:
        """Samples (sequences with `data.seq_len`) per shard, in index order."""
        return self._reader.spec.shard_sizes

    # -- the plan ------------------------------------------------------------------------

    def plan(self) -> EpochPlan:
        """The current stage's plan (the whole epoch unless resumed elastically)."""
        return self._reader.plan(self.epoch, self._stages)

    def __len__(self) -> int:
        """Batches per rank in the current epoch (equal on every rank)."""
        if self.mixture is not None and self.epoch < self.mixture.origin_epoch:
            return self.position  # an epoch ended early by a change of the mixture's weights
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
        # workers freeze what they inherit themselves (`transport._work`)
        return WorkerPool(
            self._reader,
            self.cfg.workers_per_rank,
            prefetch=self.cfg.prefetch_factor,
            context=worker_start_method(),
            timeout_s=self.cfg.timeout_s,
            held=self.batches_held,
        )

    def _raw_batches(self) -> Iterator[dict[str, Any]]:
        """The pass's batches as the workers send them (or as made here, without workers)."""
        if self.cfg.workers_per_rank == 0:
            yield from self._reader.batches(0, PlainMemory())
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
        """Stop `pool`'s workers (an older pool, stopped late by its abandoned iterator,
        leaves the current one alone)."""
        pool.close()
        if self._pool is pool:
            self._pool = None

    def _receive(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch as the trainer gets it: its read counters taken out and counted."""
        counts = batch.pop("_stats")
        for name, value in zip(STAT_FIELDS, counts, strict=False):
            self._stats[name] += value
        for i, value in enumerate(counts[len(STAT_FIELDS) :]):  # a mixture's, per source
            self._source_stats[i] += value
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
            values.extend(encode_stage(s))
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
        """Counters since the loader was built: retries, shards_failed, samples_lost (in
        shards that failed), samples_skipped (unusable samples), bytes_read, bytes_skipped."""
        return {**self._stats, **self.source_stats()}

    @property
    def mixture(self) -> Mixture | None:
        """The mixture this loader plans (None: one source, or evaluation)."""
        return self._reader.spec.mixture

    def source_stats(self) -> dict[str, int]:
        """A mixture's counters per source, since the loader was built:
        `samples_seen/<name>` (valid samples handed out) and `samples_missing/<name>`
        (planned but lost in a failed shard or skipped as unusable); {} for one source."""
        if self.mixture is None:
            return {}
        names = self.mixture.names
        n = len(names)
        out = {f"samples_seen/{name}": self._source_stats[i] for i, name in enumerate(names)}
        out.update(
            {f"samples_missing/{name}": self._source_stats[n + i] for i, name in enumerate(names)}
        )
        return out

    # -- state ---------------------------------------------------------------------------

    @cached_property
    def index_digest(self) -> str:
        """The identity of the shards this loader reads (`shards_digest`), kept in its state:
        a resume onto shards replaced in place (same counts, other samples) is noticed."""
        return shards_digest(self.index.shards)

    def state_dict(self) -> dict[str, Any]:
        """Position of this rank: epoch and stages (all ranks hold the same values)."""
        current = replace(stage_params(self.params, self._stages), consumed=self._consumed)
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "num_shards": len(self.shard_sizes),
            "num_samples": int(np.sum(self.shard_sizes)),
            "index_digest": self.index_digest,
            "epoch": self.epoch,
            "stages": [s.to_dict() for s in (*self._stages, current)],
            **({"mixture": self.mixture.to_dict()} if self.mixture is not None else {}),
            "seq_len": self.cfg.seq_len,
            "drop_rotation_from": self._reader.spec.drop_rotation_from,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: exactly when world size and workers match, else re-plan the rest."""
        if state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"loader state version {state.get('version')!r} unknown")
        # first: another seq_len also changes the counts, this names the cause
        if int(state.get("seq_len", 0)) != self.cfg.seq_len:
            raise LoaderStateError(
                f"the loader state was saved with data.seq_len = {state.get('seq_len', 0)}"
            )
        if int(state["seed"]) != self.seed:
            raise LoaderStateError(f"the loader state was saved with seed {state['seed']}")
        stages = [StageParams.from_dict(s) for s in state["stages"]]
        self.epoch = int(state["epoch"])
        # a state saved before the rotation of dropped samples: its epoch as it was planned
        self._set_spec(drop_rotation_from=int(state.get("drop_rotation_from", self.epoch + 1)))
        mixed = self.mixture is not None and "mixture" in state  # checked by source below
        if not mixed and not self._same_data(state):
            self._stages, self._consumed = (), 0
            self._finished_on_load = True  # the trainer moves on to the next epoch
            return
        if self._load_mixture(state, stages):
            return
        last = stages[-1]
        if last.same_layout(stage_params(self.params, tuple(stages[:-1]))):
            self._stages = tuple(stages[:-1])
            self._consumed = last.consumed
        else:
            # stages that consumed nothing need no re-plan (and must not drop twice)
            self._stages = tuple(s for s in stages if s.consumed > 0)
            self._consumed = 0
        self._finished_on_load = self.position >= len(self)

    def _same_data(self, state: dict[str, Any]) -> bool:
        """True when `state` was saved for these shards (a state without a digest: when the
        counts agree); otherwise refuse, or with `data.resume_changed=new_epoch` warn and
        return False: the saved epoch then ends at the checkpoint."""
        saved = (int(state["num_shards"]), int(state["num_samples"]))
        ours = (len(self.shard_sizes), int(np.sum(self.shard_sizes)))
        digest = str(state.get("index_digest") or "")
        if saved == ours and digest in ("", self.index_digest):
            return True
        items = "sequences" if self.cfg.seq_len else "samples"
        if saved != ours:
            what = f"{saved[0]} -> {ours[0]} shards, {saved[1]} -> {ours[1]} {items}"
        else:
            what = (
                f"the same {ours[0]} shards and {ours[1]} {items}, other contents: shard list "
                f"sha256 {digest[:12]} -> {self.index_digest[:12]}"
            )
        if self.cfg.resume_changed == "new_epoch":
            log.warning(
                "data.train changed since the checkpoint (%s): epoch %d ends at the checkpoint, "
                "epoch %d plans the new shards (data.resume_changed=new_epoch)",
                what,
                self.epoch,
                self.epoch + 1,
            )
            return False
        raise LoaderStateError(
            f"data.train changed since the checkpoint ({what}): the rest of epoch {self.epoch} "
            f"would read other {items} by their positions; restore the shards the run trained "
            f"on, or set data.resume_changed=new_epoch to end epoch {self.epoch} at the "
            f"checkpoint and plan the new shards from epoch {self.epoch + 1}"
        )

    def _load_mixture(self, state: dict[str, Any], stages: list[StageParams]) -> bool:
        """A mixture's origin from `state`; True when the weights changed: then the saved
        epoch ends here and the next starts a new plan from every source's position."""
        if self.mixture is None and "mixture" not in state:
            return False
        if self.mixture is None or "mixture" not in state:
            raise LoaderStateError(
                "the loader state was saved for "
                + ("a mixture of sources" if "mixture" in state else "one source")
                + ", this run reads "
                + ("a mixture" if self.mixture is not None else "one source")
            )
        saved = state["mixture"]
        added = check_state_sources(self.mixture, saved)
        if not added and same_weights(self.mixture, saved):
            self._set_mixture(with_state_origin(self.mixture, saved))
            return False
        old_sources = tuple(
            replace(s, weight=float(w))
            for s, w in zip(self.mixture.sources, saved["weights"], strict=False)
        )
        old = with_state_origin(Mixture(old_sources, int(saved["samples_per_epoch"])), saved)
        rotated = self.epoch >= self._reader.spec.drop_rotation_from
        self._set_mixture(rebase(old, self.mixture, self.seed, self.epoch, stages, rotated))
        log.info(
            "mixture %s at epoch %d: epoch %d starts a new plan from every source's position",
            f"sources added ({', '.join(added)})" if added else "weights changed",
            self.epoch,
            self.epoch + 1,
        )
        self._stages, self._consumed = tuple(stages[:-1]), stages[-1].consumed
        self._finished_on_load = True  # the trainer moves on to the next epoch
        return True

    def _set_mixture(self, mixture: Mixture) -> None:
        self._set_spec(mixture=mixture)

    def _set_spec(self, **changes: Any) -> None:
        """Change what the workers read by (`ReadSpec` fields) before a pass."""
        spec = replace(self._reader.spec, **changes)
        if spec == self._reader.spec:
            return
        if self._pool is not None:  # workers hold the old plan's spec
            self._stop(self._pool)
        self._reader.spec = spec
        self._reader._plan_cache = None


def pin_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors copied into page-locked memory (fast, asynchronous host-to-GPU
    copies); the originals, lent buffers included, are dropped."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def import_filesystems(protocols: Iterable[str]) -> None:
    """Import the fsspec filesystems of the shards' `protocols` here, before the workers start.

    Forked workers then share the modules instead of each importing them again whenever
    it starts: importing fsspec's HTTP filesystem (aiohttp) is a
    noticeable share of a worker's CPU when workers start each epoch (figure in BENCHMARKS.md,
    "Figures behind the code"). An unknown
    protocol is left to fail when its shard is read, with the shard's URL.
    """
    for protocol in set(protocols) - {"file", "pipe"}:
        with contextlib.suppress(ImportError, ValueError):
            fsspec.get_filesystem_class(protocol)
