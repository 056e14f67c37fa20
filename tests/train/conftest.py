"""Shared fixtures for training tests: real shards made by the project's own tools."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
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


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    """In-process trainers switch on process-wide modes (deterministic algorithms)."""
    import torch

    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)
