"""`hpctrain index compact INDEX...`: derive the compact form of existing indexes."""

from __future__ import annotations

import argparse

HELP = "derive index.compact beside an index.json (read once per node by large jobs)"
EPILOG = """\
examples:
  hpctrain index compact data/shards/index.json
  hpctrain index compact data/shards/train data/shards/val
  hpctrain index compact s3://bucket/corpus/index.json

Writes NAME.compact beside NAME.json: the same shards as fixed-width columns, URLs stored once
as a pattern plus exceptions, and the sha256 of the JSON it came from. `hpctrain convert`
writes it itself; run this for an index made another way or changed since. A job's ranks read
it instead of the JSON (docs/data.md, "The compact index").
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    compact = actions.add_parser(
        "compact", help="write NAME.compact beside each NAME.json", description=HELP
    )
    compact.add_argument(
        "indexes", nargs="+", metavar="INDEX", help="an index.json, or a folder holding one"
    )


def run(args: argparse.Namespace) -> int:
    from hpctrain.data.index import INDEX_NAME, redact_url
    from hpctrain.data.node_index import write_companion

    for spec in args.indexes:
        url = spec if spec.endswith(".json") else f"{spec.rstrip('/')}/{INDEX_NAME}"
        done = write_companion(url)  # ShardIndexError: a data error (3), naming the index
        print(
            f"{redact_url(done.url)}: {done.num_shards} shards, {done.num_runs} URL run(s), "
            f"{done.num_bytes / 1e6:.1f} MB (index.json: {done.json_bytes / 1e6:.1f} MB)"
        )
    return 0
