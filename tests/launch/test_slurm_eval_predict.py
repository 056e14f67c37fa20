"""`hpctrain submit --eval` and `submit --predict` on the local dev cluster (2 tasks, gloo).

A tiny run is trained locally first (the training is not what is tested here); both jobs are
submitted at once and every wait is bounded.
"""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.support.slurm_kit import hpctrain, train_overrides, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def job_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"],
        capture_output=True, text=True, timeout=30,
    ).stdout.split()  # fmt: skip
    return out[0] if out else ""


def test_submit_eval_and_predict_run_as_two_slurm_tasks(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    overrides = train_overrides(
        tiny_shards, run_dir, "train.max_steps=2", "data.workers_per_rank=0"
    )
    from tests.support.slurm_kit import DEMO

    hpctrain("train", DEMO, *overrides, timeout=180)
    profile = ["--profile", "local-dev", "--no-preflight"]
    record = tmp_path / "eval.json"
    preds = tmp_path / "preds"
    out = hpctrain("submit", str(run_dir), "--eval", "--out", str(record), *profile).stdout
    jobs += re.findall(r"^job (\S+) \(eval\)$", out, re.MULTILINE)
    out = hpctrain(
        "submit", str(run_dir), "--predict", "--out", str(preds), "--format", "shards", *profile
    ).stdout
    jobs += re.findall(r"^job (\S+) \(predict\)$", out, re.MULTILINE)
    assert len(jobs) == 2, out
    states = wait_for(
        "both jobs to end",
        lambda: (s := [job_state(j) for j in jobs]) and all(x in ("COMPLETED", "FAILED") for x in s) and s,
        150,
        poll=1.0,
    )  # fmt: skip
    assert states == ["COMPLETED", "COMPLETED"], (states, out)
    evaluation = json.loads(record.read_text())
    assert evaluation["world_size"] == 2 and evaluation["val_samples"] == evaluation["val_samples"]
    assert evaluation["step"] == 2 and "val_accuracy" in evaluation
    manifest = json.loads((preds / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["parts"]) == 2
    keys = []
    for part in manifest["parts"]:
        with tarfile.open(preds / part["url"]) as f:
            keys += [name.split(".", 1)[0] for name in f.getnames() if name.endswith(".json")]
    assert len(keys) == len(set(keys)) == manifest["num_samples"] == manifest["data_num_samples"]
    assert evaluation["val_samples"] == manifest["num_samples"]
