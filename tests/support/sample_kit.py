"""Multi-field test samples: encoders for every default decoder, and a decompression bomb."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import torch
from PIL import Image


def png(array: np.ndarray, mode: str | None = None, palette: list[int] | None = None) -> bytes:
    """PNG bytes of `array` (HxW grey/palette/16-bit, or HxWx3 colour)."""
    image = Image.fromarray(array, mode=mode) if mode else Image.fromarray(array)
    if palette is not None:
        image.putpalette(palette)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def jpeg(array: np.ndarray, quality: int = 90) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def encoded(image_format: str, array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=image_format)
    return out.getvalue()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def torch_bytes(value: object) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def palette_mask(seed: int, height: int = 6, width: int = 5, classes: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, (height, width), dtype=np.uint8)


PALETTE = [v for i in range(256) for v in ((i * 37) % 256, (i * 91) % 256, (i * 13) % 256)]


def rgb(seed: int, height: int = 6, width: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def multi_field_members(seed: int) -> dict[str, bytes]:
    """One sample with every kind of field the round-trip tests check (sizes fixed, so that
    the default collate stacks them): `img.jpg`, `mask.png` (palette), `depth.npy`, `json`,
    `txt`, `left.jpg`/`right.jpg`, `cls`."""
    return {
        "img.jpg": jpeg(rgb(seed)),
        "mask.png": png(palette_mask(seed), mode="P", palette=PALETTE),
        "depth.npy": npy(np.random.default_rng(seed).random((6, 5), dtype=np.float32)),
        "json": json.dumps({"seed": seed, "tags": ["a", str(seed)]}).encode(),
        "txt": f"caption {seed} – ünïcode".encode(),
        "left.jpg": jpeg(rgb(seed + 1)),
        "right.jpg": jpeg(rgb(seed + 2)),
        "cls": str(seed % 7).encode(),
    }


def bomb_png(side: int = 16_000) -> bytes:
    """A `side`x`side` 8-bit grey PNG of zeros: ~250 KB that would decode to side**2 bytes
    (256 MB; 768 MB as RGB). Written chunk by chunk, never holding the pixels."""
    compressor = zlib.compressobj(9)
    row = b"\0" * (side + 1)  # filter byte + pixels
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def multi_key(shard: int, index: int) -> str:
    return f"m{shard:03d}-{index:04d}"


def seed_of(key: str) -> int:
    shard, index = key[1:].split("-")
    return int(shard) * 1000 + int(index)


def write_multi_field_shards(
    root, sizes: list[int], *, replace: dict[str, dict[str, bytes]] | None = None
):
    """Shards `root/multi-000000.tar`... of `multi_field_members` samples written with
    webdataset's TarWriter, and `root/index.json`. `replace`: {key: {field: bytes}} members
    to put in place of (or beside) the generated ones (a bomb, a broken mask...)."""
    from pathlib import Path

    import webdataset

    from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    infos = []
    for shard, n in enumerate(sizes):
        name = f"multi-{shard:06d}.tar"
        with webdataset.TarWriter(str(root / name)) as sink:
            for i in range(n):
                key = multi_key(shard, i)
                members = multi_field_members(seed_of(key))
                members.update((replace or {}).get(key, {}))
                sink.write({"__key__": key, **members})
        infos.append(ShardInfo(url=name, num_samples=n, num_bytes=(root / name).stat().st_size))
    index = ShardIndex(shards=tuple(infos), base_url=str(root))
    (root / "index.json").write_bytes(index_to_bytes(index))
    return index


def expected_fields(key: str) -> dict[str, object]:
    """What the default decoders must give for `key`'s sample: the source values exactly
    (JPEG fields: the source bytes decoded by the same decoder)."""
    from hpctrain.data.decode import decode_field

    seed = seed_of(key)
    members = multi_field_members(seed)
    return {
        "img.jpg": decode_field("img.jpg", members["img.jpg"]),
        "left.jpg": decode_field("left.jpg", members["left.jpg"]),
        "right.jpg": decode_field("right.jpg", members["right.jpg"]),
        "mask.png": torch.from_numpy(palette_mask(seed)),
        "depth.npy": torch.from_numpy(np.random.default_rng(seed).random((6, 5), dtype=np.float32)),
        "json": {"seed": seed, "tags": ["a", str(seed)]},
        "txt": f"caption {seed} – ünïcode",
        "cls": seed % 7,
    }


def field_mismatches(batch: dict[str, object]) -> list[str]:
    """Every (key, field) of `batch` whose value differs from `expected_fields`."""
    wrong = []
    keys = batch["key"]
    for pos, key in enumerate(keys):  # type: ignore[arg-type]
        for name, expected in expected_fields(key).items():
            got = batch[name][pos]  # type: ignore[index]
            if isinstance(expected, torch.Tensor):
                same = got.dtype == expected.dtype and torch.equal(got, expected)
            elif isinstance(got, torch.Tensor):
                same = got.item() == expected
            else:
                same = got == expected
            if not same:
                wrong.append(f"{key}:{name}")
    return wrong
