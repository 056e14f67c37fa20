"""Helpers for training tests: run `hpctrain` in fresh processes, as users do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train_args(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`hpctrain train` arguments for a tiny, fast CPU run on `shards`."""
    return [str(REPO / "configs" / "demo.yaml"), *tiny_run_overrides(shards, run_dir, *overrides)]


def tiny_run_overrides(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """Overrides of the demo config for a tiny, fast CPU run on `shards` (DIR/train, DIR/val)."""
    return [
        f"run_dir={run_dir}",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "data.batch_size=16",
        "data.workers_per_rank=1",
        "data.shuffle_buffer=32",
        "model.image_size=16",
        "train.log_every=1",
        "train.warmup_steps=0",
        *overrides,
    ]


def run_hpctrain(
    *args: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"hpctrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc
