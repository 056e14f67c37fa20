"""The end-to-end path: convert → shards → per-rank loader → DDP on 2 gloo processes →
metrics → DCP checkpoint → a second `hpctrain train` resumes from the latest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.train_kit import run_hpctrain, train_args


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.distributed
def test_two_ranks_train_disjoint_samples_and_resume(shapes_shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = train_args(shapes_shards, run_dir, "data.sample_log=true", "checkpoint.every_steps=3")
    first = run_hpctrain("train", *args, "train.max_steps=6", "--nproc", "2")
    assert "finished 6 steps" in first.stdout

    logs = [read_jsonl(run_dir / "samples" / f"rank-{r}.jsonl") for r in range(2)]
    keys = [{k for line in log for k in line["keys"]} for log in logs]
    assert keys[0] and keys[1]
    assert not keys[0] & keys[1], "ranks trained on overlapping samples"
    assert (
        [line["step"] for line in logs[0]]
        == [line["step"] for line in logs[1]]
        == list(range(1, 7))
    )

    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    for m in metrics:
        assert 0.0 <= m["data_wait_fraction"] <= m["data_wait_fraction_worst"] <= 1.0
        assert m["samples_per_s"] > 0 and m["loss"] > 0
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "step-6").is_dir()

    second = run_hpctrain("train", *args, "train.max_steps=9", "--nproc", "2")
    assert "resumed from step 6" in second.stderr
    assert "finished 9 steps" in second.stdout
    resumed = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert resumed == list(range(1, 10)), "the resumed run must continue at step 7, not restart"
    logs = [read_jsonl(run_dir / "samples" / f"rank-{r}.jsonl") for r in range(2)]
    all_keys = [k for log in logs for line in log for k in line["keys"]]
    assert len(all_keys) == len(set(all_keys)), "a sample was trained twice within the first epoch"


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_single_process_run_reports_accuracy(shapes_shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "single"
    proc = run_hpctrain("train", *train_args(shapes_shards, run_dir, "train.max_steps=4"))
    assert "validation accuracy:" in proc.stdout
    evals = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "eval"]
    assert (
        evals and evals[-1]["val_samples"] == 80
    )  # every validation sample once, none padded twice
    plot = run_hpctrain("plot", str(run_dir))
    assert (run_dir / "loss.png").stat().st_size > 1000 and "loss.png" in plot.stdout


def test_bad_config_fails_before_work(tmp_path: Path) -> None:
    proc = run_hpctrain("train", "configs/demo.yaml", "data.batch_size=-1", check=False)
    assert proc.returncode == 2
    assert "data.batch_size=-1" in proc.stderr
    proc = run_hpctrain("train", "configs/demo.yaml", "train.strategy=foo", check=False)
    assert (
        proc.returncode == 2 and "train.strategy" in proc.stderr and "none|ddp|fsdp" in proc.stderr
    )
