"""`convert(options)`: list, plan, write shards (in parallel), then the index, last.

Order of effects on DEST, which is what makes a killed conversion safe:

1. a small state file (`.hpctrain-convert.json`) with the plan's fingerprint;
2. shards, each appearing under its final name only once complete;
3. `skipped.txt` (when samples were skipped), then the index(es);
4. the state file is removed.

A run killed before step 3 leaves no index, so nothing lies about what is there; `--resume`
checks the fingerprint, keeps the committed shards and writes the rest.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import tempfile
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.convert.layout import assign_shards, order_samples, plan_fingerprint, split_train_val
from hpctrain.convert.processes import process_pool
from hpctrain.convert.progress import Progress
from hpctrain.convert.sources import (
    ConvertError,
    ConvertOptionError,
    ListOptions,
    SampleRef,
    Source,
    detect_kind,
    is_python_spec,
    list_source,
)
from hpctrain.convert.writer import (
    TEMP_MARKER,
    EncodeOptions,
    ShardResult,
    ShardTask,
    scan_committed_shard,
    write_shard,
)
from hpctrain.data.index import (
    INDEX_NAME,
    ShardIndex,
    ShardIndexError,
    ShardInfo,
    index_to_bytes,
    read_index,
    redact_url,
)

STATE_NAME = ".hpctrain-convert.json"
SKIPPED_NAME = "skipped.txt"


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


def _settings(options: ConvertOptions, kind: str) -> dict[str, object]:
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
    words = ["hpctrain", "convert", redact_url(options.src), redact_url(options.dest)]
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
    return shlex.join(words)


def _join(base: str, name: str) -> str:
    return posixpath.join(base.rstrip("/"), name) if base else name


def _exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return bool(fs.exists(path))


def _write_bytes(url: str, data: bytes) -> None:
    """Write a small file atomically where the filesystem allows (temp + rename locally)."""
    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        folder, name = os.path.split(path)
        os.makedirs(folder or ".", exist_ok=True)
        temp = os.path.join(folder, f".{name}{TEMP_MARKER}{os.getpid()}")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    else:
        fs.pipe_file(path, data)


def _remove(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


def _remove_stale(folder: str) -> None:
    """Delete temp files killed writers left in `folder` (hidden names with the temp marker)."""
    fs, path = fsspec.core.url_to_fs(folder)
    if not fs.isdir(path):
        return
    for entry in fs.ls(path, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if name.startswith(".") and TEMP_MARKER in name:
            fs.rm(entry)


def _split_layout(options: ConvertOptions, splits: list[str]) -> dict[str, tuple[str, str]]:
    """split -> (folder URL, shard name prefix)."""
    if splits == [""]:
        return {"": (options.dest.rstrip("/"), options.prefix)}
    return {split: (_join(options.dest, split), split) for split in splits}


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert `options.src` into shards and index(es) under `options.dest` (see module doc).

    The steps: validate the options, list the source and plan the shards, prepare DEST (the
    state file), write the shards, then commit (`skipped.txt`, the indexes, state file removed).
    """
    _validate(options)
    check_apart(options.src, options.dest)
    splits = ["train", "val"] if options.val_fraction > 0 else [""]
    index_urls = {
        split: _join(folder, INDEX_NAME)
        for split, (folder, _) in _split_layout(options, splits).items()
    }
    state_url = _join(options.dest, STATE_NAME)
    if (
        options.resume
        and not _exists(state_url)
        and all(_exists(url) for url in index_urls.values())
    ):
        # Finished already (e.g. a requeued job running the same command again): nothing to do.
        indexes = {split: read_index(url) for split, url in index_urls.items()}
        return ConvertResult(indexes, index_urls, [], sum(len(i.shards) for i in indexes.values()))
    with tempfile.TemporaryDirectory(prefix="hpctrain-convert-") as spool_dir:
        from hpctrain.convert import text  # imports this module: here, not at the top

        if text.is_text_conversion(options):
            return text.convert_text(options, spool_dir, state_url, index_urls)
        plan = _plan(options, spool_dir)
        _prepare_destination(
            options, state_url, index_urls, plan.tasks, plan.fingerprint, plan.layout
        )
        results, num_resumed = _write_shards(options, plan)
    indexes, skipped = _commit(options, plan, results, index_urls, state_url)
    return ConvertResult(indexes, index_urls, skipped, num_resumed)


def _validate(options: ConvertOptions) -> None:
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


def _location(url: str) -> tuple[str, str]:
    """(protocol, absolute path) of a URL; local paths with symlinks resolved."""
    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        return "file", os.path.realpath(path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath("/" + path.strip("/"))


def _source_locations(src: str) -> list[str]:
    """The files and folders a conversion of `src` reads (for `check_apart`).

    A pattern stands for the folder of its fixed part; a shard or an index for its folder and
    the folders of the shards it lists; a Python callable reads no path.
    """
    if is_python_spec(src):
        return []
    cut = min((i for i in (src.find(c) for c in "{*?[") if i >= 0), default=-1)
    if cut >= 0:
        return [posixpath.dirname(src[:cut]) or "."]
    lowered = src.lower().split("?", 1)[0]
    locations = [src]
    if lowered.endswith((".tar", ".json")):
        locations.append(posixpath.dirname(src) or ".")
    index_url = src if lowered.endswith(".json") else _join(src, INDEX_NAME)
    try:
        if _exists(index_url):
            index = read_index(index_url)
            locations += [posixpath.dirname(index.shard_url(i)) for i in range(len(index.shards))]
    except (ShardIndexError, OSError, ValueError):
        pass  # not an index: the source kinds report what it is
    return locations


def check_apart(src: str, dest: str) -> None:
    """Refuse a DEST that is, holds or lies inside what the conversion reads.

    `--overwrite` deletes DEST's index and shards before the source is read, and a DEST inside
    an image folder becomes one of its classes: both must be refused before anything is touched.
    """
    where, target = _location(dest)
    for location in dict.fromkeys(_source_locations(src)):
        protocol, path = _location(location)
        if protocol != where:
            continue
        if path == target or _inside(path, target) or _inside(target, path):
            raise ConvertOptionError(
                f"DEST {redact_url(dest)} is, holds or lies inside the source "
                f"{redact_url(location)}: write the shards to a folder apart from the source"
            )


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


@dataclass(frozen=True)
class _Plan:
    """What a conversion will write: the listed source, each split's shard tasks, where."""

    source: Source
    settings: dict[str, object]
    layout: dict[str, tuple[str, str]]  # split -> (folder URL, shard name prefix)
    tasks: dict[str, list[ShardTask]]
    fingerprint: str


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


def _check_options_apply(options: ConvertOptions, kind: str) -> None:
    """Refuse an option that does nothing for this source: it was meant for something."""
    for name, kinds in _OPTION_KINDS.items():
        if kind not in kinds and given(options, [name]):
            raise ConvertOptionError(
                f"{flag_of(name)}: does nothing for a {kind} source ({redact_url(options.src)}); "
                f"it is for {' and '.join(kinds)} sources"
            )
    for flag in given(options, _TEXT_OPTIONS):
        raise ConvertOptionError(f"{flag}: only for text sources (with --tokenizer)")


def _plan(options: ConvertOptions, spool_dir: str) -> _Plan:
    """List the source, split it, order it and cut it into shards (no output written yet)."""
    kind = detect_kind(options.src) if options.source_kind == "auto" else options.source_kind
    _check_options_apply(options, kind)
    source = list_source(options.src, kind, list_options(options, spool_dir))
    if options.val_fraction > 0:
        train, val = split_train_val(source.samples, options.val_fraction, options.seed)
        if not val or not train:
            raise ConvertError(
                f"--val-fraction {options.val_fraction}: leaves an empty split for {len(source.samples)} samples"
            )
        by_split: dict[str, list[SampleRef]] = {"train": train, "val": val}
    else:
        by_split = {"": list(source.samples)}
    plans = {
        split: assign_shards(
            order_samples(
                samples, shuffle=options.shuffle, seed=options.seed, split=split or "all"
            ),
            samples_per_shard=options.samples_per_shard,
            shard_size=options.shard_size,
        )
        for split, samples in by_split.items()
    }
    layout = _split_layout(options, list(plans))
    settings = _settings(options, source.kind)
    encode = EncodeOptions(options.max_side, options.quality)
    tasks = {
        split: [
            ShardTask(
                _join(layout[split][0], f"{layout[split][1]}-{i:06d}.tar"),
                tuple(samples),
                encode,
                options.on_error,
            )
            for i, samples in enumerate(plan)
        ]
        for split, plan in plans.items()
    }
    return _Plan(source, settings, layout, tasks, plan_fingerprint(plans, settings))


def _write_shards(options: ConvertOptions, plan: _Plan) -> tuple[dict[str, ShardResult], int]:
    """Write every shard not already committed (those are kept under `--resume`)."""
    all_tasks = [task for split in plan.tasks for task in plan.tasks[split]]
    results: dict[str, ShardResult] = {}
    todo = []
    for task in all_tasks:
        if options.resume and _exists(task.url):
            results[task.url] = scan_committed_shard(task)
        else:
            todo.append(task)
    num_resumed = len(results)
    progress = Progress(sum(len(t.samples) for t in all_tasks), options.progress)
    progress.update(sum(len(t.samples) for t in all_tasks if t.url in results))
    try:
        results.update(_run_tasks(todo, options.workers, progress))
    finally:
        progress.close()
    return results, num_resumed


def _commit(
    options: ConvertOptions,
    plan: _Plan,
    results: dict[str, ShardResult],
    index_urls: dict[str, str],
    state_url: str,
) -> tuple[dict[str, ShardIndex], list[tuple[str, str]]]:
    """Write `skipped.txt`, then the index of each split, then remove the state file."""
    skipped = [
        item for split in plan.tasks for t in plan.tasks[split] for item in results[t.url].skipped
    ]
    skipped_url = _join(options.dest, SKIPPED_NAME)
    if skipped:
        _write_bytes(
            skipped_url,
            "".join(f"{redact_url(url)}\t{reason}\n" for url, reason in skipped).encode(),
        )
    else:
        _remove(skipped_url)
    command = command_line(options)
    indexes = {}
    for split, split_tasks in plan.tasks.items():
        shards = tuple(
            ShardInfo(
                url=posixpath.basename(r.url),
                num_samples=r.num_samples,
                num_bytes=r.num_bytes,
                sha256=r.sha256,
            )
            for r in (results[t.url] for t in split_tasks)
            if r.num_samples > 0
        )
        extra = {
            **plan.settings,
            "split": split or None,
            "num_skipped": sum(len(results[t.url].skipped) for t in split_tasks),
        }
        indexes[split] = index = ShardIndex(
            shards=shards,
            base_url=plan.layout[split][0],
            class_names=plan.source.class_names,
            command=command,
            extra=extra,
        )
        _write_bytes(index_urls[split], index_to_bytes(index))
    _remove(state_url)
    return indexes, skipped


def _prepare_destination(
    options: ConvertOptions,
    state_url: str,
    index_urls: dict[str, str],
    tasks: dict[str, list[ShardTask]],
    fingerprint: str,
    layout: dict[str, tuple[str, str]],
) -> None:
    """Refuse to mix runs, check `--resume` continues the same plan, record the plan."""
    dest = redact_url(options.dest)
    if _exists(state_url):
        fs, path = fsspec.core.url_to_fs(state_url)
        state = json.loads(fs.cat_file(path))
        if options.resume and state.get("fingerprint") != fingerprint:
            raise ConvertError(
                f"{dest}: --resume with a different source or options than the interrupted run ({state.get('command')})"
            )
        if not options.resume and not options.overwrite:
            raise ConvertError(
                f"{dest}: holds an interrupted conversion; use --resume to finish it or --overwrite"
            )
    elif not options.overwrite:
        existing = [u for u in index_urls.values() if _exists(u)]
        existing += [t.url for ts in tasks.values() for t in ts[:1] if _exists(t.url)]
        if existing:
            if options.resume:
                raise ConvertError(
                    f"{dest}: no interrupted conversion to resume (finished already, or not ours)"
                )
            raise ConvertError(
                f"{dest}: already holds shards or an index; use --overwrite to replace them"
            )
        skipped_url = _join(options.dest, SKIPPED_NAME)
        if _exists(skipped_url):  # no conversion of ours is there: the file is the user's
            raise ConvertError(
                f"{redact_url(skipped_url)}: not written by a conversion here (the commit would "
                "replace or remove it); move it, or use --overwrite"
            )
    other = _other_layout(options.dest, layout)
    if not options.overwrite:
        found = [url for url in other if _exists(url)]
        if found:
            raise ConvertError(
                f"{dest}: holds {_layout_name(found)} ({', '.join(map(redact_url, found))}) where "
                f"this conversion writes {_layout_name(list(index_urls))}; use --overwrite to "
                "replace it"
            )
    if options.overwrite and not options.resume:
        for url in [*index_urls.values(), *other]:
            _remove(url)  # first: no index may describe shards while they are rewritten
        for url, index in other.items():
            _remove_listed_shards(url, index)
        for folder, prefix in layout.values():
            fs, path = fsspec.core.url_to_fs(folder)
            if fs.isdir(path):
                for entry in fs.glob(posixpath.join(path, f"{prefix}-*.tar")):
                    fs.rm(entry)
    for folder in {options.dest, *(folder for folder, _ in layout.values())}:
        _remove_stale(folder)
    fs, path = fsspec.core.url_to_fs(options.dest)
    try:
        fs.makedirs(path, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only or unreachable place
        raise ConvertError(
            f"{options.dest}: cannot create the output folder: {exc.strerror or exc}"
        ) from None
    state = {"fingerprint": fingerprint, "command": command_line(options)}
    _write_bytes(state_url, (json.dumps(state, indent=1) + "\n").encode())


def _other_layout(dest: str, layout: dict[str, tuple[str, str]]) -> dict[str, ShardIndex | None]:
    """The index URLs of the layout this conversion does not write (flat vs train/ and val/),
    with the index read (its shards are what `--overwrite` removes besides it)."""
    urls = [_join(dest, INDEX_NAME)]
    if "" in layout:
        urls = [_join(_join(dest, split), INDEX_NAME) for split in ("train", "val")]
    return {url: read_index(url) if _exists(url) else None for url in urls}


def _layout_name(index_urls: list[str]) -> str:
    return "a train/ and val/ layout" if len(index_urls) > 1 else "a layout without --val-fraction"


def _remove_listed_shards(index_url: str, index: ShardIndex | None) -> None:
    """Delete the shards an index of DEST lists in its own folder (nothing it names elsewhere),
    then its split folder when that is left empty."""
    if index is None:
        return
    folder = posixpath.dirname(index_url)
    for shard in index.shards:
        if "/" not in shard.url and ":" not in shard.url and shard.url.endswith(".tar"):
            _remove(_join(folder, shard.url))
    fs, path = fsspec.core.url_to_fs(folder)
    if posixpath.basename(folder) in ("train", "val") and fs.isdir(path) and not fs.ls(path):
        fs.rmdir(path)


def _run_tasks(tasks: list[ShardTask], workers: int, progress: Progress) -> dict[str, ShardResult]:
    if workers == 1 or len(tasks) <= 1:
        return {task.url: write_shard(task, on_sample=progress.update) for task in tasks}
    results: dict[str, ShardResult] = {}
    with process_pool(workers, preload_pil=any(task.encode.active for task in tasks)) as pool:
        pending: set[Future[ShardResult]] = {pool.submit(write_shard, task) for task in tasks}
        sizes = {task.url: len(task.samples) for task in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()  # type: ignore[misc]
                result = future.result()
                results[result.url] = result
                progress.update(sizes[result.url])
    return results


def result_summary(result: ConvertResult) -> str:
    """Human-readable lines about a finished conversion."""
    lines = []
    for split, index in result.indexes.items():
        lines.append(
            f"{split or 'shards'}: {index.num_samples} samples in {len(index.shards)} shards, "
            f"{index.num_bytes / 1e6:.1f} MB -> {redact_url(result.index_urls[split])}"
        )
    if result.num_resumed_shards:
        lines.append(
            f"resumed: kept {result.num_resumed_shards} shards written by the interrupted run"
        )
    if result.skipped:
        lines.append(f"skipped {len(result.skipped)} samples (listed in {SKIPPED_NAME})")
    return "\n".join(lines)
