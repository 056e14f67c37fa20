"""A relative `checkpoint.dir` lies under the run folder, whatever the current directory
(issue #31 item 13): it was resolved against the current directory, so `eval`/`export` from
another directory, or a requeued job started elsewhere, found no checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.train_kit import REPO


def hpctrain(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"hpctrain {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_eval_export_and_resume_from_another_directory_find_the_checkpoints(
    shapes_shards: Path, tmp_path: Path
) -> None:
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    common = [
        f"data.train={shapes_shards / 'train'}",
        f"data.val={shapes_shards / 'val'}",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "train.precision=fp32",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        "checkpoint.dir=ckpts",
    ]
    demo = str(REPO / "configs" / "demo.yaml")
    hpctrain(here, "train", demo, "run_dir=run", "train.max_steps=2", *common)
    assert (here / "run" / "ckpts" / "step-2").is_dir()
    assert not (here / "ckpts").exists()

    run = str(here / "run")
    evaluated = hpctrain(elsewhere, "eval", run)
    assert "step-2" in evaluated.stdout + evaluated.stderr
    hpctrain(elsewhere, "export", run, "model.safetensors")
    assert (elsewhere / "model.safetensors").is_file()
    # a requeued job started in another directory resumes instead of starting again
    resumed = hpctrain(elsewhere, "train", demo, f"run_dir={run}", "train.max_steps=4", *common)
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (here / "run" / "ckpts" / "step-4").is_dir()
    assert not (elsewhere / "ckpts").exists()
