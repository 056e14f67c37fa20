"""`hpctrain eval CONFIG|RUN_DIR|CKPT [--checkpoint PATH|latest|best] [overrides] [--nproc N]`."""

from __future__ import annotations

import argparse
import os

from hpctrain.cli.options import add_checkpoint_option, add_output_option
from hpctrain.errors import UsageError
from hpctrain.launch.local import LAUNCHER_PID_ENV, exit_with_launcher, run_local

HELP = "evaluate a checkpoint's model over a dataset (the task's metrics; one JSON record)"
EPILOG = """examples:
  hpctrain eval runs/demo                                   # newest checkpoint, over data.val
  hpctrain eval runs/demo --checkpoint best data.val=data/demo/shards/train/index.json --nproc 2
  hpctrain eval configs/demo.yaml --checkpoint runs/demo/checkpoints/step-400
The record is printed as one JSON line and written to RUN_DIR/eval/step-<N>.<data>-<hash>.json
(or --out); under srun every task runs this same command. The weights are those the training
evaluated with: the EMA when the run has train.ema_eval=true (train.ema_eval=false: the
trained weights); the record says which ("weights": "ema" or "model")."""


def add_target_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The arguments `eval` and `predict` share (also read by `submit --eval/--predict`)."""
    parser.add_argument("source", help=what)
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. data.batch_size=64",
    )
    add_checkpoint_option(parser)
    parser.add_argument(
        "--nproc", type=int, default=1, help="start N local processes (gloo on CPU, NCCL on GPUs)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser, "config file, run folder, or one step-<N> checkpoint folder")
    add_output_option(
        parser, "the record's file (default RUN_DIR/eval/step-<N>.<data>-<hash>.json)"
    )


def forwarded_options(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each option the ranks need again."""
    words: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value:
            words += [f"--{name}", str(value)]
    return words


def resolve(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(config, checkpoint) these arguments name."""
    from hpctrain.inference.target import resolve_target

    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be >= 1")
    cfg, named = resolve_target(args.source, args.overrides)
    return cfg, named or args.checkpoint


def run(args: argparse.Namespace) -> int:
    if os.environ.get(LAUNCHER_PID_ENV):  # a rank of `--nproc N`: never outlive the launcher
        exit_with_launcher()
    cfg, checkpoint = resolve(args)  # validate before starting any process
    from hpctrain.inference.evaluate import check_record_path

    check_record_path(args.out)
    if args.nproc > 1:
        forwarded = [args.source, *args.overrides, *forwarded_options(args, ("checkpoint", "out"))]
        return run_local(forwarded, args.nproc, verb="eval")
    from hpctrain.inference.evaluate import run_eval

    return run_eval(cfg, checkpoint=checkpoint, out=args.out)
