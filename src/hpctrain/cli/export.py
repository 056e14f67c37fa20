"""`hpctrain export RUN_DIR_OR_CHECKPOINT -o OUT [--format pt|safetensors|hf|peft]
[--checkpoint best] [--[no-]ema] [--tokenizer PATH]`."""

from __future__ import annotations

import argparse

from hpctrain.cli.options import (
    add_best_alias,
    add_checkpoint_option,
    add_lora_base_option,
    add_output_option,
    checkpoint_location,
)

HELP = (
    "write a checkpoint's model as consolidated weights (.pt or .safetensors; DDP or FSDP2) "
    "or a Hugging Face folder (--format hf); a LoRA run's adapters merged, or as a peft "
    "adapter (--format peft)"
)
EPILOG = """examples:
  hpctrain export runs/demo -o model.pt                     # newest checkpoint of the run
  hpctrain export runs/demo -o model.safetensors --checkpoint best  # the best by checkpoint.monitor
  hpctrain export runs/demo/checkpoints/step-400 -o model.pt  # one checkpoint
  hpctrain export runs/demo -o model-ema.safetensors --ema  # the EMA (train.ema_decay)
  hpctrain export runs/demo -o model.pt --no-ema            # the trained weights, always
  hpctrain export runs/lm -o hf-model --format hf           # a folder transformers loads
  hpctrain export runs/lora -o adapter --format peft        # a LoRA run's adapters for peft
  hpctrain export runs/lm -o hf-model --format hf --tokenizer moved/tokenizer.json
  hpctrain export runs/demo model.pt --best                 # older spellings: OUT word, --best
Load it with: model.load_state_dict(torch.load("model.pt", weights_only=True))
or: safetensors.torch.load_file("model.safetensors"); built-in models also get a model card,
OUT.json (model.safetensors.json). The weights are those the training evaluated with (the EMA
under train.ema_eval, as eval, predict and generate read them) unless --ema/--no-ema says."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="run folder, checkpoint folder, or one step-<N> checkpoint (path or URL)"
    )
    add_output_option(
        parser, "the file to write (--format hf, peft: a new folder)", positional="OUT"
    )
    parser.add_argument(
        "--format",
        choices=("pt", "safetensors", "hf", "peft"),
        default=None,
        help="file format (default: safetensors for a .safetensors name, else pt); hf: a "
        "Hugging Face model folder (causal_lm runs); peft: a LoRA run's adapter folder",
    )
    add_checkpoint_option(parser)
    add_best_alias(parser)
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="bytes|PATH",
        help="--format hf: the run's tokenizer file, where the one the checkpoint records has "
        "moved (it must be the same tokenizer: checked by sha256)",
    )
    add_lora_base_option(parser)
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the EMA of the weights (train.ema_decay) or, with --no-ema, the trained weights "
        "(default: those the run evaluated with, its train.ema_eval)",
    )


def merged_into(lora_base: str | None) -> str:
    """A LoRA run's line: which base the adapters were merged into."""
    if lora_base is None:
        return ""
    if lora_base == "full":
        return ", adapters merged into the base's own weights (--lora-base full)"
    return f", adapters merged into the base as the run held it {lora_base.removeprefix('run ')}"


def run(args: argparse.Namespace) -> int:
    from hpctrain.errors import UsageError
    from hpctrain.inference.export import export_hf, export_peft, export_weights

    if not args.out:
        raise UsageError("export needs the file to write: -o OUT")
    source, best = checkpoint_location(args.source, args.checkpoint)
    # CheckpointError: exit code 4
    if args.format == "peft":
        result = export_peft(source, args.out, best=best, ema=args.ema)
        print(
            f"exported {result.source} (step {result.step}{', EMA' if result.ema else ''}): "
            f"{result.num_tensors} adapter tensors -> {result.out} "
            "(peft.PeftModel.from_pretrained(base, OUT))"
        )
        if result.held in ("nf4", "bf16"):
            print(
                f"the run trained these adapters on its base held in {result.held}; peft adds "
                "them to the base you load (from its folder: what --lora-base full merges)"
            )
        return 0
    if args.format == "hf":
        result = export_hf(
            source,
            args.out,
            best=best,
            ema=args.ema,
            tokenizer_spec=args.tokenizer,
            lora_base=args.lora_base,
        )
        print(
            f"exported {result.source} (step {result.step}{', EMA' if result.ema else ''}"
            f"{merged_into(result.lora_base)}): {result.num_tensors} tensors -> {result.out} "
            "(transformers.AutoModelForCausalLM.from_pretrained)"
        )
        return 0
    if args.tokenizer:
        raise UsageError("--tokenizer: only for --format hf (a weights file holds no tokenizer)")
    result = export_weights(
        source, args.out, fmt=args.format, best=best, ema=args.ema, lora_base=args.lora_base
    )
    print(
        f"exported {result.source} (step {result.step}{', EMA' if result.ema else ''}"
        f"{merged_into(result.lora_base)}): {result.num_tensors} tensors, "
        f"{result.num_elements:,} values -> {result.out}"
    )
    if result.model_card is not None:
        print(f"model card (what rebuilds the model): {result.model_card}")
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """After Ctrl-C: an export is written under a temporary name and renamed into place."""
    if not args.out:
        return ""
    return f"nothing half-written at {args.out}: run the same command again"
