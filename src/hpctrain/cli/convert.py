"""`hpctrain convert SRC DEST`: image folder / manifest / shards -> tar shards + index.json."""

from __future__ import annotations

import argparse

from hpctrain.convert.layout import parse_size
from hpctrain.convert.run import ConvertOptions, convert, result_summary

HELP = "convert an image folder, a CSV/JSONL manifest or shards into WebDataset shards + index.json"
EPILOG = """\
examples:
  hpctrain convert data/images data/shards --val-fraction 0.1 --shuffle --seed 0
  hpctrain convert manifest.csv s3://bucket/shards --shard-size 512MB --workers 8
  hpctrain convert old-shards/ data/small --max-side 256 --quality 90 --resume

SRC is a folder SRC/<class>/<image> (classes sorted -> labels), a .csv/.jsonl manifest (path,
label and extra fields), or shards (a folder with index.json or .tar files, a brace pattern).
DEST is a folder or an fsspec URL (s3://..., memory://...). Output is identical for any
--workers; the index is written last, so a killed run leaves no index (finish it with --resume).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", help="image folder, manifest (.csv/.jsonl) or shards (folder, pattern, index.json)"
    )
    parser.add_argument("dest", help="output folder or fsspec URL")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--samples-per-shard", type=int, metavar="N", help="samples in each shard")
    size.add_argument(
        "--shard-size", metavar="SIZE", help="target shard size, e.g. 512MB, 1GB (default 256MB)"
    )
    parser.add_argument(
        "--shuffle", action="store_true", help="shuffle sample order across shards (by --seed)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for --shuffle and --val-fraction (default 0)"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="put a stratified fraction F of each class in DEST/val, the rest in DEST/train",
    )
    parser.add_argument(
        "--max-side",
        type=int,
        metavar="PX",
        help="downscale images larger than PX (re-encoded as JPEG)",
    )
    parser.add_argument(
        "--quality", type=int, metavar="Q", help="re-encode every image as JPEG at quality Q"
    )
    parser.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="unreadable or non-image sample: stop (default) or skip and list it in DEST/skipped.txt",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="K",
        help="parallel writer processes (output identical for any K)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted conversion after its last complete shard",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace shards and index already in DEST"
    )
    parser.add_argument(
        "--prefix", default="shard", help="shard name prefix without --val-fraction (default shard)"
    )
    parser.add_argument(
        "--source",
        dest="source_kind",
        choices=["auto", "folder", "manifest", "shards"],
        default="auto",
        help="source kind (default: guessed)",
    )
    parser.add_argument(
        "--path-column",
        default="path",
        help="manifest column with the image path/URL (default path)",
    )
    parser.add_argument(
        "--label-column", default="label", help="manifest column with the label (default label)"
    )
    parser.add_argument(
        "--progress",
        choices=["auto", "bar", "plain", "none"],
        default="auto",
        help="progress bar in a terminal, periodic lines otherwise (default auto)",
    )


def run(args: argparse.Namespace) -> int:
    options = ConvertOptions(
        src=args.src,
        dest=args.dest,
        source_kind=args.source_kind,
        samples_per_shard=args.samples_per_shard,
        shard_size=parse_size(args.shard_size) if args.shard_size else None,
        shuffle=args.shuffle,
        seed=args.seed,
        val_fraction=args.val_fraction,
        max_side=args.max_side,
        quality=args.quality,
        on_error=args.on_error,
        prefix=args.prefix,
        path_column=args.path_column,
        label_column=args.label_column,
        workers=args.workers,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=args.progress,
    )
    print(result_summary(convert(options)))  # ConvertError/ShardIndexError: data errors (3)
    return 0
