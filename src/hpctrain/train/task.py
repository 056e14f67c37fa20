"""The Task protocol: what a user writes to train their own model with hpctrain.

A task builds the model, the per-sample transforms run in the loader workers, and computes the
loss (and metrics) from a batch that is already on the device. Name it in the config as
`task: mypackage.tasks:MyTask`; it is constructed as `MyTask(cfg, index)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.data.index import ShardIndex

Sample = dict[str, Any]
Batch = dict[str, Any]


@runtime_checkable
class Task(Protocol):
    """A model and its loss. Everything else (loop, data, checkpoints) is hpctrain's."""

    def build_model(self) -> nn.Module:
        """The model, on CPU; hpctrain moves, wraps and shards it."""
        ...

    def train_transform(self) -> Callable[[Sample], Sample]:
        """Per-sample transform for training, run in loader workers (picklable).

        Gets `{"image": uint8 CHW tensor, "label": int, "key": str, "meta": dict}` with torch's
        RNG seeded for this sample; returns the same keys with `image` at a fixed size.
        """
        ...

    def eval_transform(self) -> Callable[[Sample], Sample]:
        """Per-sample transform for evaluation (deterministic)."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the valid samples of the batch, and metrics to log (averaged too).

        Training batches can hold samples flagged `batch["valid"] == False`: padding after an
        elastic re-plan, or fillers for samples lost under `data.on_error=skip`. Leave them
        out of the loss (`masked_mean` does it).
        """
        ...

    def eval_metrics(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Sums over the valid samples of `batch` (`batch["valid"]`), including `"count"`.

        hpctrain adds them over batches and ranks and divides by `count`, so padded samples
        never count twice.
        """
        ...


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of per-sample `values` over the samples where `valid` is True."""
    weights = valid.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


BUILTIN_TASKS = {
    "image_classification": "hpctrain.train.image_classification:ImageClassification",
}


def load_task(cfg: Config, index: ShardIndex) -> Task:
    """Instantiate the task named by `cfg.task` (a built-in name or `module.path:ClassName`)."""
    target = BUILTIN_TASKS.get(cfg.task, cfg.task)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        builtins = ", ".join(sorted(BUILTIN_TASKS))
        raise ConfigError(f"task={cfg.task!r}: expected one of {builtins} or module.path:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task={cfg.task!r}: cannot import {module_name}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"task={cfg.task!r}: {module_name} has no {class_name}")
    task = cls(cfg, index)
    missing = [
        m
        for m in ("build_model", "train_transform", "eval_transform", "loss", "eval_metrics")
        if not hasattr(task, m)
    ]
    if missing:
        raise ConfigError(f"task={cfg.task!r}: {class_name} lacks {', '.join(missing)}")
    return task
