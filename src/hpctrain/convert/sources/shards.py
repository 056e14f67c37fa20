"""Existing WebDataset shards (an index, a folder of .tar, a brace pattern or one .tar), for
re-sharding: keys kept, each sample's members located by their offsets in the tar."""

from __future__ import annotations

import posixpath
import tarfile

import fsspec

from hpctrain.convert.errors import ConvertError
from hpctrain.convert.sources.base import (
    ListOptions,
    SampleRef,
    Source,
    fs_and_path,
    full_url,
    unsafe_key,
)
from hpctrain.data.index import INDEX_NAME, read_index, redact_url


def _split_member_name(name: str) -> tuple[str | None, str]:
    """(key, extension) as webdataset splits a member name: at the first dot of the basename."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return None, ""
    return name[:dot], name[dot + 1 :]


def shard_urls(src: str) -> tuple[list[str], tuple[str, ...]]:
    """Shard URLs of a shard source (index, folder of .tar, brace pattern or one .tar), and class names."""
    import braceexpand  # a webdataset dependency; imported here so listing folders does not need it

    fs, path = fs_and_path(src)
    if src.endswith(INDEX_NAME) or (fs.isdir(path) and fs.exists(posixpath.join(path, INDEX_NAME))):
        index_url = src if src.endswith(INDEX_NAME) else src.rstrip("/") + "/" + INDEX_NAME
        index = read_index(index_url)
        return [index.shard_url(i) for i in range(len(index.shards))], index.class_names
    if "{" in src:
        return list(braceexpand.braceexpand(src)), ()
    if fs.isdir(path):
        tars = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".tar"))
        if not tars:
            raise ConvertError(f"{redact_url(src)}: no .tar shards")
        return [full_url(fs, p) for p in tars], ()
    return [src], ()


def list_shards(src: str, options: ListOptions | None = None) -> Source:
    """Samples of existing WebDataset shards (for re-sharding), keys kept, members located by
    offset. No `options` apply to shards."""
    urls, class_names = shard_urls(src)
    samples: list[SampleRef] = []
    for url in urls:
        try:
            with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                members = [(m.name, m.offset_data, m.size) for m in tar if m.isreg()]
        except FileNotFoundError:
            raise ConvertError(f"{redact_url(url)}: shard not found") from None
        except tarfile.TarError as exc:
            raise ConvertError(f"{redact_url(url)}: not a readable tar: {exc}") from None
        current: str | None = None
        group: list[tuple[str, int, int]] = []
        for name, offset, size in [*members, (None, 0, 0)]:
            key, ext = _split_member_name(name) if name is not None else (None, "")
            if name is not None and key is None:
                continue
            if key != current or name is None:
                if current is not None and group:
                    if unsafe_key(current.removeprefix("./")):
                        raise ConvertError(
                            f"{redact_url(url)}: key {current!r} has a '..', '.' or empty part "
                            "or is absolute: its members would lie outside the folder"
                        )
                    samples.append(
                        SampleRef(
                            key=current.removeprefix("./"),
                            url=url,
                            size=sum(s + 512 for _, _, s in group),
                            members=tuple(group),
                        )
                    )
                current, group = key, []
            if name is not None:
                group.append((ext.lower(), offset, size))
    if not samples:
        raise ConvertError(f"{redact_url(src)}: no samples in the shards")
    return Source("shards", tuple(samples), class_names)
