"""fp16: a checkpoint saved while the gradient scaler has skipped every step so far resumes."""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import DistEnv
from hpctrain.train.trainer import Trainer

CPU_DEVICE = torch.device("cpu")


def test_fp16_checkpoint_before_any_applied_step_resumes(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """Every step skipped by the scaler so far: the optimizer has no state yet (no momentum
    buffers). The checkpoint must still hold the state a resume expects."""
    overrides = [
        f"run_dir={tmp_path}",
        "task=tests.support.mlp_tasks:OverflowingMLP",
        f"data.train={shapes_shards / 'train' / 'index.json'}",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "train.precision=fp16",
        "train.optimizer=sgd",
        "train.momentum=0.9",
        "logging.progress=lines",
    ]
    env = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
    first = Trainer(load_config(None, [*overrides, "train.max_steps=1"]), env, CPU_DEVICE)
    assert first.fit() == 0
    assert first.scaler is not None and first.scaler.get_scale() < 65536.0  # step skipped
    resumed = Trainer(load_config(None, [*overrides, "train.max_steps=2"]), env, CPU_DEVICE)
    assert resumed.fit() == 0 and resumed.state.step == 2


def test_gradients_live_until_the_next_step_and_no_save_sees_them(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """The step does not free its gradients (done right after the optimizer step, that cost
    ~5% of a resnet18 step on a CPU: the freed heap went back to the OS and the next forward
    page-faulted it in again); the next step or a save frees them, so a checkpoint never
    sees gradients (the fp16 resume above needs that)."""
    overrides = [
        f"run_dir={tmp_path}",
        "task=tests.support.mlp_tasks:OverflowingMLP",
        f"data.train={shapes_shards / 'train' / 'index.json'}",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "train.precision=fp16",
        "train.max_steps=2",
        "checkpoint.every_steps=0",
        "logging.progress=lines",
    ]
    env = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
    trainer = Trainer(load_config(None, overrides), env, CPU_DEVICE)
    trainer.prepare_run_dir()
    batches = trainer.batch_stream()
    trainer.train_step(batches)
    assert all(p.grad is not None for p in trainer.model.parameters())
    trainer.save()
    trainer.checkpoints.wait()
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.train_step(batches)  # steps on after a save
    assert trainer.state.step == 2
    trainer.checkpoints.close()
    trainer.loader.close()
