"""The strategy x precision x model x activation-checkpointing matrix, shared by its worker
(`matrix_worker.py`, which runs every cell) and its test (`test_matrix.py`, which asserts them).

A model is one entry of `MODELS`: the language-model issue adds `gpt-tiny` here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = ("none", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
# name: model overrides. Tiny inputs (bf16 autocast is ~40x slower than fp32 on this CPU), but
# ResNet-18 gets 4 images of 64 px per rank: at 16-32 px its deepest BatchNorms normalize 2-4
# values per channel, which turns bf16 rounding into sign flips (losses 2-18 % apart from fp32
# on some batches, against 0.5 % at 4 x 64 px).
MODELS: dict[str, tuple[str, ...]] = {
    "small_cnn": ("task=image_classification", "model.name=small_cnn"),
    "resnet18": (
        "task=image_classification",
        "model.name=resnet18",
        "model.image_size=64",
        "data.batch_size=4",
    ),
    "vit_tiny": ("task=image_classification", "model.name=vit_tiny"),
}
# The slowest cells (the two large models: their set-up, steps and checkpoints take 5-40 s per
# cell on 2 busy cores, small_cnn's 1-5 s): marked `slow`, still run in CI.
SLOW_MODELS = ("resnet18", "vit_tiny")
STEPS_BEFORE_SAVE = 1  # then a fresh Trainer resumes from that checkpoint for one more step
TOTAL_STEPS = 2


@dataclass(frozen=True)
class Cell:
    strategy: str
    precision: str
    model: str
    checkpointing: bool
    extra: tuple[str, ...] = ()  # more overrides (the refusal cells)
    label: str = ""
    num_ranks: int = 0  # 0: one process for `none`, two otherwise

    @property
    def name(self) -> str:
        ac = "ac" if self.checkpointing else "noac"
        base = f"{self.strategy}-{self.precision}-{self.model}-{ac}"
        return f"{base}-{self.label}" if self.label else base

    @property
    def world_size(self) -> int:
        """`none` runs as one process: with 2 ranks it is refused (see REFUSAL_CELLS)."""
        return self.num_ranks or (1 if self.strategy == "none" else 2)

    @property
    def slow(self) -> bool:
        return self.model in SLOW_MODELS

    def overrides(self, shards: Path, run_dir: Path, max_steps: int) -> list[str]:
        return [
            f"run_dir={run_dir}",
            f"data.train={shards / 'train' / 'index.json'}",
            "data.val=",
            "data.batch_size=2",
            "data.workers_per_rank=0",
            "data.shuffle_buffer=8",
            "model.image_size=16",
            f"train.max_steps={max_steps}",
            "train.log_every=1",
            "train.optimizer=sgd",
            "train.momentum=0",  # no optimizer state: half the checkpoint bytes (fp16's scaler has some)
            "train.lr=0.01",
            "train.warmup_steps=0",
            "train.schedule=constant",
            "train.deterministic=true",
            f"train.strategy={self.strategy}",
            f"train.precision={self.precision}",
            f"train.activation_checkpointing={str(self.checkpointing).lower()}",
            "checkpoint.deadline_margin_s=0",
            "logging.progress=lines",
            *MODELS[self.model],
            *self.extra,
        ]


GRID = [
    Cell(strategy, precision, model, checkpointing)
    for strategy, precision, model, checkpointing in itertools.product(
        STRATEGIES, PRECISIONS, MODELS, (False, True)
    )
]
# Combinations refused before any work on this CPU with 2 ranks (the matrix asserts the line).
REFUSAL_CELLS = [
    Cell("none", "fp32", "small_cnn", False, label="2ranks", num_ranks=2),
    Cell("ddp", "bf16", "resnet18", False, ("train.sync_batchnorm=true",), label="syncbn"),
    Cell("fsdp", "fp32", "small_cnn", False, ("train.sync_batchnorm=true",), label="syncbn"),
]
