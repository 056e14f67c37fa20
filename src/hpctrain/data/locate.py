"""Find and open a shard index: `open_index(spec)` from an index.json, a folder, or a shard
pattern (whose shards are then counted)."""

from __future__ import annotations

import re
from typing import Any

import fsspec

from hpctrain.data.compact import COMPACT_SUFFIX
from hpctrain.data.index import (
    INDEX_NAME,
    ShardIndex,
    ShardIndexError,
    ShardInfo,
    redact_url,
)
from hpctrain.data.node_index import json_of, load_index
from hpctrain.data.stream import (
    PIPE_RULE,
    CorruptShardError,
    ShardReadError,
    ShardUnavailableError,
    open_shard,
    pipe_label,
)
from hpctrain.data.tar import iter_members, split_key

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """`a-{000..002}.tar` -> a-000.tar a-001.tar a-002.tar; `{x,y}` lists work too.

    Zero padding follows the first bound's width, as in bash and webdataset.
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    body = match.group(1)
    if ".." in body:
        lo, _, hi = body.partition("..")
        if not (lo.isdigit() and hi.isdigit()):
            raise ShardIndexError(f"{pattern}: brace range {{{body}}} is not numeric")
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [f"{head}{item}{rest}" for item in items for rest in expand_braces(tail)]


def count_samples(
    url: str, storage_options: dict[str, Any] | None = None, *, allow_pipe: bool = False
) -> int:
    """Samples in a tar shard (headers only; data is skipped, by seeking where possible)."""
    count, key = 0, None
    try:
        with open_shard(url, storage_options=storage_options, allow_pipe=allow_pipe) as f:
            for member, _read in iter_members(f):
                k, _ext = split_key(member.name)
                if k != key:
                    count, key = count + 1, k
    except CorruptShardError as exc:
        raise ShardReadError(url, str(exc)) from exc
    return count


def open_index(
    spec: str, storage_options: dict[str, Any] | None = None, *, allow_pipe: bool = False
) -> ShardIndex:
    """The shard index that `spec` names.

    Args:
        spec: an `index.json` path/URL (its compact companion `index.compact` is read instead
            when there is one: `hpctrain.data.node_index`); an `index.compact` (that form,
            checked against its JSON); a folder or URL holding `index.json`; or a shard
            pattern such as `dir/train-{000000..000009}.tar` (or one `.tar`), whose shards
            are then read once to count their samples. `pipe:COMMAND` (braces expanded,
            one command per shard) only with `allow_pipe`.
        storage_options: fsspec options (credentials, endpoint_url) for remote specs.
        allow_pipe: `spec` comes from the user's own config or command line and opted in
            to shell commands (`data.allow_pipe`). An index's entries never may.

    Raises:
        ShardIndexError: no index there, an unreadable one, or one without samples (the
            message names the URL).
    """
    if spec.startswith("pipe:"):
        if not allow_pipe:
            raise ShardIndexError(f"{pipe_label(spec)}: {PIPE_RULE}")
        return _require_samples(_count_pattern(spec, storage_options, allow_pipe=True), spec)
    if spec.endswith(".json"):
        return _require_samples(load_index(spec, storage_options), spec)
    if spec.endswith(COMPACT_SUFFIX):
        return _require_samples(load_index(json_of(spec), storage_options, form="compact"), spec)
    if spec.endswith(".tar") or _BRACE.search(spec):
        return _require_samples(_count_pattern(spec, storage_options, allow_pipe=False), spec)
    url = f"{spec.rstrip('/')}/{INDEX_NAME}"
    return _require_samples(load_index(url, storage_options), url)


def _require_samples(index: ShardIndex, spec: str) -> ShardIndex:
    """Every reader of an index (train, val, a mixture source, eval, predict, plan) needs a
    sample: an empty index is the user's data, named here, not a loader's traceback."""
    where = pipe_label(spec) if spec.startswith("pipe:") else redact_url(spec)
    if not index.shards:
        raise ShardIndexError(f'{where}: the index lists no shards ("shards": [])')
    if index.num_samples == 0:
        raise ShardIndexError(f"{where}: the index's {index.num_shards} shard(s) hold no samples")
    return index


def _count_pattern(
    spec: str, storage_options: dict[str, Any] | None, *, allow_pipe: bool
) -> ShardIndex:
    """An index of the shards a pattern names, their samples counted by reading them."""
    urls = expand_braces(spec)
    shards = []
    for url in urls:
        try:
            num_samples = count_samples(url, storage_options, allow_pipe=allow_pipe)
            size = _size(url, storage_options)
        except ShardUnavailableError:
            raise  # an outage, not the pattern's fault: exit 8, retried
        except ShardReadError as exc:
            raise ShardIndexError(str(exc)) from None
        shards.append(ShardInfo(url=url, num_samples=num_samples, num_bytes=size))
    return ShardIndex(
        shards=tuple(shards), command=f"pattern {pipe_label(spec) if allow_pipe else spec}"
    )


def _size(url: str, storage_options: dict[str, Any] | None) -> int:
    if url.startswith("pipe:"):
        return 0
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        return int(fs.size(path) or 0)
    except Exception:  # some servers do not report sizes; the size only guards truncation
        return 0
