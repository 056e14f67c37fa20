"""`hpctrain inspect DEST [--verify] [--json]`: describe and check shards."""

from __future__ import annotations

import argparse
import json
import sys

from hpctrain.errors import EXIT_DATA

HELP = "show totals, shards, classes and keys of a shard set; --verify decodes every field"
EPILOG = """\
examples:
  hpctrain inspect data/shards                 # train/ and val/ when convert used --val-fraction
  hpctrain inspect s3://bucket/shards/index.json --verify --json
  hpctrain inspect 'old/shard-{000000..000009}.tar' --verify

Reads every shard once with the loader's tar parser, checking the tar structure and, with an
index, each shard's size, sample count and sha256; --verify decodes every field with the
loader's decoders (images, masks, cls, json, txt, npy, ...) and, when the index names the
classes, flags labels outside them. Exit code 3 (a data error) when anything is wrong; every
problem names its shard and sample.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dest",
        help="index.json, a folder holding one (or train/ and val/), a .tar folder, a brace pattern",
    )
    parser.add_argument(
        "--verify", action="store_true", help="also decode every field as the loader does"
    )
    parser.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="--verify: images above N pixels are decompression bombs (default: the loader's)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (a list for train/ + val/)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="K", help="read shards in K processes (default 1)"
    )
    parser.add_argument(
        "--keys", type=int, default=5, metavar="N", help="sample keys to show (default 5)"
    )


def run(args: argparse.Namespace) -> int:
    from hpctrain.convert.verify import format_report, inspect_dataset

    # nothing to inspect (no index, no shards): a DataError, one line and exit code 3
    reports = inspect_dataset(
        args.dest,
        verify=args.verify,
        num_keys=args.keys,
        workers=args.workers,
        max_pixels=args.max_pixels,
    )
    if args.json:
        data = [r.to_json() for r in reports]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=1))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    problems = sum(len(r.errors) for r in reports)
    if problems:
        print(f"hpctrain inspect: data error: {problems} problem(s), listed above", file=sys.stderr)
        return EXIT_DATA
    return 0
