"""DEST: what a conversion finds there, and the order of its effects there, for the sample
pipeline (`run.py`) and the token pipeline (`text.py`) alike.

Order of effects on DEST, which is what makes a killed conversion safe:

1. a small state file (`.hpctrain-convert.json`) with the plan's fingerprint (`prepare`);
2. shards, each appearing under its final name only once complete (the pipelines);
3. `skipped.txt` (when samples were skipped), then the index(es) (`commit`);
4. the state file is removed (`commit`).

A run killed before step 3 leaves no index, so nothing lies about what is there; `--resume`
checks the fingerprint, keeps the committed shards and writes the rest.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.convert.errors import ConvertedAlready, ConvertError, ConvertOptionError
from hpctrain.convert.options import ConvertOptions, command_line
from hpctrain.convert.sources.generated import is_python_spec
from hpctrain.data.compact import companion_url
from hpctrain.data.index import (
    INDEX_NAME,
    ShardIndex,
    ShardIndexError,
    index_to_bytes,
    read_index,
    redact_url,
)
from hpctrain.data.node_index import write_companion_of
from hpctrain.files import TEMP_MARKER, write_atomic

STATE_NAME = ".hpctrain-convert.json"
SKIPPED_NAME = "skipped.txt"

Layout = dict[
    str, tuple[str, str]
]  # split ("" without --val-fraction) -> (folder URL, shard prefix)


def join(base: str, name: str) -> str:
    return posixpath.join(base.rstrip("/"), name) if base else name


def exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return bool(fs.exists(path))


def _remove(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)


def remove_stale(folder: str) -> None:
    """Delete temp files killed writers left in `folder` (hidden names with the temp marker)."""
    fs, path = fsspec.core.url_to_fs(folder)
    if not fs.isdir(path):
        return
    for entry in fs.ls(path, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if name.startswith(".") and TEMP_MARKER in name:
            fs.rm(entry)


def split_layout(options: ConvertOptions) -> Layout:
    """split -> (folder URL, shard name prefix): train/ and val/ with `--val-fraction`, else DEST."""
    splits = ["train", "val"] if options.val_fraction > 0 else [""]
    if splits == [""]:
        return {"": (options.dest.rstrip("/"), options.prefix)}
    return {split: (join(options.dest, split), split) for split in splits}


def state_url_of(options: ConvertOptions) -> str:
    return join(options.dest, STATE_NAME)


def index_urls_of(layout: Layout) -> dict[str, str]:
    """split -> the URL of its index."""
    return {split: join(folder, INDEX_NAME) for split, (folder, _) in layout.items()}


def shard_url(layout: Layout, split: str, number: int) -> str:
    """The URL of shard `number` of `split`."""
    folder, prefix = layout[split]
    return join(folder, f"{prefix}-{number:06d}.tar")


def finished(options: ConvertOptions, layout: Layout) -> dict[str, ShardIndex] | None:
    """Under `--resume`, the indexes of a conversion that finished already (e.g. a requeued job
    running the same command again: nothing to do); None when there is something to do."""
    index_urls = index_urls_of(layout)
    if (
        options.resume
        and not exists(state_url_of(options))
        and all(exists(url) for url in index_urls.values())
    ):
        return {split: read_index(url) for split, url in index_urls.items()}
    return None


def commit(
    options: ConvertOptions,
    layout: Layout,
    indexes: dict[str, ShardIndex],
    skipped: list[tuple[str, str]],
) -> None:
    """Steps 3 and 4: `skipped.txt` (the (where, reason) of each skipped sample or document,
    as shown), then the index of each split, then remove the state file."""
    skipped_url = join(options.dest, SKIPPED_NAME)
    if skipped:
        text = "".join(f"{where}\t{reason}\n" for where, reason in skipped)
        write_atomic(skipped_url, text.encode(), durable=True)
    else:
        _remove(skipped_url)
    index_urls = index_urls_of(layout)
    for split, index in indexes.items():
        raw = index_to_bytes(index)
        write_atomic(index_urls[split], raw, durable=True)
        # its compact form, what the ranks of a large job read (`hpctrain.data.node_index`)
        write_companion_of(index, index_urls[split], raw)
    _remove(state_url_of(options))


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
    index_url = src if lowered.endswith(".json") else join(src, INDEX_NAME)
    try:
        if exists(index_url):
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


def _made_by(index_urls: Iterable[str], command: str) -> bool:
    """Whether every index of the layout exists and records `command` (a finished run of it)."""
    for url in index_urls:
        try:
            fs, path = fsspec.core.url_to_fs(url)
            if json.loads(fs.cat_file(path)).get("command") != command:
                return False
        except (OSError, ValueError, AttributeError):  # absent, unreadable, not an index
            return False
    return True


def prepare(
    options: ConvertOptions,
    layout: Layout,
    shard_urls: dict[str, list[str]],
    fingerprint: str,
) -> None:
    """Refuse to mix runs, check `--resume` continues the same plan, record the plan (step 1).

    `shard_urls`: split -> the URLs of its planned shards; `fingerprint`: of the plan.
    """
    state_url, index_urls = state_url_of(options), index_urls_of(layout)
    dest = redact_url(options.dest)
    if exists(state_url):
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
        existing = [u for u in index_urls.values() if exists(u)]
        existing += [urls[0] for urls in shard_urls.values() if urls and exists(urls[0])]
        if existing:
            if options.resume:
                raise ConvertError(
                    f"{dest}: no interrupted conversion to resume (finished already, or not ours)"
                )
            if _made_by(index_urls.values(), command_line(options)):
                # the same command run again (a page of the docs after `make demo`): done
                raise ConvertedAlready(
                    f"{dest}: converted already by the same command (its index.json says so): "
                    "nothing to do; --overwrite converts again"
                )
            raise ConvertError(
                f"{dest}: already holds shards or an index; use --overwrite to replace them"
            )
        skipped_url = join(options.dest, SKIPPED_NAME)
        if exists(skipped_url):  # no conversion of ours is there: the file is the user's
            raise ConvertError(
                f"{redact_url(skipped_url)}: not written by a conversion here (the commit would "
                "replace or remove it); move it, or use --overwrite"
            )
    other = _other_layout(options.dest, layout)
    if not options.overwrite:
        found = [url for url in other if exists(url)]
        if found:
            raise ConvertError(
                f"{dest}: holds {_layout_name(found)} ({', '.join(map(redact_url, found))}) where "
                f"this conversion writes {_layout_name(list(index_urls))}; use --overwrite to "
                "replace it"
            )
    if options.overwrite and not options.resume:
        for url in [*index_urls.values(), *other]:
            _remove(url)  # first: no index may describe shards while they are rewritten
            _remove(companion_url(url))
        for url, index in other.items():
            _remove_listed_shards(url, index)
        for folder, prefix in layout.values():
            fs, path = fsspec.core.url_to_fs(folder)
            if fs.isdir(path):
                for entry in fs.glob(posixpath.join(path, f"{prefix}-*.tar")):
                    fs.rm(entry)
    for folder in {options.dest, *(folder for folder, _ in layout.values())}:
        remove_stale(folder)
    fs, path = fsspec.core.url_to_fs(options.dest)
    try:
        fs.makedirs(path, exist_ok=True)
    except OSError as exc:  # a file in the way, a read-only or unreachable place
        raise ConvertError(
            f"{options.dest}: cannot create the output folder: {exc.strerror or exc}"
        ) from None
    state = {"fingerprint": fingerprint, "command": command_line(options)}
    write_atomic(state_url, (json.dumps(state, indent=1) + "\n").encode(), durable=True)


def _other_layout(dest: str, layout: Layout) -> dict[str, ShardIndex | None]:
    """The index URLs of the layout this conversion does not write (flat vs train/ and val/),
    with the index read (its shards are what `--overwrite` removes besides it)."""
    urls = [join(dest, INDEX_NAME)]
    if "" in layout:
        urls = [join(join(dest, split), INDEX_NAME) for split in ("train", "val")]
    return {url: read_index(url) if exists(url) else None for url in urls}


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
            _remove(join(folder, shard.url))
    fs, path = fsspec.core.url_to_fs(folder)
    if posixpath.basename(folder) in ("train", "val") and fs.isdir(path) and not fs.ls(path):
        fs.rmdir(path)
