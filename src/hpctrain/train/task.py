"""The Task protocol: what a user writes to train their own model with hpctrain.

A task builds the model, gives the per-sample transforms that run in the loader workers, and
computes the loss (and metrics) from a batch that is already on the device. Name it in the
config as `task: mypackage.tasks:MyTask`; it is constructed as `MyTask(cfg, index)`.

**Samples.** A sample is the tar members of a shard that share a key; the part of a member's
name after `KEY.` is a *field name*, extensions kept (`jpg`, `cls`, `json`, `img.jpg`,
`mask.png`, `left.jpg`, `depth.npy`, `txt`). The loader decodes every field by its last
extension (`hpctrain.data.decode`: images → uint8 CHW tensors, target images such as
`mask.png` → raw class ids [H, W], `cls` → int, `json` → object, `txt` → str, `npy` →
tensor, anything else → bytes) into `{"key": key, <field>: value, ...}`.

**What runs where.** In the loader workers, for each sample: `decode(key, members)` if the
task has it (else the default decoding), then the transform, which gets the whole decoded
dict with torch's RNG seeded for this sample and returns a dict. Then a batch is made:
`collate(samples)` if the task has it, else the default collate (tensors and arrays of one
shape and dtype stacked, Python bool/int/float made tensors, str/bytes/dict/list/None kept as
lists; a field whose shapes differ is an error naming it). The loader adds `batch["valid"]`
(bool [B]: False for fillers after lost samples and for evaluation padding, which are copies
of a good sample) and `batch["key"]` (list of str). The Trainer moves every tensor field to
the device and hands the batch to `loss` or `eval_metrics`.

**Bad samples.** A transform (or `decode`) raises `hpctrain.data.decode.SampleError` for a
sample it cannot use (a missing field, a label outside the model's classes): the loader
handles it under `data.on_error` (fail: an error naming the key and shard; skip: counted and
replaced by a filler). Any other exception is a bug and propagates.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.data.index import ShardIndex

Sample = dict[str, Any]
Batch = dict[str, Any]


@runtime_checkable
class Task(Protocol):
    """A model and its loss. Everything else (loop, data, checkpoints) is hpctrain's.

    Besides these methods a task may define three optional hooks, looked up by name:

    - `decode(key: str, members: dict[str, bytes | memoryview]) -> Sample`: replaces the default
      decoding of a sample's raw members (field name → bytes); runs in the loader workers, so
      it must be picklable (a bound method of a picklable task is).
    - `collate(samples: list[Sample]) -> Batch`: replaces the default collate (variable-size
      fields, padding, ...); runs in the loader workers.
    - `summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]`: turns the evaluation
      sums (added over batches and ranks, any shape: a confusion matrix, histograms) into the
      final metrics (mIoU, mAP). Without it each sum is divided by `sums["count"]`.
    """

    def build_model(self) -> nn.Module:
        """The model, on CPU; hpctrain moves, wraps and shards it."""
        ...

    def train_transform(self) -> Callable[[Sample], Sample]:
        """Per-sample transform for training, run in loader workers (picklable).

        Gets the decoded sample `{"key": str, <field>: value, ...}` with torch's RNG seeded
        for this sample; returns the fields the batch should hold (with `key`), every tensor
        field at one size so that batches stack. Raises `SampleError` for unusable samples.
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

        hpctrain adds them over batches and ranks, then calls `summarize` (or divides each by
        `count`), so padded samples never count twice.
        """
        ...


OPTIONAL_HOOKS = ("decode", "collate", "summarize")


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of per-sample `values` over the samples where `valid` is True."""
    weights = valid.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


def divide_by_count(sums: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """The default `summarize`: every scalar sum divided by `sums["count"]`.

    Raises:
        ValueError: a sum that is not a scalar (the task needs its own `summarize`).
    """
    count = max(1.0, float(sums.get("count", 0.0)))
    metrics = {}
    for name, total in sums.items():
        if name == "count":
            continue
        if total.numel() != 1:
            raise ValueError(
                f"eval_metrics returned {name!r} of shape {list(total.shape)}: a task whose "
                "sums are not scalars must define summarize(sums)"
            )
        metrics[name] = float(total) / count
    return metrics


BUILTIN_TASKS = {
    "image_classification": "hpctrain.train.tasks.image_classification:ImageClassification",
    "segmentation": "hpctrain.train.tasks.segmentation:Segmentation",
    "causal_lm": "hpctrain.train.tasks.causal_lm:CausalLM",
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
    not_callable = [
        h for h in OPTIONAL_HOOKS if hasattr(task, h) and not callable(getattr(task, h))
    ]
    if not_callable:
        raise ConfigError(f"task={cfg.task!r}: {class_name}.{not_callable[0]} is not callable")
    return task
