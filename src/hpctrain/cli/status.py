"""`hpctrain status RUN_DIR`: job state, requeue count, last step and the log's tail."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hpctrain.errors import UsageError

HELP = "show the SLURM jobs of a run folder: state, requeues, every job, last error, last step, log tail"
EPILOG = """examples:
  hpctrain status runs/demo
  hpctrain status runs/demo --goodput          # where the allocated hours went
  hpctrain status runs/demo --goodput --json   # the same as one JSON object ("goodput")"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        help="run folder of a job started by `hpctrain submit` or an hpctrain sbatch script",
    )
    parser.add_argument("-n", "--lines", type=int, default=10, help="log lines to show")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="account for the run's allocated GPU-hours (CPU core-hours): queue wait, start-up, "
        "productive steps, data wait, checkpoints, evaluation, lost work, tail (also for a "
        "run without a SLURM job)",
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 running or completed, 1 failed/cancelled/timed out.

    No such folder is a usage error (2); a folder without a SLURM job (a local run) or with a
    damaged job record a launch error (6). With `--json` those are a JSON object too (stdout:
    what is known, `error` and `exit_code`; the usual line on stderr), with the same code.
    """
    from hpctrain.launch.profiles import LaunchError
    from hpctrain.launch.status import run_status
    from hpctrain.resilience.goodput_report import describe, run_goodput

    status = None
    try:
        if not Path(args.run_dir).is_dir():
            raise UsageError(f"{args.run_dir}: not a run folder")
        status = run_status(args.run_dir, num_lines=args.lines)
        if args.goodput and not status.job_id:  # a local run: its processes' hours
            return print_goodput(args)
        if not status.job_id:
            raise LaunchError(
                f"{args.run_dir}: no SLURM job recorded (RUN_DIR/slurm/job.json or job_id): a "
                f"local run? its steps and evaluations are in {args.run_dir}/metrics.jsonl, "
                f"and `hpctrain status {args.run_dir} --goodput` says where its hours went"
            )
    except (UsageError, LaunchError) as exc:
        if not args.json:
            raise
        known = dataclasses.asdict(status) if status is not None else {"run_dir": args.run_dir}
        print(json.dumps({**known, "error": str(exc), "exit_code": exc.exit_code}), flush=True)
        print(f"hpctrain status: {exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code
    goodput = run_goodput(args.run_dir) if args.goodput else None
    if args.json:
        extra = {"goodput": goodput.to_json()} if goodput is not None else {}
        print(json.dumps({**dataclasses.asdict(status), "failed": status.failed, **extra}))
    else:
        verdict = " (failed)" if status.failed else ""
        print(f"job:       {status.job_id}")
        print(f"state:     {status.state}{verdict}  exit code {status.exit_code or '-'}")
        print(f"requeues:  {status.requeues}")
        print(f"last step: {status.last_step if status.last_step is not None else '-'}")
        if status.jobs:
            print("jobs:      (every run: requeues and array tasks, from sacct)")
            for row in status.jobs:
                print(
                    f"  {row.job_id:<14} {row.state:<12} exit {row.exit_code or '-':<6} {row.start} .. {row.end}"
                )
        if status.attempts:
            print("attempts:  (restarts and requeues: RUN_DIR/slurm/attempts.jsonl)")
            for a in status.attempts:
                nodes = ",".join(a["nodes"]) or "-"
                print(
                    f"  {a['attempt']:>3}  job {a['job_id']:<10} {nodes:<14} {a['kind']:<11} "
                    f"{a['decision']:<8} {a['reason']}"
                )
        if status.stopped:
            print(status.stopped)
        if status.error_line:
            print(f"error:     {status.error_line}")
            print(f"           ({status.error_path})")
        if status.hangs_path:
            print(
                f"stacks:    {status.hangs_path}  (Python stacks of hung ranks; docs/checkpoints.md)"
            )
        if status.straggler_line:
            print(f"straggler: {status.straggler_line}")
        if status.log_tail:
            print(f"log:       {status.log_path}")
            for line in status.log_tail:
                print(f"  | {line}")
        if goodput is not None:
            print("\n".join(describe(goodput)))
    return 1 if status.failed else 0


def print_goodput(args: argparse.Namespace) -> int:
    from hpctrain.resilience.goodput_report import describe, run_goodput

    goodput = run_goodput(args.run_dir)
    if not goodput.rows:
        raise UsageError(
            f"{args.run_dir}: nothing to account: no SLURM job and no trainer records "
            "(RUN_DIR/timeline.jsonl)"
        )
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, "goodput": goodput.to_json()}))
    else:
        print("\n".join(describe(goodput)))
    return 0
