"""Frozen parameters, the optimizer's groups (weight decay, learning-rate scales), the schedule.

Parameters are matched by their plain-module names (`blocks.0.attn.wq.weight`: without the
`module.`, `_orig_mod.` and `_checkpoint_wrapped_module.` parts that DDP, `torch.compile` and
activation checkpointing add), the names of checkpoints and of the EMA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain.config import ConfigError, TrainConfig, config_to_dict
from hpctrain.train.ema import plain_name


def named_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter of `model` once, with all its plain names (a shared tensor has several)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    by_id: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), ([], param))[0].append(plain_name(name))
    return list(by_id.values())


def matches(names: list[str], pattern: str) -> bool:
    return any(fnmatchcase(name, pattern) for name in names)


def some_names(named: list[tuple[list[str], nn.Parameter]], limit: int = 4) -> str:
    """A few of the model's parameter names, for messages about patterns that match none."""
    names = [names[0] for names, _ in named]
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> tuple[int, int]:
    """`train.freeze`: no gradient for parameters whose name matches one of `patterns`.

    Call it before `parallelize`: DDP reduces the gradients of the parameters that required
    them when it wrapped the model (freezing after it fails its next reduction, measured), and
    FSDP2 copies `requires_grad` into the sharded parameters it creates. FSDP2 reduce-scatters
    only the gradients that exist, so one unit may hold frozen and trained parameters (FSDP1's
    flat parameters could not: pytorch/pytorch#104690); frozen ones are sharded all the same.

    Returns:
        The numbers of trainable and frozen parameter elements.

    Raises:
        ConfigError: a pattern matches no parameter, or every parameter is frozen.
    """
    named = named_parameters(model)
    for i, pattern in enumerate(patterns):
        matched = [param for names, param in named if matches(names, pattern)]
        if not matched:
            raise ConfigError(
                f"train.freeze[{i}]={pattern!r}: matches no parameter of the model "
                f"(its names: {some_names(named)})"
            )
        for param in matched:
            param.requires_grad_(False)
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    frozen = sum(p.numel() for _, p in named if not p.requires_grad)
    if named and not trainable:
        raise ConfigError(
            f"train.freeze={list(patterns)!r}: leaves no parameter of the model to train"
        )
    return trainable, frozen


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over the trainable parameters, in groups by learning rate and weight decay.

    Groups come in pairs, weight decay then none (norms and biases: parameters with one
    dimension): first the parameters that no `train.lr_groups` pattern matches, at `train.lr`,
    then one pair per `train.lr_groups` entry at `train.lr x lr_scale`. Each group holds its
    `lr_scale` (checkpointed with it). The scheduler multiplies each group's own initial rate,
    so the ratios hold at every step. Empty groups are left out: DCP saves a group's settings
    under its parameters' names, so an empty one would come back from a checkpoint without
    them (AdamW then fails on its missing `betas`).

    Raises:
        ConfigError: a `train.lr_groups` pattern matches no trainable parameter left to it.
    """
    named = named_parameters(model)
    scales = [1.0] + [group.lr_scale for group in cfg.lr_groups]
    pairs: list[tuple[list[nn.Parameter], list[nn.Parameter]]] = [([], []) for _ in scales]
    for names, param in named:
        if not param.requires_grad:
            continue
        k = next(
            (i + 1 for i, group in enumerate(cfg.lr_groups) if matches(names, group.pattern)), 0
        )
        decay, no_decay = pairs[k]
        (no_decay if param.ndim <= 1 else decay).append(param)
    for i, group in enumerate(cfg.lr_groups):
        if not any(pairs[i + 1]):
            why = (
                "every parameter it matches is frozen (train.freeze) or taken by an earlier "
                "entry (the first matching pattern wins)"
                if any(matches(names, group.pattern) for names, _ in named)
                else f"matches no parameter of the model (its names: {some_names(named)})"
            )
            raise ConfigError(f"train.lr_groups[{i}].pattern={group.pattern!r}: {why}")
    groups: list[dict[str, Any]] = []
    for scale, (decay, no_decay) in zip(scales, pairs, strict=True):
        for params, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0)):
            if params:
                groups.append(
                    {
                        "params": params,
                        "weight_decay": weight_decay,
                        "lr": cfg.lr * scale,
                        "lr_scale": scale,
                    }
                )
    # CPUs: PyTorch's default implementation (per-tensor there), which gave DDP and FSDP2
    # bitwise-equal weights (torch 2.14.1, foreach=False and True alike); resumes repeat bitwise.
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    trainable = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=fused_adamw_ok(trainable) or None)


# The dtypes torch's fused AdamW kernels take (`torch/optim/adam.py`: floating point).
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fused_adamw_ok(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs fused: every parameter on CUDA in a dtype the fused kernel takes
    (FSDP2's DTensor shards included). One kernel per device and dtype for the whole update,
    the fastest of torch's three implementations (torchtitan's default); its fp16 path takes
    the gradient scaler's `found_inf` itself. CPUs keep the default implementation (above)."""
    return bool(params) and all(p.device.type == "cuda" and p.dtype in FUSED_DTYPES for p in params)


def keep_fused_adamw(optimizer: torch.optim.Optimizer) -> None:
    """After a resume: this run's AdamW implementation, not the checkpoint's.

    A loaded optimizer state brings its groups' settings, `fused` with them (a checkpoint of
    a CPU run, or of an earlier hpctrain, would turn the fused update off on GPUs; one of a
    GPU run would turn it on on CPUs). The fused kernel keeps `step` on the parameter's
    device, as torch's own load does for fused groups.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        fused = fused_adamw_ok(group["params"])
        group["fused"] = fused or None
        if not fused:
            continue
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != param.device:
                state["step"] = step.to(device=param.device, dtype=torch.float32)


def check_same_groups(cfg: TrainConfig, manifest: dict[str, Any] | None) -> None:
    """Refuse to resume a checkpoint saved with other `train.freeze` or `train.lr_groups`.

    The checkpoint's optimizer holds its parameter groups, their rates and scales: DCP would
    fail on other groups (a `zip()` error, or a missing key) or, with the same groups, keep
    the saved scales without a word.

    Raises:
        ConfigError: one of the two keys differs from the checkpoint's saved config.
    """
    saved = (manifest or {}).get("metadata", {}).get("config")
    try:
        tree = yaml.safe_load(saved) if isinstance(saved, str) else None
    except yaml.YAMLError:
        return
    if not isinstance(tree, dict) or not isinstance(tree.get("train"), dict):
        return
    ours = config_to_dict(cfg)
    for key in ("freeze", "lr_groups"):
        theirs = tree["train"].get(key, [])  # [] before these keys existed
        if ours[key] != theirs:
            step = (manifest or {}).get("step")
            raise ConfigError(
                f"train.{key}={ours[key]!r}: the checkpoint of step {step} was saved with "
                f"train.{key}={theirs!r}, and its optimizer holds those parameter groups; set "
                "it back to resume, or train with the new value in a new run folder"
            )


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at `step` (0-based): linear warmup, then cosine or flat."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_warning(cfg: TrainConfig, total_steps: int) -> str:
    """A line when `train.warmup_steps` reaches the run's steps ("" otherwise): the learning
    rate would still be rising when the run ends, never at `train.lr`."""
    if not cfg.warmup_steps or cfg.warmup_steps < total_steps:
        return ""
    return (
        f"train.warmup_steps={cfg.warmup_steps} reaches the run's {total_steps} steps: the "
        f"learning rate never rises to train.lr={cfg.lr:g} and little is learnt; set "
        f"train.warmup_steps below {total_steps} (a tenth of the steps: {total_steps // 10})"
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule)
    )
