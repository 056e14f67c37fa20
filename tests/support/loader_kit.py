"""Test shards: tiny PNG images in plain tar files, with an index.json beside them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes


def image_bytes(value: int, size: int = 8, fmt: str = "PNG") -> bytes:
    """An image whose first pixel encodes `value` (PNG: lossless, so tests can read it back)."""
    rng = np.random.default_rng(value)
    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    pixels[0, 0] = [value % 256, (value // 256) % 256, (value // 65536) % 256]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def sample_key(shard: int, index: int) -> str:
    return f"s{shard:04d}-{index:05d}"


def write_shard(
    path: Path,
    shard: int,
    num_samples: int,
    *,
    fmt: int = tarfile.USTAR_FORMAT,
    image_format: str = "PNG",
    with_json: bool = False,
) -> None:
    ext = "png" if image_format == "PNG" else "jpg"
    with tarfile.open(path, "w", format=fmt) as tar:
        for i in range(num_samples):
            key = sample_key(shard, i)
            members = {
                ext: image_bytes(shard * 1000 + i, fmt=image_format),
                "cls": str((shard * 1000 + i) % 7).encode(),
            }
            if with_json:
                members["json"] = json.dumps({"shard": shard, "i": i}).encode()
            for e, data in members.items():
                info = tarfile.TarInfo(f"{key}.{e}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))


def make_shards(
    root: Path, sizes: list[int], *, prefix: str = "train", **kwargs: object
) -> ShardIndex:
    """Shards `root/<prefix>-000000.tar`... with `sizes[i]` samples, and `root/index.json`."""
    root.mkdir(parents=True, exist_ok=True)
    infos = []
    for shard, n in enumerate(sizes):
        name = f"{prefix}-{shard:06d}.tar"
        write_shard(root / name, shard, n, **kwargs)  # type: ignore[arg-type]
        infos.append(ShardInfo(url=name, num_samples=n, num_bytes=(root / name).stat().st_size))
    index = ShardIndex(shards=tuple(infos), base_url=str(root), class_names=tuple("abcdefg"))
    (root / "index.json").write_bytes(index_to_bytes(index))
    return index


def all_keys(sizes: list[int]) -> set[str]:
    return {sample_key(s, i) for s, n in enumerate(sizes) for i in range(n)}
