"""The segmentation example end to end, as docs/training.md runs it: generated image/mask
pairs → CSV manifests → `hpctrain convert` → 2 ranks of DDP on CPU → a resumed second run
→ mean IoU far above chance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.train_kit import REPO, run_hpctrain

EXAMPLE = REPO / "examples" / "segmentation"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def seg_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """192 training and 48 validation pairs → manifests → `hpctrain convert` → DIR/train, DIR/val."""
    data = tmp_path_factory.mktemp("seg")
    subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), str(data), "--train", "192", "--val", "48"],
        check=True,
        capture_output=True,
    )
    for split in ("train", "val"):
        run_hpctrain(
            "convert", str(data / f"{split}.csv"), str(data / "shards" / split),
            "--samples-per-shard", "24",
        )  # fmt: skip
    return data / "shards"


def example_args(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        str(EXAMPLE / "config.yaml"),
        f"run_dir={run_dir}",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "logging.progress=lines",
        *overrides,
    ]


@pytest.mark.distributed
@pytest.mark.slow
def test_segmentation_example_trains_resumes_and_reaches_miou(
    seg_shards: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = example_args(
        seg_shards,
        run_dir,
        "data.batch_size=8",
        "train.eval_every=0",
        "train.log_every=5",
        "checkpoint.every_steps=0",
    )
    first = run_hpctrain("train", *args, "train.max_steps=20", "--nproc", "2")
    assert "finished 20 steps" in first.stdout
    second = run_hpctrain("train", *args, "train.max_steps=40", "--nproc", "2")
    assert "resumed from step 20" in second.stderr
    assert "finished 40 steps" in second.stdout and "mIoU" in second.stdout

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in records if m["kind"] == "train"] == [5, 10, 15, 20, 25, 30, 35, 40]
    evals = [m for m in records if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [20, 40]
    final = evals[-1]
    assert final["val_samples"] == 48  # every validation pair once, padding left out
    # chance: a model that predicts only the background (most pixels) scores mIoU ~0.2;
    # this one trains to ~0.9 in 40 steps
    assert final["val_mIoU"] > 0.6, final
    assert final["val_pixel_accuracy"] > 0.85, final
    assert final["val_mIoU"] > evals[0]["val_mIoU"]


@pytest.mark.distributed
def test_unet_trains_under_fsdp2_bf16_with_activation_checkpointing(
    seg_shards: Path, tmp_path: Path
) -> None:
    """The U-Net's blocks (two inputs in the decoder) shard, checkpoint and autocast."""
    proc = run_hpctrain(
        "train",
        *example_args(
            seg_shards,
            tmp_path / "fsdp",
            "data.batch_size=4",
            "data.val=",
            "train.max_steps=2",
            "train.log_every=1",
            "train.strategy=fsdp",
            "train.precision=bf16",
            "train.activation_checkpointing=true",
        ),
        "--nproc",
        "2",
    )
    assert "finished 2 steps" in proc.stdout
    losses = [m["loss"] for m in read_jsonl(tmp_path / "fsdp" / "metrics.jsonl")]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_mask_values_outside_the_classes_follow_data_on_error(
    seg_shards: Path, tmp_path: Path, on_error: str
) -> None:
    """With 3 classes the triangles' id 3 is out of range: the transform's SampleError is
    handled in the loader like an undecodable sample, never a device-side assert."""
    from hpctrain.config import load_config
    from hpctrain.distributed import resolve_env
    from hpctrain.errors import DataError
    from hpctrain.train.trainer import Trainer

    cfg = load_config(
        str(EXAMPLE / "config.yaml"),
        example_args(
            seg_shards,
            tmp_path / on_error,
            "model.num_classes=3",
            f"data.on_error={on_error}",
            "data.workers_per_rank=0",
            "data.val=",
            "data.batch_size=8",
            "train.max_steps=2",
            "train.log_every=1",
            "train.strategy=none",
        )[1:],
    )
    trainer = Trainer(cfg, resolve_env({}), torch.device("cpu"))
    if on_error == "fail":
        with pytest.raises(DataError, match=r"'\d+'.*holds class ids \[3\] outside the model's 3"):
            trainer.fit()
        return
    assert trainer.fit() == 0
    records = read_jsonl(tmp_path / on_error / "metrics.jsonl")
    assert records[-1]["loader_samples_skipped"] > 0
