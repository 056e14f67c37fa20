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
