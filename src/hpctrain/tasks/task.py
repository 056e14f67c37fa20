"""The Task protocol: what a user writes to train their own model with hpctrain.

A task builds the model, gives the per-sample transforms that run in the loader workers, and
computes the loss (and metrics) from a batch that is already on the device. Name it in the
config as `task: mypackage.tasks:MyTask`; it is constructed as `MyTask(cfg, index)`. The
contract in full (what a sample holds, what runs where and when, bad samples) is in
`docs/extending.md`; the signatures are here.
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

    Besides these methods a task may define optional hooks, looked up by name (without one,
    hpctrain does what its entry says):

    - `decode(key: str, members: dict[str, bytes | memoryview]) -> Sample`: replaces the default
      decoding of a sample's raw members (field name → bytes); runs in the loader workers, so
      it must be picklable (a bound method of a picklable task is).
    - `collate(samples: list[Sample]) -> Batch`: replaces the default collate (variable-size
      fields, padding, ...); runs in the loader workers.
    - `summarize(sums: dict[str, torch.Tensor]) -> dict[str, float]`: turns the evaluation
      sums (added over batches and ranks, any shape: a confusion matrix, histograms) into the
      final metrics (mIoU, mAP). Without it each sum is divided by `sums["count"]`.
    - `summary_line(record: dict[str, Any]) -> str`: the line the Trainer prints at the end
      for the final evaluation record (`val_<metric>` keys and `val_samples`); default
      `validation_line`: every `val_` entry.
    - `predict(model: nn.Module, batch: Batch) -> list[dict[str, Any]]`: what `hpctrain
      predict` writes per sample: one dict per sample of the batch, in batch order (padding
      and fillers included: hpctrain drops the samples flagged `valid=False` and adds the
      sample's `key`). Values are JSON-able (numbers, strings, lists, dicts) or tensors /
      numpy arrays (lists in JSONL, `.npy` members in shards); a tensor under a name ending
      in `.png` is a 2-D class-id mask (a PNG member in shards, run-length encoded in JSONL;
      see `hpctrain.inference.predict`). Runs under `torch.no_grad()` and the run's autocast,
      with the model in eval mode, on every rank. Without it `hpctrain predict` is refused.
    - `predict_transform() -> Callable[[Sample], Sample]`: the per-sample transform for
      `predict` (data to predict on may have no targets); default `eval_transform()`.
    - `model_metadata() -> dict[str, Any]`: JSON-able entries every checkpoint records in its
      manifest's `metadata` (causal_lm: the GPT's shape), for `model_card` to read back
      without the run's data; default none.
    - `tokens_per_sample: int` (an attribute) and `flops_per_token() -> int`: the train
      records then hold tokens/s and MFU (`hpctrain.models.flops`); default none.
    - `count_targets(batch: Batch) -> int | torch.Tensor`: how many terms `loss` averages
      over in `batch` (masked target tokens, labelled pixels), counted on the host batch
      before it moves to the device. The optimizer step weighs each micro-batch's loss by it
      and divides by the step's count over every micro-batch and data-parallel rank, so
      that gradient accumulation and the number of ranks give the loss and gradients of one
      large batch. Default: the valid samples (what `masked_mean` divides by).

    Two hooks are read from the class, without an instance (`export` and `preflight` have no
    data to construct a task with), so they are static methods:

    - `model_card(tree: dict, weights: dict[str, torch.Tensor], manifest: dict) -> dict |
      None`: what `hpctrain export` writes beside the weights (`OUT.json`, with the step and
      format added) to rebuild the model without the run: `tree` is the run's resolved
      config, `weights` the exported state dict, `manifest` the checkpoint's. Default (and
      None): no card; return None too for weights the card could not rebuild.
    - `check_model_name(name: str, image_size: int | None) -> None`: raise `ConfigError` for
      a `model.name` the task cannot build, without building it (`hpctrain preflight`, before
      the queue wait); empty is the task's default. Default: every name passes.

    And one class method, for the task of a model that a checkpoint already holds (a resume,
    `eval`, `predict`):

    - `from_checkpoint(cfg, index, manifest: dict) -> Task`: the task built with what the
      checkpoint records (`manifest["metadata"]`, written by `model_metadata`), so that the
      model is the one saved whatever its sources are now (causal_lm: the shape of a
      `model.init_from` folder, the tokenizer). Default: `cls(cfg, index)`.
    - `eval_metric_names(cfg: Config) -> Collection[str]`: the metrics its evaluation can
      report with `cfg` (the keys of `summarize`, without `val_`), so that a
      `checkpoint.monitor` naming another is refused before any work (the trainer's start,
      `hpctrain preflight`). Default: undeclared, the monitor is first looked up in the
      first evaluation record.
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


REQUIRED_METHODS = ("build_model", "train_transform", "eval_transform", "loss", "eval_metrics")
OPTIONAL_HOOKS = (
    "decode",
    "collate",
    "summarize",
    "summary_line",
    "predict",
    "predict_transform",
    "model_metadata",
    "flops_per_token",
    "model_card",
    "check_model_name",
    "answer_sums",
    "from_checkpoint",
    "count_targets",
    "eval_metric_names",
)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of per-sample `values` over the samples where `valid` is True."""
    weights = valid.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


def count_targets(task: Task, batch: Batch) -> int:
    """What `task.loss` averages over in the host `batch`: its `count_targets` hook, else
    the valid samples. An int read on the host: no wait for the device."""
    hook = getattr(task, "count_targets", None)
    return int(hook(batch) if hook is not None else batch["valid"].sum())


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


def validation_line(record: Mapping[str, Any]) -> str:
    """The default `summary_line`: every `val_` entry of the final evaluation record."""
    return "validation: " + ", ".join(
        f"{k[4:]} {v:.4f}" if isinstance(v, float) else f"{k[4:]} {v}"
        for k, v in record.items()
        if k.startswith("val_")
    )


def summary_line(task: Task, record: Mapping[str, Any]) -> str:
    """The task's line for the final evaluation `record` (its `summary_line` hook or the default)."""
    hook: Callable[[Mapping[str, Any]], str] = getattr(task, "summary_line", validation_line)
    return hook(record)


# name -> "module.path:ClassName": `task: <name>` in a config
BUILTIN_TASKS = {
    "image_classification": "hpctrain.tasks.image_classification:ImageClassification",
    "segmentation": "hpctrain.tasks.segmentation:Segmentation",
    "causal_lm": "hpctrain.tasks.causal_lm:CausalLM",
}
DEFAULT_TASK = "image_classification"  # Config.task's default


def task_class(name: str) -> Any:
    """What `task=name` names (a built-in name or `module.path:ClassName`), imported: the
    class (or any callable taking `(cfg, index)`), not constructed.

    Raises:
        ConfigError: not such a name, or the module or class cannot be found.
    """
    target = BUILTIN_TASKS.get(name, name)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        builtins = ", ".join(sorted(BUILTIN_TASKS))
        raise ConfigError(f"task={name!r}: expected one of {builtins} or module.path:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task={name!r}: cannot import {module_name}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"task={name!r}: {module_name} has no {class_name}")
    return cls


def load_task(cfg: Config, index: ShardIndex, checkpoint: dict[str, Any] | None = None) -> Task:
    """Instantiate the task named by `cfg.task` (a built-in name or `module.path:ClassName`).

    `checkpoint`: the manifest of the checkpoint whose model the task is for (a resume, an
    eval, a predict): built with the class's `from_checkpoint` hook when it has one.
    """
    cls = task_class(cfg.task)
    class_name = BUILTIN_TASKS.get(cfg.task, cfg.task).partition(":")[2]
    from_checkpoint = getattr(cls, "from_checkpoint", None)
    if checkpoint is not None and callable(from_checkpoint):
        task = from_checkpoint(cfg, index, checkpoint)
    else:
        task = cls(cfg, index)
    missing = [m for m in REQUIRED_METHODS if not hasattr(task, m)]
    if missing:
        raise ConfigError(f"task={cfg.task!r}: {class_name} lacks {', '.join(missing)}")
    not_callable = [
        h for h in OPTIONAL_HOOKS if hasattr(task, h) and not callable(getattr(task, h))
    ]
    if not_callable:
        raise ConfigError(f"task={cfg.task!r}: {class_name}.{not_callable[0]} is not callable")
    if cfg.eval.generate and not callable(getattr(task, "answer_sums", None)):
        raise ConfigError(
            f"eval.generate=true: task={cfg.task!r} answers no prompts (causal_lm does); "
            "set eval.generate=false"
        )
    return task


def class_hook(task: str, hook: str) -> Callable[..., Any] | None:
    """The static hook `hook` of the class `task` names; None without one, and for a task
    this process cannot import (`export` of a run whose task package is not installed)."""
    try:
        cls = task_class(task)
    except ConfigError:
        return None
    found = getattr(cls, hook, None)
    return found if callable(found) else None


def model_card(
    tree: dict[str, Any], weights: dict[str, torch.Tensor], manifest: dict[str, Any]
) -> dict[str, Any] | None:
    """The task's model card for exported `weights` (its `model_card` hook), or None."""
    hook = class_hook(str(tree.get("task") or DEFAULT_TASK), "model_card")
    card: dict[str, Any] | None = hook(tree, weights, manifest) if hook is not None else None
    return card


def check_monitor(cfg: Config) -> None:
    """Refuse a `checkpoint.monitor` that the task's evaluation never reports (its
    `eval_metric_names` hook, with `val_` and `val_samples`), before any work: the run would
    otherwise train until its first evaluation, then fail. A task without the hook (or
    that cannot be imported here) is not checked.

    Raises:
        ConfigError: naming the key and the task's metric names.
    """
    monitor = cfg.checkpoint.monitor
    hook = class_hook(cfg.task, "eval_metric_names") if monitor else None
    if hook is None:
        return
    reported = [f"val_{name}" for name in hook(cfg)] + ["val_samples"]
    if monitor not in reported:
        raise ConfigError(
            f"checkpoint.monitor={monitor}: task {cfg.task} reports {', '.join(reported)} "
            "(with this config); monitor one of them"
        )


def check_model_name(task: str, name: str, image_size: int | None = None) -> None:
    """Refuse a `model.name` that `task` cannot build, without building it (for `hpctrain
    preflight`): the task's `check_model_name` hook; a task without one (or that cannot be
    imported here) is not checked. With `image_size`, a classifier's `model.image_size` is
    checked too.

    Raises:
        ConfigError: naming the model and what the task accepts.
    """
    hook = class_hook(task, "check_model_name")
    if hook is not None:
        hook(name, image_size)
