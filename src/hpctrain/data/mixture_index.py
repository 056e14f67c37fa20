"""Opening a mixture's sources: their indexes, checked to mix, as one shard list.

`open_train_index` opens `data.train`: one index (a string) or a mixture (a list of sources,
`open_mixture`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain.data.index import ShardIndex, ShardInfo, ShardTable, shards_digest
from hpctrain.data.locate import open_index
from hpctrain.data.mixture import Mixture, MixtureError, Source


def check_compatible(names: Sequence[str], indexes: Sequence[Any]) -> None:
    """Sources must agree on the sample kind (token shards or not), the tokenizer and the
    class names; checked before any work, naming both sources."""
    first = indexes[0]

    def kind(index: Any) -> str:
        return "token shards" if getattr(index, "tokenizer", None) is not None else "samples"

    for name, index in zip(names[1:], indexes[1:], strict=True):
        where = f"data.train: sources {names[0]!r} and {name!r}"
        if kind(index) != kind(first):
            raise MixtureError(
                f"{where} hold different sample kinds ({kind(first)}, {kind(index)})"
            )
        if getattr(index, "tokenizer", None) != getattr(first, "tokenizer", None):
            raise MixtureError(
                f"{where} use different tokenizers ({first.tokenizer}, {index.tokenizer})"
            )
        if first.class_names and index.class_names and first.class_names != index.class_names:
            raise MixtureError(f"{where} name different classes")


def _folders(path: str) -> list[str]:
    """The path's components, a trailing `*.json` (the index file) left out."""
    parts = [p for p in path.rstrip("/").split("/") if p]
    if parts and parts[-1].endswith(".json") and len(parts) > 1:
        parts = parts[:-1]
    return parts


def default_name(path: str) -> str:
    """A source's name from its path: the folder holding the index (`.../web/index.json`
    → web), else the last path component."""
    parts = _folders(path)
    return os.path.basename(parts[-1]) if parts else path


def source_names(sources: Sequence[Any]) -> list[str]:
    """Each source's name (`name`, `path` attributes): its own, else `default_name`; where
    two default names collide (`a/train` and `b/train`, as `convert --val-fraction` makes
    them), the folder above (`a`, `b`). Names still equal are refused by `Mixture`."""
    names = [src.name or default_name(src.path) for src in sources]
    counts = {n: names.count(n) for n in names}
    for i, src in enumerate(sources):
        parts = _folders(src.path)
        # a folder above, not the "s3:" of s3://train
        if not src.name and counts[names[i]] > 1 and len(parts) > 1 and parts[-2][-1:] != ":":
            names[i] = parts[-2]
    return names


class ChainedShards(ShardTable):
    """The shards of several indexes, one after another (a mixture's sources): columns are
    concatenated, URLs resolved against each source's own folder."""

    def __init__(self, indexes: Sequence[ShardIndex]) -> None:
        self.indexes = tuple(indexes)
        self.starts = np.cumsum([0, *(index.num_shards for index in self.indexes)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[ShardIndex, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.indexes[k], i - int(self.starts[k])

    def column(self, name: str) -> np.ndarray | None:
        parts = [index.counts(name) for index in self.indexes]
        if any(p is None for p in parts):
            return None
        return np.concatenate([p for p in parts if p is not None])

    def url(self, i: int) -> str:
        index, j = self._locate(i)
        return index.shard_url(j)  # resolved: the mixture has no folder of its own

    def info(self, i: int) -> ShardInfo:
        index, j = self._locate(i)
        return index.shards[j]

    def resolved_urls(self, base: str) -> Sequence[str]:
        parts = [index.shard_urls() for index in self.indexes]
        if all(isinstance(p, tuple) for p in parts):
            return tuple(url for p in parts for url in p)
        return _ChainedUrls(self)

    def holds(self, name: str) -> bool:
        return any(index.holds(name) for index in self.indexes)

    def protocols(self, base: str) -> set[str]:
        return set().union(*(index.url_protocols() for index in self.indexes))


class _ChainedUrls(Sequence[str]):
    def __init__(self, shards: ChainedShards) -> None:
        self.shards = shards

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.shards.url(i % len(self) if i < 0 else i)


@dataclass(frozen=True)
class MixtureIndex(ShardIndex):
    """The shards of every source of a mixture, chained (`ChainedShards`: URLs resolved),
    and the mixture that plans them. Class names and tokenizer are the sources' common ones."""

    mixture: Mixture | None = None


def open_mixture(
    sources: Sequence[Any],
    samples_per_epoch: int = 0,
    *,
    allow_pipe: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> MixtureIndex:
    """Open every source's index (`path`, `weight`, `name` attributes, as `SourceConfig`)
    and check they can be mixed, before any work."""
    indexes, parts = [], []
    names = source_names(sources)
    first = 0
    for i, (src, name) in enumerate(zip(sources, names, strict=True)):
        if not src.path:
            raise MixtureError(f"data.train[{i}].path is empty")
        index = open_index(src.path, storage_options, allow_pipe=allow_pipe)
        indexes.append(index)
        counts = index.counts("num_samples")
        assert counts is not None  # every shard has a sample count
        sizes = tuple(counts.tolist())
        parts.append(Source(name, float(src.weight), first, sizes, shards_digest(index.shards)))
        first += len(sizes)
    check_compatible(names, indexes)
    mixture = Mixture(tuple(parts), samples_per_epoch)
    return MixtureIndex(
        ChainedShards(indexes),
        class_names=indexes[0].class_names,
        tokenizer=indexes[0].tokenizer,
        extra=dict(indexes[0].extra),
        mixture=mixture,
    )


def open_train_index(data: Any) -> ShardIndex:
    """`data.train`'s shards: one index (a string) or a mixture (a list of sources)."""
    if isinstance(data.train, str):
        return open_index(data.train, allow_pipe=data.allow_pipe)
    return open_mixture(data.train, data.samples_per_epoch, allow_pipe=data.allow_pipe)


def describe(train: Any) -> str:
    """`data.train` for messages: the path, or the sources' paths."""
    return train if isinstance(train, str) else ", ".join(s.path for s in train)
