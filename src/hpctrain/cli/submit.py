"""`hpctrain submit CONFIG [overrides] [--profile P] [--dry-run] [--sweep KEY=V1,V2]`."""

from __future__ import annotations

import argparse
import sys

from hpctrain.cli.sbatch import add_profile_arguments, add_sweep_arguments, check_max_parallel
from hpctrain.launch.preflight import format_checks, preflight, raise_if_failed
from hpctrain.launch.prepare import prepare, slurm_folder
from hpctrain.launch.submit import (
    check_submission,
    parse_sweep,
    submission_script,
    submit,
)

HELP = "submit a training job to SLURM with submitit (requeued on time limit or preemption)"
EPILOG = """examples:
  hpctrain submit configs/demo.yaml --profile jean-zay-h100 slurm.account=abc@h100 slurm.nodes=2
  hpctrain submit configs/demo.yaml --profile local-dev --dry-run
  hpctrain submit configs/demo.yaml --profile local-dev --sweep train.lr=0.001,0.003 --max-parallel 1
  hpctrain status runs/demo"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="print and check the sbatch script; submit nothing"
    )
    add_sweep_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # ConfigError (2) and LaunchError (6, with preflight failures) reach `hpctrain.cli.main`
    prep = prepare(args.config, args.overrides, args.profile)
    combos = parse_sweep(args.sweep)
    check_max_parallel(args.max_parallel, len(combos))
    check_submission(prep.cfg, prep.job)
    if not args.no_preflight:
        checks = preflight(prep.cfg, prep.profile)
        if args.dry_run:
            print(format_checks(checks), file=sys.stderr)
        raise_if_failed(checks, "nothing submitted")
    if args.dry_run:
        folder = slurm_folder(prep.cfg) / "submitit"
        script = submission_script(
            prep.job, folder, num_tasks=len(combos), max_parallel=args.max_parallel
        )
        sys.stdout.write(script)
        return 0
    for sub in submit(prep.cfg, prep.job, sweep=args.sweep, max_parallel=args.max_parallel):
        print(f"job {sub.job_id}")
        print(f"  run folder: {sub.run_dir}")
        print(f"  log:        {sub.stderr}")
        print(f"  stdout:     {sub.stdout}")
        print(f"  status:     hpctrain status {sub.run_dir}")
    return 0
