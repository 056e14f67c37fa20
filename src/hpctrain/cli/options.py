"""The options every verb spells the same way: which checkpoint, and where the output goes.

One vocabulary across verbs (docs/inference.md#one-vocabulary):

- `--checkpoint PATH|latest|best` chooses a checkpoint (`eval`, `predict`, `generate`, `export`,
  `submit --eval/--predict`); `train --checkpoint PATH|latest|none` the one to resume from.
- `-o/--out` names what a verb writes (`export`, `eval`, `predict`, `convert`, `sbatch`,
  `submit --eval/--predict`).

The older spellings stay as aliases: `export --best` (`--checkpoint best`), `train --resume`,
`sbatch --output`; the positional OUT of `export` and DEST of `convert` are as good as `-o`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

LATEST, BEST = "latest", "best"


def add_checkpoint_option(
    parser: argparse.ArgumentParser,
    *,
    keywords: Sequence[str] = (LATEST, BEST),
    default: str | None = LATEST,
    aliases: Sequence[str] = (),
    help: str = "",
) -> None:
    """`--checkpoint PATH|latest|best` (and `aliases`, the verb's older spellings)."""
    metavar = "|".join(["PATH", *keywords])
    described = help or (
        f"the checkpoint: {LATEST} (the newest committed one, default), {BEST} (the one "
        "checkpoint.keep_best names) or a checkpoint folder"
    )
    if aliases:
        described += f" ({', '.join(aliases)}: the same, an older spelling)"
    parser.add_argument(
        "--checkpoint",
        *aliases,
        dest="checkpoint",
        default=default,
        metavar=metavar,
        help=described,
    )


def add_best_alias(parser: argparse.ArgumentParser) -> None:
    """`--best`: the older spelling of `--checkpoint best` (`export`)."""
    parser.add_argument(
        "--best",
        dest="checkpoint",
        action="store_const",
        const=BEST,
        help="the same as --checkpoint best (an older spelling)",
    )


def add_lora_base_option(parser: argparse.ArgumentParser) -> None:
    """`--lora-base run|full`: which base a LoRA run's adapters are merged into (`export`,
    `generate`; `eval` and `predict` take `eval.lora_base`)."""
    parser.add_argument(
        "--lora-base",
        choices=("run", "full"),
        default="run",
        help="a LoRA run: merge its adapters into the base as the run held it and evaluated "
        "with it (run, default: QLoRA's NF4 copy, a bf16 model.lora.base_dtype) or into the "
        "base's own full-precision weights (full)",
    )


def checkpoint_location(source: str, checkpoint: str) -> tuple[str, bool]:
    """(where to look, whether to take `best` there) for SOURCE and `--checkpoint`.

    `latest` and `best` choose among SOURCE's checkpoints (a run folder or a checkpoint
    folder); a path names the checkpoint itself.
    """
    if checkpoint in ("", LATEST):
        return source, False
    if checkpoint == BEST:
        return source, True
    return checkpoint, False


class _OneOutput(argparse.Action):
    """Stores the output; the option and the older positional word may not name two."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, "")
        if given and values and given != values:
            parser.error(f"two outputs: {given} and {values}; give one (-o/--out)")
        if values or not given:
            setattr(namespace, self.dest, values)


def add_output_option(
    parser: argparse.ArgumentParser,
    help: str,
    *,
    dest: str = "out",
    aliases: Sequence[str] = (),
    positional: str = "",
    metavar: str = "OUT",
) -> None:
    """`-o/--out` (and `aliases`); with `positional`, the positional word too (the docs write
    `convert SRC DEST`; both spellings stay).

    The value lands in `args.<dest>` ("" when none was given: a verb that needs one says so).
    """
    if positional:
        parser.add_argument(
            dest,
            nargs="?",
            default=argparse.SUPPRESS,  # absent: leaves -o's value alone
            action=_OneOutput,
            metavar=positional,
            help=f"{help} (or -o {positional}: the same)",
        )
    old = f" ({', '.join(aliases)}: the same, an older spelling)" if aliases else ""
    parser.add_argument(
        "-o",
        "--out",
        *aliases,
        dest=dest,
        default="",
        action=_OneOutput,
        metavar=metavar,
        help=help + old,
    )
