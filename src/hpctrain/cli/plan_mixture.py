"""`hpctrain plan A B C --weights 0.5,0.3,0.2`: the epoch plan of a mixture of sources, with
the realized mixture per rank."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from hpctrain.errors import UsageError

if TYPE_CHECKING:  # imported where used: `hpctrain --help` should not import numpy
    from hpctrain.data.index import ShardIndex
    from hpctrain.data.plan_report import PlanReport, PlanRequest
    from hpctrain.data.planning import EpochPlan


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


def run(args: argparse.Namespace, request: PlanRequest, ranks: list[int]) -> int:
    """The mixture's plan: summary, passes per source, realized mixture per rank."""
    from hpctrain.config.schema import SourceConfig
    from hpctrain.data.plan_report import mixture_report, remainder_line

    paths = list(args.data)
    weights = _weights(args.weights) if args.weights else [1.0] * len(paths)
    names = args.names.split(",") if args.names else [""] * len(paths)
    if len(weights) != len(paths) or len(names) != len(paths):
        raise UsageError(f"--weights/--names: give one per DATA ({len(paths)})")
    if args.eval:
        raise UsageError("--eval: a mixture is planned for training only")
    sources = [
        SourceConfig(path=p, weight=w, name=n)
        for p, w, n in zip(paths, weights, names, strict=True)
    ]
    report = mixture_report(sources, args.samples_per_epoch, request)
    if args.json:
        print_json(report, ranks)
        return 0
    p, index, rows = report.plan, report.index, report.summary["sources"]
    assert report.per_rank is not None
    print(
        f"mixture of {len(rows)} sources, {len(index.shards)} shards; "
        f"{p.num_samples} samples per epoch; epoch {request.epoch}, seed {request.seed}"
    )
    print(
        f"{p.world_size} ranks x {p.streams_per_rank} streams, batch {p.batch_size}: "
        f"{p.batches_per_rank} batches per rank (every rank)"
    )
    print(remainder_line(p, request.remainder, "sequences" if request.seq_len else "samples"))
    total_weight = sum(weights)
    share = report.rank_shares()
    for s, row in enumerate(rows):
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
            f"{row['name']} {int(c)}" for row, c in zip(rows, report.per_rank[r], strict=True)
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


def print_json(report: PlanReport, ranks: list[int]) -> None:
    """`report.as_json(ranks)` as one compact JSON line."""
    # json.dumps, not json.dump: only the one-shot encoder is the C one (json.dump
    # writes through the pure-Python iterencode, ~5x slower at 100k shards)
    sys.stdout.write(json.dumps(report.as_json(ranks), separators=(",", ":")))
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
