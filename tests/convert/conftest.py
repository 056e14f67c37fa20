"""Fixtures for the convert tests: small image folders built in tmp_path."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

CLASSES = ("cat", "dog", "eel")


def image_bytes(seed: int, fmt: str = "JPEG", size: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def make_image_folder(root: Path, per_class: int = 8, size: int = 16) -> Path:
    """root/<class>/<n>.jpg for CLASSES, plus one PNG in the last class."""
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"img{i:03d}.jpg").write_bytes(image_bytes(100 * c + i, size=size))
    (root / CLASSES[-1] / "zz.png").write_bytes(image_bytes(999, "PNG", size=size))
    return root


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path / "images")
