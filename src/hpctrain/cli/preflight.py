"""`hpctrain preflight CONFIG [overrides] [--profile P]`: check a job before queueing it."""

from __future__ import annotations

import argparse
import sys

from hpctrain.cli.sbatch import add_profile_arguments
from hpctrain.launch.preflight import failed, format_checks, preflight
from hpctrain.launch.prepare import prepare
from hpctrain.launch.profiles import LaunchError

HELP = "check a job before queueing: profile limits, data reachable, run folder, task, offline"
EPILOG = "example: hpctrain preflight configs/demo.yaml --profile jean-zay-v100 slurm.time=30:00:00"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--no-data", action="store_true", help="do not open the index and shards")


def run(args: argparse.Namespace) -> int:
    try:
        prep = prepare(args.config, args.overrides, args.profile)
    except LaunchError as exc:
        print(f"hpctrain preflight: {exc}", file=sys.stderr)
        return 2
    checks = preflight(prep.cfg, prep.profile, data=not args.no_data)
    print(format_checks(checks))
    return 2 if failed(checks) else 0
