"""The shard index (`index.json`): what every loader and the epoch plan read.

Format (version 1)::

    {
      "format": "hpctrain-shards", "version": 1,
      "num_samples": 1200, "num_bytes": 73400320,
      "class_names": ["circle", "square", ...],
      "shards": [
        {"url": "train-000000.tar", "num_samples": 100, "num_bytes": 6113280, "sha256": "..."},
        ...
      ],
      "tokenizer": {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""},
      "command": "hpctrain convert ...",
      "extra": {...}
    }

Shard URLs are relative to the folder holding the index (or absolute URLs).

Token shards (language models, `hpctrain.data.tokens`) add `"num_tokens"` to every shard entry
(the token ids its samples hold, end-of-document ids included) and a top-level `"tokenizer"`
object (name, vocab_size, eod_id, sha256 of the tokenizer file, "" for the built-in one).
Token shards with a loss mask (instruction data, `hpctrain.convert.instructions`) add
`"num_targets"` to every shard entry and the top level: the tokens the mask marks as targets.

An index is data, never code, and may come from anyone who can write or serve a dataset:
`parse_index` refuses `pipe:` entries (a shell command in every loader worker), entries of a
remote index that leave its filesystem (a local path or another protocol: an HTTP index
must not make every rank read `/etc/...` or a cloud metadata URL), and values that make no
sense (negative or non-integer counts, more samples than the bytes can hold), each error
naming the index and the key.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import fsspec
import numpy as np

from hpctrain.errors import DataError

INDEX_FORMAT = "hpctrain-shards"
INDEX_VERSION = 1
INDEX_NAME = "index.json"


class ShardIndexError(DataError, ValueError):
    """An index that cannot be read or does not describe shards (names the URL)."""


@dataclass(frozen=True)
class ShardInfo:
    url: str  # as written in the index: relative to the index folder, or absolute
    num_samples: int
    num_bytes: int = 0
    sha256: str = ""
    num_tokens: int | None = None  # token shards only: ids held, end-of-document ids included
    num_targets: int | None = None  # token shards with a loss mask: tokens marked as targets


COUNT_COLUMNS = ("num_samples", "num_bytes", "num_tokens", "num_targets")
Counts = Sequence[int] | np.ndarray  # per-shard counts: a tuple, or a column (int64)


class ShardTable(Sequence[ShardInfo]):
    """Shards held as columns rather than one `ShardInfo` per shard (the compact index,
    `hpctrain.data.compact`; a mixture's sources chained, `hpctrain.data.mixture_index`).

    What a rank needs at a million shards: a count column for the plan (one numpy array, no
    Python object per shard) and the URLs of the few shards it reads, made on demand.
    Indexing still gives a `ShardInfo`, so every reader of `ShardIndex.shards` works on it.
    """

    @abstractmethod
    def column(self, name: str) -> np.ndarray | None:
        """`name` (one of `COUNT_COLUMNS`) of every shard as int64, in index order; None
        when the shards lack it (token counts of a sample index)."""

    @abstractmethod
    def url(self, i: int) -> str:
        """Shard `i`'s URL as the index writes it (relative to the index folder, or absolute)."""

    @abstractmethod
    def resolved_urls(self, base: str) -> Sequence[str]:
        """Every shard's URL resolved against `base` (`join_url`), made when asked."""

    @abstractmethod
    def protocols(self, base: str) -> set[str]:
        """The `url_protocol` of every resolved shard URL (without making them all)."""

    def holds(self, name: str) -> bool:
        """Whether any shard records `name` (one of `COUNT_COLUMNS`)."""
        return self.column(name) is not None

    def sha256(self, i: int) -> str:
        return self[i].sha256

    def column_sha256(self) -> np.ndarray:
        """Every shard's sha256 as raw bytes, uint8 [num_shards, 32] (zeros: none recorded)."""
        out = np.zeros((len(self), 32), dtype=np.uint8)
        for i in range(len(self)):
            digest = self.sha256(i)
            if len(digest) == 64:
                out[i] = np.frombuffer(bytes.fromhex(digest), dtype=np.uint8)
        return out

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ShardInfo]: ...

    def __getitem__(self, i: int | slice) -> ShardInfo | Sequence[ShardInfo]:
        if isinstance(i, slice):
            return [self.info(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {i} of {n}")
        return self.info(i % n)

    @abstractmethod
    def info(self, i: int) -> ShardInfo:
        """Shard `i` (0 <= i < len) as one record."""


@dataclass(frozen=True)
class ShardIndex:
    shards: Sequence[ShardInfo]  # a tuple (index.json) or a `ShardTable` (the compact form)
    base_url: str = ""  # folder the relative shard URLs are resolved against
    class_names: tuple[str, ...] = ()
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] | None = None  # token shards: name, vocab_size, eod_id, sha256

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def counts(self, name: str) -> np.ndarray | None:
        """Column `name` (`COUNT_COLUMNS`: num_samples, num_bytes, num_tokens, num_targets)
        of every shard, int64 in index order; None when a shard lacks it.

        From the compact form, a read-only view of its mapped column: no copy, no Python
        object per shard (what the plan reads at a million shards).
        """
        if isinstance(self.shards, ShardTable):
            return self.shards.column(name)
        values = [getattr(s, name) for s in self.shards]
        if any(v is None for v in values):
            return None
        return np.fromiter(values, dtype=np.int64, count=len(values))

    def holds(self, name: str) -> bool:
        """Whether any shard records `name` (one of `COUNT_COLUMNS`; token counts)."""
        if isinstance(self.shards, ShardTable):
            return self.shards.holds(name)
        return any(getattr(s, name) is not None for s in self.shards)

    def _total(self, name: str) -> int | None:
        column = self.counts(name)
        return None if column is None else int(column.sum())

    @property
    def num_tokens(self) -> int | None:
        """Token ids in all shards, or None when this is not a token index."""
        return self._total("num_tokens") if self.shards else None

    @property
    def num_targets(self) -> int | None:
        """Target tokens of the loss mask in all shards, or None when the shards have none."""
        return self._total("num_targets") if self.shards else None

    @property
    def num_samples(self) -> int:
        return self._total("num_samples") or 0

    @property
    def num_bytes(self) -> int:
        return self._total("num_bytes") or 0

    def shard_url(self, i: int) -> str:
        """The absolute URL (or local path) of shard `i`."""
        if isinstance(self.shards, ShardTable):
            return join_url(self.base_url, self.shards.url(i))
        return join_url(self.base_url, self.shards[i].url)

    def shard_urls(self) -> Sequence[str]:
        """`shard_url(i)` of every shard: a tuple from index.json, made on demand from the
        compact form (a rank reads a few hundred of a million)."""
        if isinstance(self.shards, ShardTable):
            return self.shards.resolved_urls(self.base_url)
        return resolve_urls(self.base_url, [s.url for s in self.shards])

    def written_urls(self) -> Sequence[str]:
        """Every shard's URL as the index writes it (relative ones unresolved)."""
        if isinstance(self.shards, ShardTable):
            return self.shards.resolved_urls("")
        return [s.url for s in self.shards]

    def url_protocols(self) -> set[str]:
        """The protocols of the shard URLs (`url_protocol`: file, http, s3, pipe...)."""
        if isinstance(self.shards, ShardTable):
            return self.shards.protocols(self.base_url)
        return {url_protocol(url) for url in self.shard_urls()}

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "class_names": list(self.class_names),
            "shards": [_shard_json(s) for s in self.shards],
        }
        if self.num_tokens is not None:
            data["num_tokens"] = self.num_tokens
        if self.num_targets is not None:
            data["num_targets"] = self.num_targets
        if self.tokenizer is not None:
            data["tokenizer"] = dict(self.tokenizer)
        data["command"] = self.command
        data["extra"] = self.extra
        return data


def _shard_json(s: ShardInfo) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "url": s.url,
        "num_samples": s.num_samples,
        "num_bytes": s.num_bytes,
        "sha256": s.sha256,
    }
    if s.num_tokens is not None:
        entry["num_tokens"] = s.num_tokens
    if s.num_targets is not None:
        entry["num_targets"] = s.num_targets
    return entry


def resolve_urls(base: str, urls: Sequence[str]) -> tuple[str, ...]:
    """`join_url(base, url)` of every URL (its rule inlined: at 100k shards the call per shard
    is a noticeable share of `hpctrain plan`)."""
    if not base:
        return tuple(urls)
    prefix = base.rstrip("/") + "/"
    return tuple(
        url if "://" in url or url[:1] == "/" or url.startswith("pipe:") else prefix + url
        for url in urls
    )


def is_absolute_url(url: str) -> bool:
    return "://" in url or url.startswith("/") or url.startswith("pipe:")


def join_url(base: str, url: str) -> str:
    if not base or is_absolute_url(url):
        return url
    return (
        posixpath.join(base.rstrip("/"), url) if "://" in base else str(posixpath.join(base, url))
    )


_SHA256 = re.compile(r"[0-9a-f]{64}")
TAR_BLOCK = 512  # the least a sample takes in a tar file: one header


def url_protocol(url: str) -> str:
    """`s3://b/x` -> s3, `/x` or `x` -> file, `pipe:cmd` -> pipe; http and https are one."""
    if url.lstrip().lower().startswith("pipe:"):
        return "pipe"
    last = url.rsplit("::", 1)[-1]  # fsspec chains (simplecache::s3://...): the data's own
    scheme = last.split("://", 1)[0].lower() if "://" in last else "file"
    return "http" if scheme == "https" else scheme


def _count(value: Any, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShardIndexError(f"{where}: {key} = {value!r}: must be a whole number >= 0")
    return value


def check_shard_url(url: Any, key: str, where: str, protocol: str) -> None:
    """Refuse a shard URL an index may not hold (the module doc); `protocol`: the index's."""
    if not isinstance(url, str) or not url.strip() or not url.isprintable():
        raise ShardIndexError(f"{where}: {key} must be a non-empty printable string")
    # a relative path without any ':' has no scheme, pipe or chain: the checks below pass
    # (skipping them is a fifth of `hpctrain plan` at 100k shards)
    relative = ":" not in url and url[:1] != "/"
    if not relative and url_protocol(url) == "pipe":
        # the command is not shown: it is not ours to print (it may hold a token)
        raise ShardIndexError(
            f"{where}: {key} is a pipe: command; an index may name only files and URLs "
            "(pipe: shards come only from a pattern in data.train/data.val with "
            "data.allow_pipe: true)"
        )
    absolute = not relative and (is_absolute_url(url) or "::" in url)  # "::": a chain
    if protocol != "file" and absolute and ("::" in url or url_protocol(url) != protocol):
        raise ShardIndexError(
            f"{where}: {key} = {redact_url(url)!r} leaves the index's filesystem: a "
            f"{protocol} index may name only relative paths or {protocol} URLs"
        )


def _shard_info(entry: Any, i: int, where: str, protocol: str) -> ShardInfo:
    key = f"shards[{i}]"
    if not isinstance(entry, dict):
        raise ShardIndexError(f"{where}: {key} must be an object with url and num_samples")
    url = entry.get("url")
    check_shard_url(url, f"{key}.url", where, protocol)
    if "num_samples" not in entry:
        raise ShardIndexError(f"{where}: {key} lacks num_samples")
    num_samples = _count(entry["num_samples"], where, f"{key}.num_samples")
    num_bytes = _count(entry.get("num_bytes", 0), where, f"{key}.num_bytes")
    if num_bytes and num_samples * TAR_BLOCK > num_bytes:
        raise ShardIndexError(
            f"{where}: {key}.num_samples = {num_samples} cannot fit in its num_bytes = "
            f"{num_bytes} (a sample takes at least {TAR_BLOCK} bytes)"
        )
    sha256 = entry.get("sha256", "")
    if not isinstance(sha256, str) or (sha256 and not _SHA256.fullmatch(sha256)):
        raise ShardIndexError(f"{where}: {key}.sha256 must be 64 lowercase hex digits or empty")
    num_tokens = None
    if "num_tokens" in entry:
        num_tokens = _count(entry["num_tokens"], where, f"{key}.num_tokens")
    num_targets = None
    if "num_targets" in entry:
        num_targets = _count(entry["num_targets"], where, f"{key}.num_targets")
        if num_tokens is None or num_targets > num_tokens:
            raise ShardIndexError(
                f"{where}: {key}.num_targets = {num_targets} must not exceed its num_tokens"
            )
    assert isinstance(url, str)  # check_shard_url refuses anything else
    return ShardInfo(
        url=url,
        num_samples=num_samples,
        num_bytes=num_bytes,
        sha256=sha256,
        num_tokens=num_tokens,
        num_targets=num_targets,
    )


TOKENIZER_KEYS = {"name": str, "vocab_size": int, "eod_id": int, "sha256": str}


def _tokenizer(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ShardIndexError(f"{where}: tokenizer must be an object")
    for name, kind in TOKENIZER_KEYS.items():
        v = value.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ShardIndexError(f"{where}: tokenizer.{name} must be a {kind.__name__}")
    if value["vocab_size"] < 1 or not 0 <= value["eod_id"] < value["vocab_size"]:
        raise ShardIndexError(
            f"{where}: tokenizer.eod_id = {value['eod_id']} must lie in [0, vocab_size = "
            f"{value['vocab_size']})"
        )
    return dict(value)


def parse_index(data: Any, index_url: str) -> ShardIndex:
    """Validate the decoded JSON of an index; errors name `index_url` and the key at fault."""
    where = redact_url(index_url)
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise ShardIndexError(
            f"{where}: not an hpctrain shard index (missing format={INDEX_FORMAT!r})"
        )
    if data.get("version") != INDEX_VERSION:
        raise ShardIndexError(
            f"{where}: unsupported index version {data.get('version')!r} (this hpctrain reads {INDEX_VERSION})"
        )
    entries = data.get("shards", [])
    if not isinstance(entries, list):
        raise ShardIndexError(f"{where}: shards must be a list")
    protocol = url_protocol(index_url)
    shards = [_shard_info(entry, i, where, protocol) for i, entry in enumerate(entries)]
    totals = [
        ("num_samples", sum(s.num_samples for s in shards)),
        ("num_bytes", sum(s.num_bytes for s in shards)),
    ]
    if "num_tokens" in data:
        if any(s.num_tokens is None for s in shards):
            raise ShardIndexError(f"{where}: num_tokens is given but not for every shard")
        totals.append(("num_tokens", sum(s.num_tokens or 0 for s in shards)))
    if "num_targets" in data:
        if any(s.num_targets is None for s in shards):
            raise ShardIndexError(f"{where}: num_targets is given but not for every shard")
        totals.append(("num_targets", sum(s.num_targets or 0 for s in shards)))
    for key, total in totals:
        if key in data and _count(data[key], where, key) != total:
            raise ShardIndexError(f"{where}: {key} = {data[key]} but its shards add up to {total}")
    return ShardIndex(
        shards=tuple(shards), base_url=base_url_of(index_url), **described(data, where)
    )


def base_url_of(index_url: str) -> str:
    """The folder an index's relative shard URLs are resolved against."""
    return index_url.rsplit("/", 1)[0] if "/" in index_url else ""


def described(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The checked top-level keys of an index besides its shards: class_names, command,
    extra and tokenizer, as `ShardIndex` takes them (the compact form's header holds them too)."""
    class_names = data.get("class_names", [])
    if not isinstance(class_names, list) or not all(isinstance(c, str) for c in class_names):
        raise ShardIndexError(f"{where}: class_names must be a list of strings")
    extra = data.get("extra", {})
    if not isinstance(extra, dict):
        raise ShardIndexError(f"{where}: extra must be an object")
    tokenizer = _tokenizer(data["tokenizer"], where) if "tokenizer" in data else None
    return {
        "class_names": tuple(class_names),
        "command": str(data.get("command", "")),
        "extra": dict(extra),
        "tokenizer": tokenizer,
    }


def read_index(index_url: str, storage_options: dict[str, Any] | None = None) -> ShardIndex:
    """Read `index.json` from a local path or any fsspec URL."""
    try:
        with fsspec.open(index_url, "rb", **(storage_options or {})) as f:
            raw = f.read()
    except FileNotFoundError:
        raise ShardIndexError(f"{redact_url(index_url)}: index not found") from None
    except OSError as exc:
        raise ShardIndexError(f"{redact_url(index_url)}: cannot read index: {exc}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise ShardIndexError(f"{redact_url(index_url)}: not valid JSON") from None
    return parse_index(data, index_url)


def shards_digest(shards: Sequence[ShardInfo]) -> str:
    """What identifies the samples of a shard list, for a loader state to check a resume
    against: a sha256 over every shard's counts (samples, bytes, tokens, targets) and sha256,
    and the file name of each shard without a sha256, in order; not over where the shards
    lie, so a copy of the data elsewhere (`$SCRATCH`, a node's disk) resumes as the original.

    The same bytes are hashed whether the shards come from index.json or its compact form;
    from the compact form nothing is made per shard (its columns are hashed as they lie), so
    a million-shard index costs a rank milliseconds here, not seconds.
    """
    n = len(shards)
    digest = hashlib.sha256()
    table = shards if isinstance(shards, ShardTable) else None
    for name in COUNT_COLUMNS:
        if table is not None:
            column = table.column(name)
        else:
            values = [getattr(s, name) for s in shards]
            column = None if any(v is None for v in values) else np.asarray(values, np.int64)
        raw = b"-" if column is None else np.ascontiguousarray(column, dtype="<i8").tobytes()
        digest.update(name.encode() + b":" + raw + b"\n")
    if table is not None:
        hashes = np.asarray(table.column_sha256(), dtype=np.uint8).reshape(n, 32)
    else:
        hashes = np.zeros((n, 32), dtype=np.uint8)
        for i, s in enumerate(shards):
            if len(s.sha256) == 64:
                hashes[i] = np.frombuffer(bytes.fromhex(s.sha256), dtype=np.uint8)
    digest.update(b"sha256:" + hashes.tobytes() + b"\n")
    for i in np.flatnonzero(~hashes.any(axis=1)).tolist():  # no sha256: the file name instead
        url = table.url(i) if table is not None else shards[i].url
        digest.update(f"{i}:{posixpath.basename(url.split('?', 1)[0])}\n".encode())
    return digest.hexdigest()


def index_to_bytes(index: ShardIndex) -> bytes:
    """Deterministic JSON bytes of an index (sorted keys are not used: field order is the format's)."""
    return (json.dumps(index.to_json(), indent=1) + "\n").encode()


def redact_url(url: str) -> str:
    """A URL safe to print: user:password@ and query strings (tokens, signatures) removed."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host_and_path = rest.split("@", 1)[-1] if "@" in rest.split("/", 1)[0] else rest
    host_and_path = host_and_path.split("?", 1)[0]
    return f"{scheme}://{host_and_path}"
