"""`hpctrain train CONFIG [overrides] [--nproc N] [--debug] [--checkpoint PATH|latest|none]`."""

from __future__ import annotations

import argparse
import os

from hpctrain.cli.options import add_checkpoint_option
from hpctrain.config import load_config, with_overrides
from hpctrain.errors import UsageError
from hpctrain.launch.local import LAUNCHER_PID_ENV, exit_with_launcher, run_local
from hpctrain.launch.profiles import run_failure_rate

HELP = "train a model from a config (one process, N local processes, or as a SLURM task)"
EPILOG = """examples:
  hpctrain train configs/demo.yaml
  hpctrain train configs/demo.yaml --nproc 2 train.max_steps=50 run_dir=runs/try2
  hpctrain train configs/demo.yaml --debug            # one process, errors raised at once
  hpctrain train configs/demo.yaml --overfit-batches 1 train.max_steps=100
  hpctrain train configs/demo.yaml --checkpoint none  # start afresh (older spelling: --resume)
Under srun every task runs this same command; ranks come from SLURM_PROCID/SLURM_NTASKS."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. train.max_steps=100",
    )
    parser.add_argument(
        "--nproc", type=int, default=1, help="start N local processes (gloo on CPU, NCCL on GPUs)"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="one process, in-process loading, anomaly detection, small limits",
    )
    parser.add_argument(
        "--overfit-batches",
        type=int,
        default=0,
        metavar="N",
        help="train on the first N batches only (loss must reach ~0)",
    )
    add_checkpoint_option(
        parser,
        keywords=("latest", "none"),
        default=None,
        aliases=("--resume",),
        help="the checkpoint to resume from: latest (the run folder's newest, default: "
        "checkpoint.resume), none (start afresh) or a checkpoint folder",
    )


def resolve(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The config these arguments describe (file, overrides, then the flags)."""
    cfg = load_config(args.config, args.overrides)
    extra: list[str] = []
    if args.checkpoint is not None:
        extra.append(f"checkpoint.resume={args.checkpoint}")
    if args.overfit_batches:
        extra.append(f"train.overfit_batches={args.overfit_batches}")
    if args.debug:
        max_steps = min(cfg.train.max_steps or 20, 20)
        extra += [
            "train.debug=true",
            "data.workers_per_rank=0",
            "data.on_error=fail",
            f"train.max_steps={max_steps}",
            "train.log_every=1",
        ]
    return with_overrides(cfg, extra) if extra else cfg


def run(args: argparse.Namespace) -> int:
    if os.environ.get(LAUNCHER_PID_ENV):  # a rank of `--nproc N`: never outlive the launcher
        exit_with_launcher()
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be >= 1")
    cfg = resolve(args)  # validate before starting any process
    if args.nproc > 1 and not args.debug:
        forwarded = [args.config, *args.overrides]
        if args.checkpoint is not None:
            forwarded += ["--checkpoint", args.checkpoint]
        if args.overfit_batches:
            forwarded += ["--overfit-batches", str(args.overfit_batches)]
        return run_local(forwarded, args.nproc, run_dir=cfg.run_dir)
    from hpctrain.train import run_training

    # checkpoint.every_minutes=auto: the cluster profile's prior and the run's own failures
    return run_training(cfg, failure_rate=run_failure_rate(cfg))
