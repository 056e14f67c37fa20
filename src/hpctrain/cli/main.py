"""Entry point of the `hpctrain` command.

Each verb is a module `hpctrain.cli.<verb>` with `HELP` (one line), `EPILOG` (an example),
`add_arguments(parser)` and `run(args) -> int`. Verbs listed here all work.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hpctrain import __version__
from hpctrain.config import ConfigError

# Order is the order shown in `hpctrain --help`.
VERBS = [
    "train",
    "config",
    "plot",
    "export",
    "convert",
    "inspect",
    "plan",
    "submit",
    "sbatch",
    "preflight",
    "status",
    "bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Train PyTorch models on SLURM clusters from WebDataset shards.",
        epilog="example: hpctrain train configs/demo.yaml train.max_steps=100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for name in VERBS:
        module = importlib.import_module(f"hpctrain.cli.{name.replace('-', '_')}")
        sub = verbs.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except ConfigError as exc:
        print(f"hpctrain {args.verb}: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
