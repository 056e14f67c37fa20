"""`hpctrain preflight CONFIG [overrides] [--profile P]`: check a job before queueing it."""

from __future__ import annotations

import argparse

from hpctrain.cli.sbatch import add_profile_arguments

HELP = "check a job before queueing: profile limits, data reachable, run folder, task, offline"
EPILOG = "example: hpctrain preflight configs/demo.yaml --profile jean-zay-v100 slurm.time=30:00:00"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument("--no-data", action="store_true", help="do not open the index and shards")


def run(args: argparse.Namespace) -> int:
    from hpctrain.launch.preflight import format_checks, preflight, raise_if_failed
    from hpctrain.launch.prepare import prepare

    prep = prepare(args.config, args.overrides, args.profile)
    checks = preflight(prep.cfg, prep.profile, data=not args.no_data)
    print(format_checks(checks))
    raise_if_failed(
        checks, off_cluster="off the cluster, sbatch --no-preflight renders the script anyway"
    )
    return 0
