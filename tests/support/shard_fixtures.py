"""Session-wide shard fixtures, registered once from tests/conftest.py (`pytest_plugins`).

They live here, not in a package's conftest: a fixture imported into a second conftest is a
second fixture to pytest, with its own session cache, so the shards were built once per
conftest that re-exported them (three times for `shapes_shards` in one CI session).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shapes_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 generated 32 px shape images → `hpctrain convert` → DIR/train and DIR/val shards."""
    root = tmp_path_factory.mktemp("shapes")
    images, shards = root / "images", root / "shards"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "make_demo_data.py"),
            str(images),
            "--num-images",
            "400",
            "--size",
            "32",
            "--seed",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctrain",
            "convert",
            str(images),
            str(shards),
            "--val-fraction",
            "0.2",
            "--samples-per-shard",
            "40",
            "--shuffle",
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    assert (shards / "train" / "index.json").exists() and (shards / "val" / "index.json").exists()
    return shards


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 generated 32 px shape images → `hpctrain convert` → DIR/train and DIR/val shards
    (the SLURM tier's)."""
    root = tmp_path_factory.mktemp("slurm-shards")
    images, shards = root / "images", root / "shards"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_demo_data.py"), str(images),
         "--num-images", "240", "--size", "32", "--seed", "1"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "hpctrain", "convert", str(images), str(shards),
         "--val-fraction", "0.2", "--samples-per-shard", "24", "--shuffle", "--seed", "0"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return shards
