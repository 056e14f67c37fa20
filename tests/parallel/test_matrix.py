"""Every strategy x precision x model x activation checkpointing, on this CPU with 2 gloo ranks.

One 2-rank job (`matrix_worker.py`) runs every cell of `matrix.py` in-process; each test here
asserts one cell: it trained (finite losses, a checkpoint, a fresh process group-mate resumed
from it) or it was refused up front with its documented one-line message and wrote nothing.
Then bf16 correctness: the bf16 loss stays within `BF16_TOLERANCE` of fp32 from the same seed
(DDP and FSDP2), and FSDP2-bf16 within it of DDP-bf16.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.matrix_kit import (
    GRID,
    MODELS,
    REFUSAL_CELLS,
    SLOW_MODELS,
    STRATEGIES,
    TOTAL_STEPS,
    Cell,
)
from tests.support.train_kit import REPO, run_two_ranks

# What this CPU (2 gloo ranks, no GPU) does with each cell: every grid cell trains; these are
# refused, with this line (docs/training.md: strategies and precisions).
REFUSED = {
    "none-fp32-small_cnn-noac-2ranks": r"^train\.strategy=none with 2 ranks: each rank would train its own diverging copy",
    "ddp-bf16-resnet18-noac-syncbn": r"^train\.sync_batchnorm=true with train\.strategy=ddp on cpu: torch's SyncBatchNorm runs on GPUs only",
    "fsdp-fp32-small_cnn-noac-syncbn": r"^train\.sync_batchnorm=true with train\.strategy=fsdp on cpu",
}
# |loss_bf16 - loss_fp32| <= BF16_TOLERANCE * loss_fp32 at every step, same seed and batches.
# bf16 keeps 8 bits of mantissa (~0.4 % per rounding); measured: at most 0.6 % (resnet18 DDP),
# 0.3 % FSDP2-bf16 vs DDP-bf16, 0.1 % for small_cnn and vit_tiny.
BF16_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Run the cells the selected tests need (all of them in CI) in one 2-rank job."""
    out = tmp_path_factory.mktemp("matrix")
    needed: set[str] = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or item.module is not request.module:
            continue
        if "cell" in callspec.params:
            needed.add(callspec.params["cell"].name)
        if "model" in callspec.params:
            needed.update(tolerance_cells(callspec.params["model"]))
    script = REPO / "tests" / "support" / "matrix_worker.py"
    run_two_ranks(script, str(shapes_shards), str(out), *sorted(needed), timeout=1500)
    return out / "results"


def tolerance_cells(model: str) -> list[str]:
    return [
        f"{strategy}-{precision}-{model}-{ac}"
        for strategy in STRATEGIES
        for precision in ("fp32", "bf16")
        for ac in ("noac", "ac")
    ]


def result(results: Path, name: str) -> dict[str, Any]:
    path = results / f"{name}.json"
    assert path.exists(), f"{name}: the worker wrote no result"
    outcome: dict[str, Any] = json.loads(path.read_text())
    return outcome


def params(cells: list[Cell]) -> list[Any]:
    return [
        pytest.param(cell, id=cell.name, marks=[pytest.mark.slow] if cell.slow else [])
        for cell in cells
    ]


@pytest.mark.distributed
@pytest.mark.timeout(1800)  # the first test also runs the whole matrix (fixture set-up)
@pytest.mark.parametrize("cell", params(GRID + REFUSAL_CELLS))
def test_cell_trains_and_resumes_or_is_refused_up_front(cell: Cell, results: Path) -> None:
    outcome = result(results, cell.name)
    if cell.name in REFUSED:
        assert outcome["outcome"] == "refused", outcome
        assert re.search(REFUSED[cell.name], outcome["message"]), outcome["message"]
        assert "\n" not in outcome["message"]
        assert not outcome["wrote"], "a refused run must not create its run folder"
        return
    assert outcome["outcome"] == "trained", outcome
    assert outcome["finite"], outcome["losses"]
    assert outcome["steps"] == list(range(1, TOTAL_STEPS + 1)), "the second Trainer did not resume"
    assert outcome["checkpoints"] == [f"step-{s}" for s in (1, TOTAL_STEPS)]


def losses(
    results: Path, strategy: str, precision: str, model: str, ac: str = "noac"
) -> list[float]:
    values: list[float] = result(results, f"{strategy}-{precision}-{model}-{ac}")["losses"]
    return values


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == TOTAL_STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert math.isfinite(g) and abs(g - w) <= BF16_TOLERANCE * abs(w), (
            f"{what}: step {step} loss {g:.4f} vs {w:.4f} (tolerance {BF16_TOLERANCE:.0%})"
        )


@pytest.mark.distributed
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "model",
    [pytest.param(m, marks=[pytest.mark.slow] if m in SLOW_MODELS else []) for m in MODELS],
)
def test_bf16_loss_within_tolerance_of_fp32_and_fsdp_matches_ddp(model: str, results: Path) -> None:
    for strategy in ("none", "ddp", "fsdp"):
        fp32 = losses(results, strategy, "fp32", model)
        assert_close(losses(results, strategy, "bf16", model), fp32, f"{strategy} bf16 vs fp32")
    ddp_bf16 = losses(results, "ddp", "bf16", model)
    assert_close(losses(results, "fsdp", "bf16", model), ddp_bf16, "fsdp bf16 vs ddp bf16")
    # fp32: FSDP2 equals DDP (bitwise for the weights, tests/train/test_distributed.py)
    assert losses(results, "fsdp", "fp32", model) == losses(results, "ddp", "fp32", model)
    # Activation checkpointing recomputes the same forward: same losses.
    for strategy in STRATEGIES:
        for precision in ("fp32", "bf16"):
            assert losses(results, strategy, precision, model, "ac") == losses(
                results, strategy, precision, model
            ), f"{strategy} {precision}: checkpointing changed the loss"
