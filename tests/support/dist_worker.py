"""One rank of a 2-process gloo job that runs several trainings in-process (one process group).

Started by `test_distributed.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/dist_worker.py SHARDS OUT_DIR

Each case trains a few steps with `Trainer` and rank 0 writes the full (unsharded) weights to
`OUT_DIR/<case>.pt`; the test compares them. Sharing one process group keeps the whole matrix
to one ~15 s job on two cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.custom_task

from tests.support.train_kit import full_weights  # noqa: E402

CASES = {
    # name: overrides
    "ddp-fp32": ["train.strategy=ddp", "train.precision=fp32"],
    "fsdp-fp32": ["train.strategy=fsdp", "train.precision=fp32"],
    # batch 12: 40 validation samples per rank fill 4 batches only with 8 padded samples;
    # grad_clip: clipping by the global norm of plain and of sharded (DTensor) gradients
    "ddp-bf16": [
        "train.strategy=ddp",
        "train.precision=bf16",
        "data.batch_size=12",
        "train.grad_clip=0.1",
    ],
    "fsdp-bf16": [
        "train.strategy=fsdp",
        "train.precision=bf16",
        "data.batch_size=12",
        "train.grad_clip=0.1",
    ],
    # A CNN under FSDP2 with activation checkpointing and channels_last inputs (FSDP2 keeps
    # its parameters contiguous), exported below into the plain SmallCNN.
    "fsdp-cnn": [
        "train.strategy=fsdp",
        "train.precision=fp32",
        "task=image_classification",
        "model.name=small_cnn",
        "model.image_size=16",
        "model.channels_last=true",
        "train.activation_checkpointing=true",
        "train.max_steps=2",
    ],
    "ddp-fp32-accum": [
        "train.strategy=ddp",
        "train.precision=fp32",
        "train.grad_accum_steps=2",
        "data.batch_size=4",
    ],
}


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for name, overrides in CASES.items():
            cfg = load_config(
                None,
                [
                    f"run_dir={out / name}",
                    "task=examples.custom_task:ThumbnailMLP",
                    "task_options.hidden=32",
                    f"data.train={shards / 'train' / 'index.json'}",
                    f"data.val={shards / 'val' / 'index.json'}",
                    "data.batch_size=8",
                    "data.workers_per_rank=0",
                    "data.shuffle_buffer=16",
                    "train.max_steps=3",
                    "train.log_every=1",
                    "train.lr=0.01",
                    "train.deterministic=true",
                    "logging.progress=lines",
                    *overrides,
                ],
            )
            trainer = Trainer(cfg, env, device)
            assert trainer.fit() == 0
            weights = full_weights(trainer.model)
            if env.is_main:
                torch.save(weights, out / f"{name}.pt")


if __name__ == "__main__":
    main()
