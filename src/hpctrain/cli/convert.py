"""`hpctrain convert SRC -o DEST` (or `SRC DEST`): image folder / manifest / Python / Arrow / shards -> tar shards + index.json."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from hpctrain.cli.options import add_output_option
from hpctrain.convert.errors import ConvertOptionError

if TYPE_CHECKING:
    from hpctrain.convert.options import ConvertOptions

PART_STAGES = ("tokenize", "list", "write")

HELP = (
    "convert an image folder, a CSV/JSONL manifest, a Python dataset, Arrow/parquet or shards "
    "into WebDataset shards + index.json"
)
EPILOG = """\
examples:
  hpctrain convert data/images data/shards --val-fraction 0.1 --shuffle --seed 0
  hpctrain convert new-images/ -o data/new --source images   # unlabelled: for predict
  hpctrain convert manifest.csv s3://bucket/shards --shard-size 512MB --workers 8
  hpctrain convert old-shards/ data/small --max-side 256 --quality 90 --resume
  hpctrain convert mypkg.data:make_dataset data/shards --arg split=train --arg size=64
  hpctrain convert hf_saved/ data/shards --column image=img.jpg --column label=cls
  hpctrain convert corpus/ data/tokens --tokenizer bytes --text-glob '*.py' --val-fraction 0.01
  hpctrain convert docs.jsonl data/tokens --tokenizer tokenizer.json --text-field content
  hpctrain convert sft.jsonl data/sft --tokenizer tok/tokenizer.json --messages-field messages
  hpctrain convert corpus/ data/tokens --tokenizer bytes --parts 8 --max-parallel 4
  hpctrain convert data/images $SCRATCH/shards --slurm --parts 64 --profile jean-zay-cpu \
      --account abc@cpu --time 02:00:00 --workers 8 --dry-run

SRC is a folder SRC/<class>/<image> (classes sorted -> labels); a .csv/.jsonl manifest (every
column a member: path/label, file columns like mask.png, cls/txt/json, the rest gathered into
.json); a Python callable pkg.module:function returning dict samples; a Hugging Face
save_to_disk folder or parquet files (pip install -e '.[arrow]'); or shards (a folder with
index.json or .tar files, a brace pattern). docs/conversion.md has the mapping rules.
DEST (or -o DEST) is a folder or an fsspec URL (s3://..., memory://...). Output is identical for any
--workers; the index is written last, so a killed run leaves no index (finish it with --resume).
--parts N splits the work into N parts (local processes, or with --slurm a job array per stage
and a merge job): the same output as one process; --resume runs only the parts that did not
finish (docs/conversion.md, "Converting on a cluster").
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # here, not at the top: `hpctrain --help` should not import numpy and fsspec
    from hpctrain.convert.sources import KINDS

    parser.add_argument(
        "src", help="image folder, manifest (.csv/.jsonl) or shards (folder, pattern, index.json)"
    )
    add_output_option(parser, "output folder or fsspec URL", dest="dest", positional="DEST")
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
        choices=["auto", *KINDS],
        default="auto",
        help="source kind (default: guessed)",
    )
    parser.add_argument(
        "--path-column",
        default="path",
        help="manifest column with the image path/URL (default path)",
    )
    parser.add_argument(
        "--label-column",
        default="label",
        help="manifest/Arrow/parquet column with the label, written as cls (default label)",
    )
    parser.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="NAME=FIELD",
        help="Arrow/parquet: write column NAME as field FIELD (e.g. image=img.jpg); FIELD empty: leave it out",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="K=V",
        help="Python source: keyword argument of the callable (V parsed as JSON, else text)",
    )
    parser.add_argument(
        "--progress",
        choices=["auto", "bar", "plain", "none"],
        default="auto",
        help="progress bar in a terminal, periodic lines otherwise (default auto)",
    )
    parts = parser.add_argument_group(
        "conversion in parts (docs/conversion.md: the same output, spread over processes or a "
        "SLURM job array)"
    )
    parts.add_argument(
        "--parts",
        type=int,
        default=0,
        metavar="N",
        help="convert in N parts: local processes, or array tasks with --slurm",
    )
    parts.add_argument(
        "--max-parallel",
        type=int,
        default=0,
        metavar="K",
        help="at most K parts at once (SLURM's --array=...%%K); default: all",
    )
    parts.add_argument(
        "--slurm", action="store_true", help="submit the parts as SLURM job arrays + a merge job"
    )
    parts.add_argument(
        "--profile", default="", help="--slurm: cluster profile (configs/clusters/NAME.yaml)"
    )
    parts.add_argument("--account", default="", help="--slurm: the account to charge")
    parts.add_argument("--partition", default="", help="--slurm: the partition (a CPU one)")
    parts.add_argument("--qos", default="", help="--slurm: the quality of service")
    parts.add_argument("--time", default="", help="--slurm: wall time of each part, HH:MM:SS")
    parts.add_argument(
        "--log-dir", default="", help="--slurm: where the jobs' logs go (default: here)"
    )
    parts.add_argument(
        "--dry-run", action="store_true", help="--slurm: print the job scripts, submit nothing"
    )
    # What an array task or a local part process runs (rendered by --parts, not typed)
    parts.add_argument("--run-part", type=int, default=None, help=argparse.SUPPRESS)
    # convert.parts.STAGES, written out: importing convert.parts costs --help a second
    # (tests/cli/test_main.py checks the two agree)
    parts.add_argument("--stage", default="write", choices=PART_STAGES, help=argparse.SUPPRESS)
    parts.add_argument("--merge", action="store_true", help=argparse.SUPPRESS)
    text = parser.add_argument_group(
        "text sources (language models: token shards; docs/conversion.md and docs/language-model-data.md)"
    )
    text.add_argument(
        "--tokenizer",
        default="",
        metavar="bytes|PATH",
        help="tokenize text: 'bytes' (built in) or a tokenizer.json, sentencepiece *.model or "
        "*.tiktoken file (never a hub name)",
    )
    text.add_argument(
        "--eod-token",
        default="",
        metavar="TOKEN",
        help="end-of-document token of a tokenizer file (default: <|endoftext|>, </s>, ...; "
        "the name of the one a tiktoken file gets)",
    )
    text.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help=".jsonl/.csv/.parquet: the column holding each document (default text)",
    )
    text.add_argument(
        "--text-glob",
        default="*.txt",
        metavar="PATTERN",
        help="folder of text files: file names to read, recursively (default *.txt)",
    )
    text.add_argument(
        "--text-per-line",
        action="store_true",
        help="text files: each non-blank line is a document (default: each file)",
    )
    text.add_argument(
        "--sample-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="pack whole documents into samples of at most N ids (default 8192)",
    )
    text.add_argument(
        "--prompt-field",
        default="",
        metavar="NAME",
        help=".jsonl instruction data: the prompt of each record (with --response-field)",
    )
    text.add_argument(
        "--response-field",
        default="",
        metavar="NAME",
        help=".jsonl instruction data: the response, the tokens the loss learns (with the EOD)",
    )
    text.add_argument(
        "--messages-field",
        default="",
        metavar="NAME",
        help=".jsonl chat data: [{role, content}, ...] rendered with the tokenizer folder's "
        "chat_template; the assistant turns are what the loss learns",
    )


def _pairs(values: list[str], flag: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise ConvertOptionError(f"{flag} {value!r}: expected NAME=VALUE")
        pairs.append((name, rest))
    return tuple(pairs)


def run(args: argparse.Namespace) -> int:
    from hpctrain.convert.errors import ConvertedAlready
    from hpctrain.convert.layout import parse_size
    from hpctrain.convert.options import ConvertOptions
    from hpctrain.convert.run import convert, result_summary

    if not args.dest:
        raise ConvertOptionError("convert needs the output folder: -o DEST (or SRC DEST)")
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
        columns=_pairs(args.column, "--column"),
        args=_pairs(args.arg, "--arg"),
        workers=args.workers,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=args.progress,
        tokenizer=args.tokenizer,
        eod_token=args.eod_token,
        text_field=args.text_field,
        text_glob=args.text_glob,
        text_per_line=args.text_per_line,
        sample_tokens=args.sample_tokens,
        prompt_field=args.prompt_field,
        response_field=args.response_field,
        messages_field=args.messages_field,
    )
    if args.parts or args.run_part is not None or args.merge or args.slurm:
        return _run_parts(args, options)
    try:
        print(result_summary(convert(options)))  # ConvertError/ShardIndexError: data errors (3)
    except ConvertedAlready as done:
        print(done)
    return 0


def _run_parts(args: argparse.Namespace, options: ConvertOptions) -> int:
    from hpctrain.convert.parts import merge_parts, run_locally, run_part
    from hpctrain.convert.run import result_summary

    if args.parts < 1:
        raise ConvertOptionError("--slurm, --run-part and --merge need --parts N")
    if args.run_part is not None:
        print(f"hpctrain convert: {run_part(options, args.parts, args.run_part, args.stage)}")
        return 0
    if args.merge:
        started = time.perf_counter()
        result = merge_parts(options, args.parts)
        print(result_summary(result))
        print(f"merged {args.parts} parts in {time.perf_counter() - started:.2f} s")
        return 0
    if args.slurm:
        return _submit(args, options)
    if args.dry_run:
        raise ConvertOptionError("--dry-run prints job scripts: it goes with --slurm")
    print(result_summary(run_locally(options, args.parts, args.max_parallel)))
    return 0


def _submit(args: argparse.Namespace, options: ConvertOptions) -> int:
    from hpctrain.config.schema import SlurmConfig
    from hpctrain.launch.convert_array import array_job, submit_conversion

    aj = array_job(
        options,
        profile=args.profile or SlurmConfig().profile,
        account=args.account,
        partition=args.partition,
        qos=args.qos,
        time=args.time,
        log_dir=args.log_dir,
        max_parallel=args.max_parallel,
    )
    done = submit_conversion(options, args.parts, aj, dry_run=args.dry_run)
    if done.finished:
        print(f"hpctrain convert: {options.dest}: finished already, nothing to submit")
    elif args.dry_run:
        for what, script in done.scripts:
            print(f"# ---- {what} ----")
            print(script)
        print("# submitted in this order, each with --dependency=afterok:<the job before>")
    else:
        for (what, _script), job_id in zip(done.scripts, done.job_ids, strict=True):
            print(f"job {job_id}: {what}")
        print(f"logs in {aj.log_dir}; the index is written by job {done.job_ids[-1]}")
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """After Ctrl-C: the shards written so far are whole (each is renamed into place), the
    index is not written: nothing reads DEST as a dataset until a rerun finishes it."""
    if not args.dest or getattr(args, "slurm", False):
        return ""
    return (
        f"{args.dest} keeps its finished shards and has no index yet; the same command with "
        "--resume finishes it (--overwrite starts again)"
    )
