"""`hpctrain generate RUN_DIR|CHECKPOINT --prompt TEXT [--max-new-tokens N ...]`."""

from __future__ import annotations

import argparse

from hpctrain.cli.options import add_checkpoint_option, add_lora_base_option, checkpoint_location

HELP = "print a causal_lm checkpoint's continuation of a prompt (CPU or one GPU)"
EPILOG = """examples:
  hpctrain generate runs/demo-lm --prompt "def main("                      # greedy
  hpctrain generate runs/demo-lm --prompt "import " --temperature 0.8 --top-k 40 --seed 1
  hpctrain generate runs/demo-lm/checkpoints/step-400 --prompt "class " --max-new-tokens 50"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="run folder, checkpoint folder, or one step-<N> checkpoint (path or URL)"
    )
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to add at most (default 200)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 (default): greedy, the same text every time",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the K likeliest tokens only; 0: all"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    add_checkpoint_option(parser)
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the EMA of the weights (train.ema_decay) or, with --no-ema, the trained weights "
        "(default: those the run evaluated with, its train.ema_eval)",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="bytes or a tokenizer file (default: the run's data.tokenizer, else its index's)",
    )
    add_lora_base_option(parser)
    parser.add_argument(
        "--device",
        default="",
        help="cpu, cuda or cuda:N (default: the first GPU if there is one, else cpu)",
    )


def run(args: argparse.Namespace) -> int:
    from hpctrain.inference.generate import generate_text

    # CheckpointError (exit 4) for a missing or non-LM checkpoint; UsageError for bad options
    source, best = checkpoint_location(args.source, args.checkpoint)
    text = generate_text(
        source,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        best=best,
        device=args.device,
        tokenizer_spec=args.tokenizer,
        ema=args.ema,
        lora_base=args.lora_base,
    )
    print(text, flush=True)
    return 0
