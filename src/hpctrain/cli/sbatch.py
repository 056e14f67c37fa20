"""`hpctrain sbatch CONFIG [overrides] [--profile P]`: print a job script for plain `sbatch`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.cli.options import add_output_option
from hpctrain.errors import UsageError

if TYPE_CHECKING:
    from hpctrain.launch.prepare import Prepared

HELP = "print an sbatch script (one task per GPU, requeue on preemption) for a config"
EPILOG = """examples:
  hpctrain sbatch configs/demo.yaml --profile jean-zay-a100 slurm.account=abc@a100 > job.sbatch
  hpctrain sbatch configs/demo.yaml --profile local-dev --sweep train.lr=1e-3,3e-3 --max-parallel 1 -o sweep.sbatch
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


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """--sweep, --max-parallel and --no-preflight: shared by `sbatch` and `submit`."""
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a job array over these values (repeat for a grid); one run folder each",
    )
    parser.add_argument(
        "--max-parallel",
        type=int,
        default=0,
        metavar="N",
        help="with --sweep: at most N array tasks run at once (SLURM's --array=...%%N)",
    )
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the checks of data, run folder, task and the job's environment",
    )


def print_job_notes(verb: str, prep: Prepared, num_points: int = 1) -> None:
    """On stderr: where the run will live, and a warning for an empty account the site wants."""
    from hpctrain.launch.prepare import describe_run_dir
    from hpctrain.launch.profiles import account_warning

    warning = account_warning(prep.job, prep.profile)
    if warning:
        print(f"hpctrain {verb}: warning: {warning}", file=sys.stderr)
    if prep.job.spare_reason:
        print(f"hpctrain {verb}: {prep.job.spare_reason}", file=sys.stderr)
    print(f"hpctrain {verb}: {describe_run_dir(prep, num_points)}", file=sys.stderr)


def check_max_parallel(max_parallel: int, num_points: int) -> None:
    """--max-parallel needs a sweep (a job array) and a positive N."""
    if max_parallel < 0:
        raise UsageError(f"--max-parallel {max_parallel}: must be 1 or more")
    if max_parallel and num_points < 2:
        raise UsageError("--max-parallel applies to a job array: add --sweep KEY=V1,V2,...")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    add_output_option(
        parser,
        "write the script here instead of stdout",
        dest="output",
        aliases=("--output",),
        metavar="FILE",
    )
    add_sweep_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `hpctrain --help` should not import submitit (hpctrain.cli.main)
    from hpctrain.launch.preflight import preflight, raise_if_failed
    from hpctrain.launch.prepare import prepare, train_overrides
    from hpctrain.launch.sbatch import SweepPoint, render_sbatch
    from hpctrain.launch.script_values import check_path
    from hpctrain.launch.submit import log_folder, parse_sweep, sweep_run_dir

    # ConfigError (2) and LaunchError (6, with preflight failures) reach `hpctrain.cli.main`
    prep = prepare(args.config, args.overrides, args.profile)
    combos = parse_sweep(args.sweep)
    check_max_parallel(args.max_parallel, len(combos))
    # before preflight or this verb creates them
    check_path(prep.cfg.run_dir, "run_dir")
    check_path(prep.cfg.slurm.folder, "slurm.folder")
    if not args.no_preflight:
        raise_if_failed(
            preflight(prep.cfg, prep.profile),
            "nothing written",
            off_cluster="off the cluster, --no-preflight renders the script anyway",
        )
    log_dir = ""
    if "$" not in (prep.cfg.slurm.folder or prep.cfg.run_dir):
        log_dir = str(log_folder(prep.cfg))
    overrides = train_overrides(args.overrides)
    if prep.cfg.slurm.folder:
        # absolute in the run's config.yaml, where `hpctrain status` looks for the log
        overrides.append(f"slurm.folder={prep.cfg.slurm.folder}")
    sweep = []
    if len(combos) > 1:
        # every point's config.yaml names the shared log folder, where `status` finds its log
        extra = [] if prep.cfg.slurm.folder or not log_dir else [f"slurm.folder={log_dir}"]
        sweep = [
            SweepPoint(tuple([*combo, *extra]), sweep_run_dir(prep.cfg.run_dir, combo))
            for combo in combos
        ]
    script = render_sbatch(
        prep.job,
        config_path=str(Path(args.config).resolve()),
        overrides=overrides,
        run_dir=prep.cfg.run_dir,
        python=sys.executable,
        log_dir=log_dir,
        description=f"rendered by `hpctrain sbatch` from {Path(args.config).name}",
        sweep=sweep,
        max_parallel=args.max_parallel,
    )
    if args.output:
        try:
            Path(args.output).write_text(script)
        except OSError as exc:
            raise UsageError(f"-o {args.output}: cannot write: {exc.strerror or exc}") from None
    print_job_notes("sbatch", prep, len(combos))
    if args.output:
        print(
            f"hpctrain sbatch: wrote {args.output}; submit with: sbatch {args.output}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(script)
    return 0
