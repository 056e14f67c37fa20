"""`hpctrain sbatch CONFIG [overrides] [--profile P]`: print a job script for plain `sbatch`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpctrain.errors import UsageError
from hpctrain.launch.preflight import preflight, raise_if_failed
from hpctrain.launch.prepare import prepare, train_overrides
from hpctrain.launch.safety import check_path
from hpctrain.launch.sbatch import render_sbatch
from hpctrain.launch.submit import log_folder

HELP = "print an sbatch script (one task per GPU, requeue on preemption) for a config"
EPILOG = """examples:
  hpctrain sbatch configs/demo.yaml --profile jean-zay-a100 slurm.account=abc@a100 > job.sbatch
  sbatch job.sbatch"""


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. slurm.time=02:00:00",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="cluster profile (configs/clusters/NAME.yaml); default: slurm.profile",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument(
        "-o", "--output", default="", help="write the script here instead of stdout"
    )
    parser.add_argument(
        "--no-preflight", action="store_true", help="skip the checks of data, run folder and task"
    )


def run(args: argparse.Namespace) -> int:
    # ConfigError (2) and LaunchError (6, with preflight failures) reach `hpctrain.cli.main`
    prep = prepare(args.config, args.overrides, args.profile)
    # before preflight or this verb creates them
    check_path(prep.cfg.run_dir, "run_dir")
    check_path(prep.cfg.slurm.folder, "slurm.folder")
    if not args.no_preflight:
        raise_if_failed(preflight(prep.cfg, prep.profile), "nothing written")
    log_dir = ""
    if "$" not in (prep.cfg.slurm.folder or prep.cfg.run_dir):
        log_dir = str(log_folder(prep.cfg))
    overrides = train_overrides(args.overrides)
    if prep.cfg.slurm.folder:
        # absolute in the run's config.yaml, where `hpctrain status` looks for the log
        overrides.append(f"slurm.folder={prep.cfg.slurm.folder}")
    script = render_sbatch(
        prep.job,
        config_path=str(Path(args.config).resolve()),
        overrides=overrides,
        run_dir=prep.cfg.run_dir,
        python=sys.executable,
        log_dir=log_dir,
        description=f"rendered by `hpctrain sbatch` from {Path(args.config).name}",
    )
    if args.output:
        try:
            Path(args.output).write_text(script)
        except OSError as exc:
            raise UsageError(f"-o {args.output}: cannot write: {exc.strerror or exc}") from None
        print(
            f"hpctrain sbatch: wrote {args.output}; submit with: sbatch {args.output}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(script)
    return 0
