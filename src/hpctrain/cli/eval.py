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
trained weights); the record says which ("weights": "ema" or "model").
  hpctrain eval runs/sft --data qa.jsonl --prompt-field prompt --response-field response
  hpctrain eval runs/sft --harness mytask --harness-include tasks/ --num-fewshot 0
--data answers each record's prompt greedily and scores it (eval.max_new_tokens,
eval.normalize); the predictions go to a .predictions.jsonl beside the record. --harness runs
lm-evaluation-harness offline on the run's model: RUN_DIR/eval/harness-<tasks>-step-<N>.json."""


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
    add_tokenizer_argument(parser)
    add_answer_arguments(parser)
    add_harness_arguments(parser)


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    """`--tokenizer bytes|PATH`, as `generate` and `export` take it (also `submit --eval`)."""
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="bytes|PATH",
        help="the run's tokenizer file, where the one the checkpoint records has moved (it "
        "must be the same tokenizer: checked by sha256); for --data, --harness, eval.generate",
    )


def add_answer_arguments(parser: argparse.ArgumentParser) -> None:
    """`--data FILE.jsonl` and its fields: questions answered and scored (causal_lm)."""
    group = parser.add_argument_group("answers to a JSONL file (causal_lm; eval.* keys apply)")
    group.add_argument(
        "--data", default="", help="a JSONL file of questions: answer them and score the answers"
    )
    group.add_argument("--prompt-field", default="", help="--data: the field of the prompt")
    group.add_argument("--response-field", default="", help="--data: the reference answer's")
    group.add_argument(
        "--messages-field", default="", help="--data: a chat's field (the tokenizer's template)"
    )


def add_harness_arguments(parser: argparse.ArgumentParser) -> None:
    """`--harness TASKS` and its options: lm-evaluation-harness on the run's model."""
    group = parser.add_argument_group(
        "lm-evaluation-harness (pip install -e '.[eval]'; offline, one process)"
    )
    group.add_argument("--harness", default="", metavar="TASK[,TASK...]", help="harness tasks")
    group.add_argument(
        "--harness-include", default="", metavar="DIR", help="a folder of task YAML files"
    )
    group.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples per prompt"
    )
    group.add_argument(
        "--limit", type=float, default=None, metavar="N", help="at most N examples per task"
    )


def answer_fields(args: argparse.Namespace) -> dict[str, str]:
    """The record format `--data` names (as `hpctrain convert` takes it)."""
    fields = {
        "prompt_field": args.prompt_field,
        "response_field": args.response_field,
        "messages_field": args.messages_field,
    }
    if not (args.messages_field or (args.prompt_field and args.response_field)):
        raise UsageError(
            f"--data {args.data}: give --prompt-field and --response-field (or --messages-field)"
        )
    return fields


def forwarded_options(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each option the ranks need again."""
    words: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value:
            words += [f"--{name.replace('_', '-')}", str(value)]
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
    if args.harness:
        if args.data or args.nproc > 1:
            raise UsageError("--harness runs in one process, alone: drop --data and --nproc")
        from hpctrain.inference.harness import run_harness

        return run_harness(
            cfg,
            tasks=args.harness,
            checkpoint=checkpoint,
            include=args.harness_include,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            out=args.out,
            tokenizer_spec=args.tokenizer,
        )
    fields = answer_fields(args) if args.data else {}
    if args.nproc > 1:
        names = (
            "checkpoint",
            "out",
            "data",
            "prompt_field",
            "response_field",
            "messages_field",
            "tokenizer",
        )
        forwarded = [args.source, *args.overrides, *forwarded_options(args, names)]
        return run_local(forwarded, args.nproc, verb="eval")
    if args.data:
        from hpctrain.inference.answers import run_answers

        return run_answers(
            cfg,
            data=args.data,
            fields=fields,
            checkpoint=checkpoint,
            out=args.out,
            tokenizer_spec=args.tokenizer,
        )
    from hpctrain.inference.evaluate import run_eval

    return run_eval(cfg, checkpoint=checkpoint, out=args.out, tokenizer_spec=args.tokenizer)


def interrupted(args: argparse.Namespace) -> str:
    """After Ctrl-C: the evaluation record is written whole, at the end."""
    return "nothing written: run the same command again"
