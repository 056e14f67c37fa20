"""What `hpctrain convert` is asked to do (`ConvertOptions`), what it did (`ConvertResult`),
and the checks and words derived from the options: the settings that decide the output bytes,
the command line that reproduces it, and which options a source kind takes.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.sources.base import ListOptions
from hpctrain.data.index import ShardIndex, redact_url


@dataclass(frozen=True)
class ConvertOptions:
    """Everything `hpctrain convert` takes (see `hpctrain convert --help`)."""

    src: str
    dest: str
    source_kind: str = "auto"
    samples_per_shard: int | None = None
    shard_size: int | None = None
    shuffle: bool = False
    seed: int = 0
    val_fraction: float = 0.0
    max_side: int | None = None
    quality: int | None = None
    on_error: str = "fail"
    prefix: str = "shard"
    path_column: str = "path"
    label_column: str = "label"
    columns: tuple[tuple[str, str], ...] = ()  # Arrow/parquet: (column, field); field "" drops it
    args: tuple[tuple[str, str], ...] = ()  # Python source: keyword arguments of the callable
    # How to run, not what to write: never part of the index or the plan fingerprint.
    workers: int = 1
    resume: bool = False
    overwrite: bool = False
    progress: str = "auto"
    # Text sources (`hpctrain.convert.text`): a tokenizer ("bytes" or a tokenizer.json path)
    # selects text mode; these decide the output bytes again.
    tokenizer: str = ""
    eod_token: str = ""
    text_field: str = "text"
    text_glob: str = "*.txt"
    text_per_line: bool = False
    sample_tokens: int = 8192
    # Instruction data (`hpctrain.convert.instructions`): JSONL records with a loss mask.
    prompt_field: str = ""
    response_field: str = ""
    messages_field: str = ""


@dataclass
class ConvertResult:
    indexes: dict[str, ShardIndex]  # split ("" without --val-fraction) -> index
    index_urls: dict[str, str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    num_resumed_shards: int = 0
    # text to tokens: split -> documents, packed into fewer samples (for the summary line; not
    # in the index, which a conversion in parts writes the same without counting them)
    num_documents: dict[str, int] = field(default_factory=dict)


def settings(options: ConvertOptions, kind: str) -> dict[str, object]:
    """What determines the output bytes (for the fingerprint and the index's `extra`)."""
    return {
        "source": redact_url(options.src),
        "source_kind": kind,
        "samples_per_shard": options.samples_per_shard,
        "shard_size": options.shard_size,
        "shuffle": options.shuffle,
        "seed": options.seed,
        "val_fraction": options.val_fraction,
        "max_side": options.max_side,
        "quality": options.quality,
        "on_error": options.on_error,
        "prefix": options.prefix,
        # only when given, so that the indexes of image folders and manifests stay as they were
        **({"columns": [list(c) for c in options.columns]} if options.columns else {}),
        **({"args": [list(a) for a in options.args]} if options.args else {}),
    }


def list_options(options: ConvertOptions, spool_dir: str) -> ListOptions:
    """The options that tell `list_source` how to read the source."""
    return ListOptions(
        path_column=options.path_column,
        label_column=options.label_column,
        columns=options.columns,
        args=options.args,
        spool_dir=spool_dir,
    )


def command_line(options: ConvertOptions) -> str:
    """The canonical command that reproduces the output (without run-only flags like --workers)."""
    return shlex.join(command_words(options))


def command_words(options: ConvertOptions, *, redact: bool = True) -> list[str]:
    """`command_line` as words; `redact=False` keeps SRC and DEST whole (what the processes of
    a conversion in parts are started with: `hpctrain.convert.parts`)."""
    shown = redact_url if redact else str
    words = ["hpctrain", "convert", shown(options.src), shown(options.dest)]
    defaults = ConvertOptions(src="", dest="")
    for name in (
        "source_kind",
        "samples_per_shard",
        "shard_size",
        "seed",
        "val_fraction",
        "max_side",
        "quality",
        "on_error",
        "prefix",
        "path_column",
        "label_column",
        "tokenizer",
        "eod_token",
        "text_field",
        "text_glob",
        "sample_tokens",
        "prompt_field",
        "response_field",
        "messages_field",
    ):
        value = getattr(options, name)
        if value != getattr(defaults, name):
            flag = "--source" if name == "source_kind" else "--" + name.replace("_", "-")
            words += [flag, str(value)]
    for column, name in options.columns:
        words += ["--column", f"{column}={name}"]
    for key, value in options.args:
        words += ["--arg", f"{key}={value}"]
    if options.shuffle:
        words.append("--shuffle")
    if options.text_per_line:
        words.append("--text-per-line")
    return words


def validate(options: ConvertOptions) -> None:
    """Refuse options that contradict each other or are out of range (before reading anything)."""
    if options.on_error not in ("fail", "skip"):
        raise ConvertOptionError(f"--on-error {options.on_error!r}: expected fail or skip")
    if options.workers < 1:
        raise ConvertOptionError("--workers must be >= 1")
    if options.samples_per_shard is not None and options.shard_size is not None:
        raise ConvertOptionError("give --samples-per-shard or --shard-size, not both")
    if options.samples_per_shard is not None and options.samples_per_shard < 1:
        raise ConvertOptionError("--samples-per-shard must be >= 1")  # text conversions too
    if not 0.0 <= options.val_fraction < 1.0:
        raise ConvertOptionError(f"--val-fraction {options.val_fraction}: must be in [0, 1)")
    if options.val_fraction > 0 and given(options, ["prefix"]):
        raise ConvertOptionError(
            "--prefix: does nothing with --val-fraction (its shards are named train-*, val-*)"
        )
    for name in ("max_side", "quality"):
        value = getattr(options, name)
        if value is not None and not (1 <= value <= (100 if name == "quality" else 1 << 16)):
            raise ConvertOptionError(f"--{name.replace('_', '-')} {value}: out of range")
    if options.workers > 1 and options.dest.startswith("memory://"):
        raise ConvertError(
            "memory:// lives inside one process: use --workers 1 with a memory:// destination"
        )


# The source kinds each source option does something for; text options need --tokenizer.
_OPTION_KINDS = {
    "path_column": ("manifest",),
    "label_column": ("manifest", "arrow"),
    "columns": ("arrow",),
    "args": ("python",),
}
_TEXT_OPTIONS = (
    "eod_token",
    "text_field",
    "text_glob",
    "text_per_line",
    "sample_tokens",
    "prompt_field",
    "response_field",
    "messages_field",
)


def flag_of(name: str) -> str:
    """The command-line flag of a `ConvertOptions` field."""
    return {"source_kind": "--source", "columns": "--column", "args": "--arg"}.get(
        name, "--" + name.replace("_", "-")
    )


def given(options: ConvertOptions, names: Iterable[str]) -> list[str]:
    """The flags of the fields among `names` that differ from their defaults."""
    defaults = ConvertOptions(src="", dest="")
    return [flag_of(n) for n in names if getattr(options, n) != getattr(defaults, n)]


def check_options_apply(options: ConvertOptions, kind: str) -> None:
    """Refuse an option that does nothing for this source: it was meant for something."""
    for name, kinds in _OPTION_KINDS.items():
        if kind not in kinds and given(options, [name]):
            raise ConvertOptionError(
                f"{flag_of(name)}: does nothing for a {kind} source ({redact_url(options.src)}); "
                f"it is for {' and '.join(kinds)} sources"
            )
    for flag in given(options, _TEXT_OPTIONS):
        raise ConvertOptionError(f"{flag}: only for text sources (with --tokenizer)")
