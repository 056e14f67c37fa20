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
  hpctrain predict runs/demo --data new-images/ -o preds/     # a folder of images, no index
  hpctrain predict runs/demo/checkpoints/step-400 --data 'new/shard-{000000..000003}.tar' \\
      --out s3://bucket/preds --format shards --nproc 2
DEST gets one part per rank and manifest.json, written last: without it the output is
incomplete. The task's predict(model, batch) decides what each sample gets; each row also
names the file the sample was converted from ("source"), when the data keeps it. A folder of
images without an index is converted first, into a temporary folder. The weights are
those the training evaluated with (the EMA under train.ema_eval=true; override it to choose)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, "run folder, one step-<N> checkpoint folder, or a config file")
    add_predict_arguments(parser)


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        default="",
        help="index.json, shards folder or pattern, or a folder of images (default: data.val)",
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
    from hpctrain.distributed.env import resolve_env
    from hpctrain.errors import UsageError
    from hpctrain.inference.inputs import data_name, predict_data, refuse_image_folder

    if not args.out:
        raise UsageError("--out is required: a folder or fsspec URL for the predictions")
    cfg, checkpoint = resolve(args)
    from hpctrain.inference.predict import open_destination

    data = args.data or cfg.data.val
    open_destination(args.out, data)  # refused before starting ranks
    if resolve_env().world_size > 1:  # every task of an srun step runs this command
        refuse_image_folder(data, "each task of the job would convert it")
    with predict_data(data) as readable:  # a folder of images: converted once, here
        if args.nproc > 1:
            ranks = argparse.Namespace(**{**vars(args), "data": readable})
            forwarded = [
                args.source,
                *args.overrides,
                *forwarded_options(ranks, ("checkpoint", "data", "out", "format")),
            ]
            return run_local(forwarded, args.nproc, verb="predict")
        from hpctrain.inference.predict import run_predict

        return run_predict(
            cfg,
            checkpoint=checkpoint,
            data=readable,
            out=args.out,
            fmt=args.format,
            data_name=data_name(data) if readable == data else data,
        )


def interrupted(args: argparse.Namespace) -> str:
    """After Ctrl-C: parts are written under temporary names and the manifest last."""
    if not args.out:
        return ""
    return f"{args.out} has no manifest.json (written last): run the same command again"
