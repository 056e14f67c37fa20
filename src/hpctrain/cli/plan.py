"""`hpctrain plan DATA ...`: print the epoch plan (batches per rank, drops, shards per stream)."""

from __future__ import annotations

import argparse

from hpctrain.cli import plan_mixture
from hpctrain.errors import UsageError

HELP = "show the epoch plan: batches per rank, samples dropped or padded, shards per worker"
EPILOG = (
    "example: hpctrain plan data/shards/train --world-size 8 --workers-per-rank 4 "
    "--batch-size 64 --epoch 3"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "data",
        nargs="+",
        help="index.json path/URL, a folder holding one, or a shard pattern; several: a mixture",
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks (GPUs) in the job")
    parser.add_argument("--workers-per-rank", type=int, default=2, help="loader workers per rank")
    parser.add_argument("--batch-size", type=int, required=True, help="samples per batch per rank")
    parser.add_argument("--epoch", type=int, default=0, help="epoch to plan (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="run seed (default: 0)")
    parser.add_argument(
        "--remainder",
        choices=("drop", "pad"),
        default=None,
        help="data.remainder (default: drop; with --eval: pad, as evaluation does)",
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="evaluation's plan: shards in index order, no shuffle, the remainder padded",
    )
    parser.add_argument(
        "--rank",
        type=int,
        action="append",
        default=None,
        help="list the shards of this rank's streams (repeatable)",
    )
    parser.add_argument(
        "--json", action="store_true", help="machine-readable: summary and every stream's segments"
    )
    plan_mixture.add_arguments(parser)
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="data.seq_len: plan packed sequences of N+1 tokens of a token index (default: 0)",
    )


def run(args: argparse.Namespace) -> int:
    from hpctrain.data.plan_report import PlanRequest, plan_report, remainder_line

    if args.world_size < 1 or args.batch_size < 1 or args.workers_per_rank < 0:
        raise UsageError("--world-size and --batch-size must be >= 1, --workers-per-rank >= 0")
    for r in args.rank or []:
        if not 0 <= r < args.world_size:
            raise UsageError(f"--rank {r} is outside world size {args.world_size}")
    if args.seq_len < 0:
        raise UsageError("--seq-len must be >= 0")
    if args.eval and args.remainder == "drop":
        # evaluation pads and counts every sample (hpctrain.data.loader): a drop plan is not its
        raise UsageError("--eval --remainder drop: evaluation always pads (--remainder pad)")
    request = PlanRequest(
        world_size=args.world_size,
        workers_per_rank=args.workers_per_rank,
        batch_size=args.batch_size,
        epoch=args.epoch,
        seed=args.seed,
        remainder=args.remainder or ("pad" if args.eval else "drop"),
        evaluation=args.eval,
        seq_len=args.seq_len,
    )
    ranks = args.rank if args.rank is not None else []
    if len(args.data) > 1:
        return plan_mixture.run(args, request, ranks)
    report = plan_report(args.data[0], request)
    if args.json:
        plan_mixture.print_json(report, ranks)
        return 0
    p, index, summary = report.plan, report.index, report.summary
    print(
        f"{len(index.shards)} shards, {p.num_samples} samples; epoch {args.epoch}, seed {args.seed}"
    )
    print(
        f"{p.world_size} ranks x {p.streams_per_rank} streams, batch {p.batch_size}: "
        f"{p.batches_per_rank} batches per rank (every rank), "
        f"{p.batches_per_rank * p.batch_size} samples per rank"
    )
    print(remainder_line(p, request.remainder, "sequences" if request.seq_len else "samples"))
    if args.seq_len:
        print(
            f"seq_len {args.seq_len}: samples are sequences of {args.seq_len}+1 tokens, "
            f"{p.batches_per_rank * p.batch_size} sequences per rank; "
            f"{summary['tokens_dropped']} of {index.num_tokens} tokens dropped "
            "(shard tails shorter than a sequence)"
        )
    s, q = summary["shards_per_stream"], summary["partial_shards_per_stream"]
    print(f"shards per stream: min {s['min']}, mean {s['mean']:.2f}, max {s['max']}")
    print(f"partly read shards per stream: min {q['min']}, mean {q['mean']:.2f}, max {q['max']}")
    plan_mixture.print_stream_segments(p, index, ranks)
    return 0
