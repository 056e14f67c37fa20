"""The Makefile's install recipes, as `make -n` prints them (nothing is installed here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def recipe(*args: str) -> str:
    """What `make -n -B ARGS` would run (the stamps' recipes), run nothing."""
    done = subprocess.run(
        ["make", "-n", "-B", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return done.stdout + done.stderr


def test_torch_cpu_installs_torch_and_torchvision_from_pytorch_s_cpu_index_first() -> None:
    for stamp, extras in ((".venv/.runtime-stamp", "-e ."), (".venv/.installed-stamp", "'.[dev]'")):
        cpu = recipe(stamp, "TORCH=cpu")
        assert f"{CPU_INDEX} 'torch>=2.6' 'torchvision>=0.21' && " in cpu, cpu
        assert cpu.index(CPU_INDEX) < cpu.index(extras)  # pip then keeps the CPU builds
        assert 'python -c "import torchvision"' in cpu  # a CUDA torchvision fails here
        assert CPU_INDEX not in recipe(stamp)


def test_an_unknown_torch_is_refused_and_the_pip_wait_is_announced() -> None:
    assert "TORCH=gpu: only TORCH=cpu is known" in recipe("demo", "TORCH=gpu")
    text = recipe(".venv/.runtime-stamp")
    assert "no NVIDIA driver here" in text and "PIP_QUIET" in text
