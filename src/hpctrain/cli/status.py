"""`hpctrain status RUN_DIR`: job state, requeue count, last step and the log's tail."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hpctrain.launch.status import run_status

HELP = "show the SLURM job of a run folder: state, requeues, last step, log tail"
EPILOG = "example: hpctrain status runs/demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        help="run folder of a job started by `hpctrain submit` or an hpctrain sbatch script",
    )
    parser.add_argument("-n", "--lines", type=int, default=10, help="log lines to show")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 running or completed, 1 failed/cancelled/timed out, 3 no job found."""
    status = run_status(args.run_dir, num_lines=args.lines)
    if args.json:
        print(json.dumps({**dataclasses.asdict(status), "failed": status.failed}))
    elif not status.job_id:
        print(f"{args.run_dir}: no SLURM job recorded (RUN_DIR/slurm/job.json or job_id)")
    else:
        verdict = " (failed)" if status.failed else ""
        print(f"job:       {status.job_id}")
        print(f"state:     {status.state}{verdict}  exit code {status.exit_code or '-'}")
        print(f"requeues:  {status.requeues}")
        print(f"last step: {status.last_step if status.last_step is not None else '-'}")
        if status.log_tail:
            print(f"log:       {status.log_path}")
            for line in status.log_tail:
                print(f"  | {line}")
    if not status.job_id:
        return 3
    return 1 if status.failed else 0
