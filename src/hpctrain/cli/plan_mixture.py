"""`hpctrain plan A B C --weights 0.5,0.3,0.2`: the epoch plan of a mixture of sources, with
the realized mixture per rank."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from hpctrain.data.index import ShardIndex
from hpctrain.data.mixture import plan_mixture
from hpctrain.data.mixture_index import open_mixture
from hpctrain.data.planning import EpochPlan
from hpctrain.data.sequences import sequence_counts
from hpctrain.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        default="",
        help="with several DATA: their weights, comma-separated (default: equal)",
    )
    parser.add_argument(
        "--names", default="", help="with several DATA: their names, comma-separated"
    )
    parser.add_argument(
        "--samples-per-epoch",
        type=int,
        default=0,
        help="with several DATA: the epoch in samples (default: all their samples)",
    )


def run(args: argparse.Namespace) -> int:
    """The mixture's plan: summary, passes per source, realized mixture per rank."""
    paths = list(args.data)
    weights = _weights(args.weights) if args.weights else [1.0] * len(paths)
    names = args.names.split(",") if args.names else [""] * len(paths)
    if len(weights) != len(paths) or len(names) != len(paths):
        raise UsageError(f"--weights/--names: give one per DATA ({len(paths)})")
    if args.eval:
        raise UsageError("--eval: a mixture is planned for training only")
    index = open_mixture(
        [
            SimpleNamespace(path=p, weight=w, name=n)
            for p, w, n in zip(paths, weights, names, strict=True)
        ],
        args.samples_per_epoch,
    )
    mixture = index.mixture
    assert mixture is not None
    if getattr(args, "seq_len", 0):  # the plan's items are packed sequences
        mixture = mixture.with_shard_sizes(sequence_counts(index, args.seq_len))
    p = plan_mixture(
        mixture,
        world_size=args.world_size,
        workers_per_rank=args.workers_per_rank,
        batch_size=args.batch_size,
        seed=args.seed,
        epoch=args.epoch,
        remainder=args.remainder,
    )
    per_rank = p.source_table().reshape(p.world_size, p.streams_per_rank, -1).sum(axis=1)
    quotas = mixture.quotas()
    table = p.stream_table()
    sources: list[dict[str, Any]] = []
    for s, src in enumerate(mixture.sources):
        lo = (args.epoch - mixture.origin_epoch) * quotas[s]
        sources.append(
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
    total_weight = sum(weights)
    share = per_rank / np.maximum(per_rank.sum(axis=1, keepdims=True), 1)
    summary = {
        **p.summary,
        "epoch": args.epoch,
        "seed": args.seed,
        "num_shards": len(index.shards),
        "streams": len(table["rank"]),
        "sources": sources,
    }
    ranks = args.rank if args.rank is not None else []
    if args.json:
        out: dict[str, Any] = dict(summary)
        out["per_rank_samples"] = per_rank.tolist()
        urls = index.urls
        seg = p.segment_table()
        bounds = np.searchsorted(seg["stream"], np.arange(len(table["rank"]) + 1))
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
        per_stream = (rows[lo:hi] for lo, hi in itertools.pairwise(bounds.tolist()))
        write_plan_json(out, table, per_stream, ranks)
        return 0
    print(
        f"mixture of {len(sources)} sources, {len(index.shards)} shards; "
        f"{p.num_samples} samples per epoch; epoch {args.epoch}, seed {args.seed}"
    )
    print(
        f"{p.world_size} ranks x {p.streams_per_rank} streams, batch {p.batch_size}: "
        f"{p.batches_per_rank} batches per rank (every rank)"
    )
    print(f"remainder {args.remainder}: {p.num_dropped} samples dropped, {p.num_padded} padded")
    for s, row in enumerate(sources):
        passes = (
            f"pass {row['first_pass']}"
            if row["first_pass"] == row["last_pass"]
            else f"passes {row['first_pass']}-{row['last_pass']}"
        )
        print(
            f"  {row['name']}: weight {row['weight'] / total_weight:.3f}, "
            f"{row['samples_this_epoch']} samples this epoch of {row['num_samples']} ({passes}); "
            f"share per rank {share[:, s].min():.4f}..{share[:, s].max():.4f}"
        )
    show = ranks or (list(range(p.world_size)) if p.world_size <= 16 else [])
    for r in show:
        parts = ", ".join(
            f"{src['name']} {int(c)}" for src, c in zip(sources, per_rank[r], strict=True)
        )
        print(f"rank {r}: {parts}")
    print_stream_segments(p, index, ranks)
    return 0


def _weights(text: str) -> list[float]:
    """`--weights 5,3,2` as numbers, each finite and > 0 (a usage error names the flag)."""
    weights = []
    for part in text.split(","):
        try:
            w = float(part)
        except ValueError:
            w = math.nan
        if not (w > 0 and math.isfinite(w)):
            raise UsageError(
                f"--weights {text}: {part.strip()!r} is not a number > 0 (give one per DATA, "
                "comma-separated: --weights 5,3,2)"
            )
        weights.append(w)
    return weights


def write_plan_json(
    out: dict[str, Any],
    table: dict[str, np.ndarray],
    segments: Iterable[Sequence[Any]],
    ranks: list[int],
) -> None:
    """Print `out` plus `stream_segments` (one entry per stream of `table`, with its rows
    from `segments`, of the ranks in `ranks` or all) as one compact JSON line."""
    out["stream_segments"] = [
        {"rank": r, "worker": w, "batches": nb, "segments": rows}
        for r, w, nb, rows in zip(
            table["rank"].tolist(),
            table["worker"].tolist(),
            table["batches"].tolist(),
            segments,
            strict=True,
        )
        if not ranks or r in ranks
    ]
    # json.dumps, not json.dump: only the one-shot encoder is the C one (json.dump
    # writes through the pure-Python iterencode, ~5x slower at 100k shards)
    sys.stdout.write(json.dumps(out, separators=(",", ":")))
    print()


def print_stream_segments(p: EpochPlan, index: ShardIndex, ranks: list[int]) -> None:
    """One line per stream of `ranks`: its batches and its shard ranges (pads marked)."""
    for r in ranks:
        for w in range(p.streams_per_rank):
            segs = [
                f"{index.shards[seg.shard].url}[{seg.start}:{seg.end}]"
                + ("" if seg.valid else " (pad)")
                for seg in p.stream_segments(r, w)
            ]
            print(f"rank {r} worker {w}: {p.stream_batches(w)} batches: {' '.join(segs)}")
