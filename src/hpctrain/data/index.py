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
      "command": "hpctrain convert ...",
      "extra": {...}
    }

Shard URLs are relative to the folder holding the index (or absolute URLs).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec

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


@dataclass(frozen=True)
class ShardIndex:
    shards: tuple[ShardInfo, ...]
    base_url: str = ""  # folder the relative shard URLs are resolved against
    class_names: tuple[str, ...] = ()
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    def shard_url(self, i: int) -> str:
        """The absolute URL (or local path) of shard `i`."""
        return join_url(self.base_url, self.shards[i].url)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "class_names": list(self.class_names),
            "shards": [
                {
                    "url": s.url,
                    "num_samples": s.num_samples,
                    "num_bytes": s.num_bytes,
                    "sha256": s.sha256,
                }
                for s in self.shards
            ],
            "command": self.command,
            "extra": self.extra,
        }


def is_absolute_url(url: str) -> bool:
    return "://" in url or url.startswith("/") or url.startswith("pipe:")


def join_url(base: str, url: str) -> str:
    if not base or is_absolute_url(url):
        return url
    return (
        posixpath.join(base.rstrip("/"), url) if "://" in base else str(posixpath.join(base, url))
    )


def parse_index(data: Any, index_url: str) -> ShardIndex:
    """Validate the decoded JSON of an index; errors name `index_url`."""
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise ShardIndexError(
            f"{index_url}: not an hpctrain shard index (missing format={INDEX_FORMAT!r})"
        )
    if data.get("version") != INDEX_VERSION:
        raise ShardIndexError(
            f"{index_url}: unsupported index version {data.get('version')!r} (this hpctrain reads {INDEX_VERSION})"
        )
    shards = []
    for i, entry in enumerate(data.get("shards", [])):
        try:
            shards.append(
                ShardInfo(
                    url=str(entry["url"]),
                    num_samples=int(entry["num_samples"]),
                    num_bytes=int(entry.get("num_bytes", 0)),
                    sha256=str(entry.get("sha256", "")),
                )
            )
        except (KeyError, TypeError, ValueError):
            raise ShardIndexError(f"{index_url}: shard entry {i} lacks url/num_samples") from None
    base = index_url.rsplit("/", 1)[0] if "/" in index_url else ""
    return ShardIndex(
        shards=tuple(shards),
        base_url=base,
        class_names=tuple(data.get("class_names", ())),
        command=str(data.get("command", "")),
        extra=dict(data.get("extra", {})),
    )


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
