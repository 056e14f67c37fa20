"""One rank of a 4- or 2-process gloo job comparing HSDP with flat FSDP2 and DDP.

Started by `test_hsdp.py` with 4 ranks on two pretended nodes (LOCAL_WORLD_SIZE=2):
    python tests/support/hsdp_worker.py SHARDS OUT_DIR four
and then with 2 ranks, resuming the 4-rank runs' step-2 checkpoints under other meshes:
    python tests/support/hsdp_worker.py SHARDS OUT_DIR two

Each case trains with `Trainer`; rank 0 writes the full weights to `OUT_DIR/<case>.pt`.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.custom_task

from tests.support.train_kit import full_weights  # noqa: E402

MLP = ["task=examples.custom_task:ThumbnailMLP", "task_options.hidden=32"]
CNN = ["task=image_classification", "model.name=small_cnn", "model.image_size=16"]
MIXED = [
    "train.precision=bf16",
    "train.grad_accum_steps=2",
    "data.batch_size=4",
    "train.grad_clip=0.1",
    "train.ema_decay=0.9",
]
KEPT = ["train.reshard_after_forward=false", "train.activation_checkpointing=true"]
HSDP = ["train.strategy=hsdp"]  # shard_degree 0: the 2 ranks of a pretended node

FOUR = {
    # name: (overrides, max_steps); fp32 unless MIXED
    "ddp": (["train.strategy=ddp", *MLP], 4),
    "fsdp": (["train.strategy=fsdp", *MLP], 4),
    "hsdp": ([*HSDP, *MLP], 4),
    "hsdp-explicit": (["train.strategy=hsdp", "train.shard_degree=2", *MLP], 2),
    "cnn-fsdp": (["train.strategy=fsdp", *CNN], 3),
    "cnn-hsdp": ([*HSDP, *CNN], 3),
    "mixed-fsdp": (["train.strategy=fsdp", *MLP, *MIXED], 3),
    "mixed-hsdp": ([*HSDP, *MLP, *MIXED], 3),
    # parameters kept gathered between forward and backward, blocks recomputed in backward
    "kept-fsdp": (["train.strategy=fsdp", *MLP, *KEPT], 3),
    "kept-hsdp": ([*HSDP, *MLP, *KEPT], 3),
    # stopped at step 2, then resumed under the same mesh (here) or another (the 2-rank job)
    "hsdp-half": ([*HSDP, *MLP], 2),
    "fsdp-half": (["train.strategy=fsdp", *MLP], 2),
    "ddp-half": (["train.strategy=ddp", *MLP], 2),
}
# Resumed in the 4-rank job after FOUR: (source run, overrides)
RESUMED_FOUR = {
    "hsdp-resumed": ("hsdp-half", [*HSDP, *MLP]),
    "ddp-to-hsdp": ("ddp-half", [*HSDP, *MLP]),
}
# Resumed in the 2-rank job (elastic: 4 -> 2 data-parallel ranks)
RESUMED_TWO = {
    "hsdp-to-fsdp": ("hsdp-half", ["train.strategy=fsdp", *MLP]),
    "fsdp-to-fsdp": ("fsdp-half", ["train.strategy=fsdp", *MLP]),
}


def train(env, device, shards: Path, run_dir: Path, overrides: list[str], steps: int) -> None:
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"data.train={shards / 'train' / 'index.json'}",
            f"data.val={shards / 'val' / 'index.json'}",
            "data.batch_size=8",
            "data.workers_per_rank=0",
            "data.shuffle_buffer=16",
            f"train.max_steps={steps}",
            "train.log_every=1",
            "train.lr=0.01",
            "train.schedule=constant",  # a run stopped at step 2 resumes on the same course
            "train.deterministic=true",
            "logging.progress=lines",
            *overrides,
        ],
    )
    trainer = Trainer(cfg, env, device)
    assert trainer.fit() == 0
    weights = full_weights(trainer.model)
    if env.is_main:
        torch.save(weights, run_dir.parent / f"{run_dir.name}.pt")


def resume_copy(env, out: Path, source: str, name: str) -> Path:
    """A copy of run `source` (its step-2 checkpoint) as run `name`, made by rank 0."""
    import torch.distributed as dist

    if env.is_main:
        shutil.copytree(out / source, out / name)
        (out / name / "metrics.jsonl").unlink()
    dist.barrier()
    return out / name


def main() -> None:
    shards, out, job = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the mesh lines
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        if job == "four":
            for name, (overrides, steps) in FOUR.items():
                train(env, device, shards, out / name, overrides, steps)
            resumed = RESUMED_FOUR
        else:
            resumed = RESUMED_TWO
        for name, (source, overrides) in resumed.items():
            train(env, device, shards, resume_copy(env, out, source, name), overrides, 4)


if __name__ == "__main__":
    main()
