"""What `hpctrain plan` shows of an epoch plan: its summary, per-stream figures and segments.

`plan_report` plans one index, `mixture_report` a mixture of sources (`SourceConfig`, as in
`data.train`); both return a `PlanReport` that `hpctrain plan` (`hpctrain.cli.plan`) prints
as text or as one JSON line. No torch here: `hpctrain plan` starts in a fraction of a second.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from hpctrain.config.schema import SourceConfig
from hpctrain.data.index import ShardIndex
from hpctrain.data.locate import open_index
from hpctrain.data.mixture import MixturePlan, plan_mixture
from hpctrain.data.mixture_index import MixtureIndex, open_mixture
from hpctrain.data.planning import EpochPlan, plan
from hpctrain.data.sequences import sequence_counts, total_dropped_tokens


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The epoch to plan and the job's layout, as `hpctrain plan` takes them.

    Attributes:
        world_size: ranks.
        workers_per_rank: loader workers per rank.
        batch_size: samples per batch per rank.
        epoch: the epoch to plan.
        seed: the run seed.
        remainder: "drop" or "pad".
        evaluation: evaluation's plan (shards in index order, no shuffle).
        seq_len: plan packed sequences of N+1 tokens of a token index (0: samples).
    """

    world_size: int
    workers_per_rank: int
    batch_size: int
    epoch: int = 0
    seed: int = 0
    remainder: str = "drop"
    evaluation: bool = False
    seq_len: int = 0


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """An epoch plan and the figures `hpctrain plan` prints of it.

    Attributes:
        plan: the plan (a `MixturePlan` for a mixture).
        index: the shards it reads.
        summary: JSON-ready figures: the plan's `summary`, epoch, seed, shards, streams; for
            one index the shards per stream (and the tokens with `seq_len`), for a mixture
            `sources` (one dict per source: its epoch's samples, passes, samples read).
        table: `plan.stream_table()`.
        per_rank: a mixture's valid samples of every source (columns) on every rank (rows);
            None for one index.
    """

    plan: EpochPlan
    index: ShardIndex
    summary: dict[str, Any]
    table: dict[str, np.ndarray]
    per_rank: np.ndarray | None = None

    def rank_shares(self) -> np.ndarray:
        """A mixture's share of every source (columns) in every rank's samples (rows)."""
        assert self.per_rank is not None
        return self.per_rank / np.maximum(self.per_rank.sum(axis=1, keepdims=True), 1)

    def stream_rows(self) -> Iterator[Sequence[Any]]:
        """Every stream's segments (rank-major) as rows [url, start, end, valid]."""
        if isinstance(self.plan, MixturePlan):
            assert isinstance(self.index, MixtureIndex)
            urls = self.index.shard_urls()
            seg = self.plan.segment_table()
            bounds = np.searchsorted(seg["stream"], np.arange(len(self.table["rank"]) + 1))
            # tuples built in C (zip), encoded as JSON arrays: [url, start, end, valid]
            rows = list(
                zip(
                    map(urls.__getitem__, seg["shard"].tolist()),
                    seg["start"].tolist(),
                    seg["end"].tolist(),
                    seg["valid"].tolist(),
                    strict=True,
                )
            )
            return (rows[lo:hi] for lo, hi in itertools.pairwise(bounds.tolist()))
        shard_urls = self.index.written_urls()
        return (
            [[shard_urls[s.shard], s.start, s.end, s.valid] for s in segments]
            for segments in self.plan.all_segments()
        )

    def as_json(self, ranks: Sequence[int]) -> dict[str, Any]:
        """The summary, a mixture's `per_rank_samples`, and `stream_segments`: every stream
        (of `ranks`, or all) with its batches and rows (`stream_rows`)."""
        out: dict[str, Any] = dict(self.summary)
        if self.per_rank is not None:
            out["per_rank_samples"] = self.per_rank.tolist()
        out["stream_segments"] = [
            {"rank": r, "worker": w, "batches": nb, "segments": rows}
            for r, w, nb, rows in zip(
                self.table["rank"].tolist(),
                self.table["worker"].tolist(),
                self.table["batches"].tolist(),
                self.stream_rows(),
                strict=True,
            )
            if not ranks or r in ranks
        ]
        return out


def remainder_line(the_plan: EpochPlan, remainder: str, items: str = "samples") -> str:
    """`remainder drop: 14 samples dropped, 0 padded (...)`: what `hpctrain plan` prints,
    saying for `drop` what share of the epoch that is and that it rotates with the epoch."""
    line = f"remainder {remainder}: {the_plan.num_dropped} {items} dropped, {the_plan.num_padded} padded"
    return line + (f" ({dropped_note(the_plan, items)})" if the_plan.num_dropped else "")


def dropped_note(the_plan: EpochPlan, items: str = "samples") -> str:
    """What the samples a training epoch drops are (the trainer logs it too)."""
    n, d = the_plan.num_samples, the_plan.num_dropped
    if not the_plan.batches_per_rank:
        return f"all {n} {items}: fewer than one batch for every rank"
    return (
        f"{d} of {n} {items}, {d / n:.0%}, do not fill a batch on every rank and are left out "
        f"of each epoch, a different {d} each epoch"
    )


def plan_report(data: str, request: PlanRequest) -> PlanReport:
    """The plan of one index (`data`: an index path/URL, a folder holding one, or a shard
    pattern)."""
    index = open_index(data)  # ShardIndexError: a data error, exit code 3
    sizes = index.counts("num_samples")
    if request.seq_len:  # the plan's items are sequences (hpctrain.data.sequences)
        sizes = sequence_counts(index, request.seq_len)
    assert sizes is not None  # every shard has a sample count
    p = plan(
        cast(Sequence[int], sizes),  # read with np.asarray: a mapped column is not copied
        world_size=request.world_size,
        workers_per_rank=request.workers_per_rank,
        batch_size=request.batch_size,
        seed=request.seed,
        epoch=request.epoch,
        remainder=request.remainder,
        shuffle_shards=not request.evaluation,
    )
    table = p.stream_table()
    summary = {
        **p.summary,
        "epoch": request.epoch,
        "seed": request.seed,
        "num_shards": index.num_shards,
        "streams": len(table["rank"]),
        "shards_per_stream": _spread(table["shards"]),
        "partial_shards_per_stream": _spread(table["partial"]),
    }
    if request.seq_len:
        summary["seq_len"] = request.seq_len
        summary["num_tokens"] = index.num_tokens
        summary["tokens_dropped"] = total_dropped_tokens(index, request.seq_len)
    return PlanReport(plan=p, index=index, summary=summary, table=table)


def mixture_report(
    sources: Sequence[SourceConfig], samples_per_epoch: int, request: PlanRequest
) -> PlanReport:
    """The plan of a mixture of `sources` (training only: `request.evaluation` is ignored),
    with the realized mixture per rank."""
    index = open_mixture(sources, samples_per_epoch)
    mixture = index.mixture
    assert mixture is not None
    if request.seq_len:  # the plan's items are packed sequences
        mixture = mixture.with_shard_sizes(sequence_counts(index, request.seq_len).tolist())
    p = plan_mixture(
        mixture,
        world_size=request.world_size,
        workers_per_rank=request.workers_per_rank,
        batch_size=request.batch_size,
        seed=request.seed,
        epoch=request.epoch,
        remainder=request.remainder,
    )
    per_rank = p.source_table().reshape(p.world_size, p.streams_per_rank, -1).sum(axis=1)
    quotas = mixture.quotas()
    table = p.stream_table()
    rows: list[dict[str, Any]] = []
    for s, src in enumerate(mixture.sources):
        lo = (request.epoch - mixture.origin_epoch) * quotas[s]
        rows.append(
            {
                "name": src.name,
                "weight": src.weight,
                "num_shards": len(src.shard_sizes),
                "num_samples": src.num_samples,
                "samples_this_epoch": quotas[s],
                "first_pass": lo // src.num_samples,
                "last_pass": max(lo + quotas[s] - 1, lo) // src.num_samples,
                "read": int(per_rank[:, s].sum()),
            }
        )
    summary = {
        **p.summary,
        "epoch": request.epoch,
        "seed": request.seed,
        "num_shards": index.num_shards,
        "streams": len(table["rank"]),
        "sources": rows,
    }
    return PlanReport(plan=p, index=index, summary=summary, table=table, per_rank=per_rank)


def _spread(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": int(values.min()), "mean": float(values.mean()), "max": int(values.max())}
