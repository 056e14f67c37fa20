"""`hpctrain config show CONFIG [overrides]`: print the resolved config."""

from __future__ import annotations

import argparse

from hpctrain.config import config_to_yaml, load_config

HELP = "print the resolved config (file + overrides) as YAML"
EPILOG = "example: hpctrain config show configs/demo.yaml train.max_steps=7"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show"], help="what to do with the config")
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. data.batch_size=32",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(config_to_yaml(cfg), end="")
    return 0
