"""`hpctrain submit CONFIG [overrides] [--profile P] [--dry-run] [--sweep KEY=V1,V2]`."""

from __future__ import annotations

import argparse
import sys

from hpctrain.cli.eval import add_harness_arguments, add_tokenizer_argument, answer_fields
from hpctrain.cli.options import add_checkpoint_option, add_output_option
from hpctrain.cli.sbatch import (
    add_profile_arguments,
    add_sweep_arguments,
    check_max_parallel,
    print_job_notes,
)
from hpctrain.errors import UsageError

HELP = "submit a training job to SLURM with submitit (requeued on time limit or preemption)"
EPILOG = """examples:
  hpctrain submit configs/demo.yaml --profile jean-zay-h100 slurm.account=abc@h100 slurm.nodes=2
  hpctrain submit configs/demo.yaml --profile local-dev --dry-run
  hpctrain submit configs/demo.yaml --profile local-dev --sweep train.lr=0.001,0.003 --max-parallel 1
  hpctrain status runs/demo
  hpctrain submit runs/demo --eval --checkpoint best --profile local-dev   # evaluate on SLURM
  hpctrain submit runs/sft --eval --harness mytask --harness-include tasks/ --profile local-dev
  hpctrain submit runs/demo --predict --data data/demo/shards/val --out preds/ --profile local-dev"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="print and check the sbatch script; submit nothing"
    )
    add_sweep_arguments(parser)
    parser.add_argument(
        "--eval", action="store_true", help="submit `hpctrain eval` of the run (CONFIG|RUN_DIR)"
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="submit `hpctrain predict` of the run (--data, --out)",
    )
    add_checkpoint_option(
        parser, help="--eval/--predict: the checkpoint: latest (default), best or a folder"
    )
    parser.add_argument(
        "--data", default="", help="--predict: the data (default data.val); --eval: a JSONL file"
    )
    add_output_option(parser, "--eval: record file; --predict: destination")
    parser.add_argument(
        "--format", choices=("jsonl", "shards"), default="jsonl", help="--predict: output format"
    )
    for field in ("prompt", "response", "messages"):
        parser.add_argument(
            f"--{field}-field", default="", help=f"--eval --data FILE.jsonl: the {field} field"
        )
    add_harness_arguments(parser)
    add_tokenizer_argument(parser)


def run_inference(args: argparse.Namespace) -> int:
    """`submit --eval/--predict`: one job whose tasks are the ranks of `hpctrain eval/predict`."""
    from hpctrain.launch.preflight import preflight, raise_if_failed
    from hpctrain.launch.prepare import for_submitit, prepare_target, slurm_folder
    from hpctrain.launch.submit import InferenceSpec, submission_script, submit_inference

    if args.eval and args.predict:
        raise UsageError("--eval and --predict: choose one")
    if args.sweep:
        raise UsageError("--sweep trains several runs; it does not combine with --eval/--predict")
    if args.predict and not args.out:
        raise UsageError("--predict needs --out: a folder or fsspec URL for the predictions")
    if args.predict and args.data:
        from hpctrain.inference.inputs import refuse_image_folder

        refuse_image_folder(args.data, "each task of the job would convert it")
    prep, named = prepare_target(args.config, args.overrides, args.profile)
    prep = for_submitit(prep, strict=not args.dry_run)
    cfg = prep.cfg
    if args.harness and not args.eval:
        raise UsageError("--harness goes with --eval")
    if args.eval and args.data:
        answer_fields(args)  # the record format is named
    spec = InferenceSpec(
        verb="eval" if args.eval else "predict",
        checkpoint=named or args.checkpoint,
        data=args.data,
        out=args.out,
        fmt=args.format,
        prompt_field=args.prompt_field,
        response_field=args.response_field,
        messages_field=args.messages_field,
        harness=args.harness,
        harness_include=args.harness_include,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        tokenizer=args.tokenizer,
        after=training_job(cfg.run_dir) if args.eval else "",
    )
    if not args.no_preflight:
        raise_if_failed(
            preflight(prep.cfg, prep.profile), "nothing submitted", off_cluster=off_cluster(args)
        )
    if args.dry_run:
        print_job_notes("submit", prep)
        sys.stdout.write(submission_script(prep.job, slurm_folder(prep.cfg) / "submitit"))
        return 0
    sub = submit_inference(prep.cfg, prep.job, spec)
    print_job_notes("submit", prep)
    print(f"job {sub.job_id} ({spec.verb})")
    if spec.after:
        print(f"  after:      training job {spec.after} (starts once it has ended well)")
    print(f"  log:        {sub.stderr}")
    print(f"  stdout:     {sub.stdout}")
    return 0


def off_cluster(args: argparse.Namespace) -> str:
    """What to do when preflight finds this is not a login node of the job's cluster."""
    if args.dry_run:
        return "off the cluster, --no-preflight prints the script anyway"
    return "submit from a login node; off the cluster, --dry-run --no-preflight prints the script"


def training_job(run_dir: str) -> str:
    """The run's training job id while SLURM still has it queued or running ("" otherwise):
    an evaluation submitted meanwhile waits for it (`--dependency=afterok`)."""
    from pathlib import Path

    from hpctrain.launch.status import query_state
    from hpctrain.resilience.job_records import read_job_record

    job_id = read_job_record(Path(run_dir)).get("job_id", "")
    if not job_id:
        return ""
    state, _, _ = query_state(job_id)
    return job_id if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "SUSPENDED") else ""


def run(args: argparse.Namespace) -> int:
    if args.eval or args.predict:
        return run_inference(args)
    # here, not at the top: `hpctrain --help` should not import submitit (hpctrain.cli.main)
    from hpctrain.launch.preflight import format_checks, preflight, raise_if_failed
    from hpctrain.launch.prepare import for_submitit, prepare, slurm_folder
    from hpctrain.launch.submit import check_submission, parse_sweep, submission_script, submit

    # ConfigError (2) and LaunchError (6, with preflight failures) reach `hpctrain.cli.main`
    prep = for_submitit(prepare(args.config, args.overrides, args.profile), strict=not args.dry_run)
    combos = parse_sweep(args.sweep)
    check_max_parallel(args.max_parallel, len(combos))
    check_submission(prep.cfg, prep.job)
    if not args.no_preflight:
        checks = preflight(prep.cfg, prep.profile)
        if args.dry_run:
            print(format_checks(checks), file=sys.stderr)
        raise_if_failed(checks, "nothing submitted", off_cluster=off_cluster(args))
    if args.dry_run:
        print_job_notes("submit", prep, len(combos))
        folder = slurm_folder(prep.cfg) / "submitit"
        script = submission_script(
            prep.job, folder, num_tasks=len(combos), max_parallel=args.max_parallel, training=True
        )
        sys.stdout.write(script)
        return 0
    for sub in submit(prep.cfg, prep.job, sweep=args.sweep, max_parallel=args.max_parallel):
        print(f"job {sub.job_id}")
        print(f"  run folder: {sub.run_dir}")
        print(f"  log:        {sub.stderr}")
        print(f"  stdout:     {sub.stdout}")
        print(f"  status:     hpctrain status {sub.run_dir}")
    print_job_notes("submit", prep, len(combos))
    return 0
