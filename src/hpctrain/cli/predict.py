"""`hpctrain predict RUN_DIR|CKPT --data SHARDS --out DEST [--format jsonl|shards] [--nproc N]`."""

from __future__ import annotations

import argparse
import os

from hpctrain.cli.eval import add_target_arguments, forwarded_options, resolve
from hpctrain.cli.options import add_output_option
from hpctrain.launch.local import LAUNCHER_PID_ENV, exit_with_launcher, run_local

HELP = "write a checkpoint's per-sample predictions (JSONL or shards, each sample once)"
EPILOG = """examples:
  hpctrain predict runs/demo --data data/shards/val --out preds/
  hpctrain predict runs/demo/checkpoints/step-400 --data 'new/shard-{000000..000003}.tar' \\
      --out s3://bucket/preds --format shards --nproc 2
DEST gets one part per rank and manifest.json, written last: without it the output is
incomplete. The task's predict(model, batch) decides what each sample gets. The weights are
those the training evaluated with (the EMA under train.ema_eval=true; override it to choose)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, "run folder, one step-<N> checkpoint folder, or a config file")
    add_predict_arguments(parser)


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", default="", help="index.json, folder or shard pattern (default: data.val)"
    )
    add_output_option(parser, "destination folder or fsspec URL (required)", metavar="DEST")
    parser.add_argument(
        "--format",
        choices=("jsonl", "shards"),
        default="jsonl",
        help="JSON lines (default) or tar shards with an index",
    )


def run(args: argparse.Namespace) -> int:
    if os.environ.get(LAUNCHER_PID_ENV):  # a rank of `--nproc N`: never outlive the launcher
        exit_with_launcher()
    from hpctrain.errors import UsageError

    if not args.out:
        raise UsageError("--out is required: a folder or fsspec URL for the predictions")
    cfg, checkpoint = resolve(args)
    from hpctrain.inference.predict import open_destination

    open_destination(args.out, args.data or cfg.data.val)  # refused before starting ranks
    if args.nproc > 1:
        forwarded = [
            args.source,
            *args.overrides,
            *forwarded_options(args, ("checkpoint", "data", "out", "format")),
        ]
        return run_local(forwarded, args.nproc, verb="predict")
    from hpctrain.inference.predict import run_predict

    return run_predict(
        cfg, checkpoint=checkpoint, data=args.data or cfg.data.val, out=args.out, fmt=args.format
    )
