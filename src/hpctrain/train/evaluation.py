"""Evaluation: the task's metrics over a dataset, summed over batches and ranks.

One implementation serves the Trainer's periodic and final evaluations and `hpctrain eval`
(`hpctrain.inference.evaluate.run_eval`: a checkpoint's model over `data.val`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.data import ShardedLoader
from hpctrain.data.planning import EpochPlan
from hpctrain.distributed import all_reduce_tensors
from hpctrain.observe.waits import Ticker
from hpctrain.tasks.answers import Share
from hpctrain.tasks.task import Batch, Task, divide_by_count

log = logging.getLogger("hpctrain")

# loader counters (`ShardedLoader.stats`) that say what a pass lost under data.on_error=skip
LOSS_COUNTERS = ("shards_failed", "samples_lost", "samples_skipped")


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor field of `batch` on `device`; other fields (keys, strings, dicts) as they are."""
    if device.type == "cpu":  # the loader's tensors are on the CPU already
        return batch
    # non_blocking only from pinned memory (the loader pins batches for CUDA devices unless
    # data.pin_memory=false): an asynchronous copy needs page-locked source memory.
    return {
        k: v.to(device, non_blocking=v.is_pinned()) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def require_items(loader: ShardedLoader, key: str, spec: str, seq_len: int) -> None:
    """Refuse data to evaluate on that holds nothing to evaluate (its metrics would be 0/0).

    Checked before any work: a training would otherwise fail at its first evaluation.
    """
    if sum(loader.shard_sizes):
        return
    why = (
        f"no sequence of data.seq_len={seq_len}: every shard holds fewer than {seq_len + 1} "
        "tokens (lower data.seq_len or give more text)"
        if seq_len
        else "no samples"
    )
    raise ConfigError(f"{key}={spec}: {why}")


def too_few_batches(cfg: Config, plan: EpochPlan, data: str) -> str:
    """Why an epoch of `data` gives no optimizer step: the batch, or the batches one step
    accumulates, against the samples each rank reads, in the user's words."""
    ranks, accum, batch = plan.world_size, cfg.train.grad_accum_steps, cfg.data.batch_size
    kind = "sequences" if cfg.data.seq_len else "samples"
    per_rank = plan.num_samples // ranks
    where = f"{per_rank} {kind} per rank ({data}: {plan.num_samples} over {ranks} rank(s))"
    if accum == 1:
        return (
            f"data.batch_size={batch}: batch_size {batch} > {where}; "
            f"set data.batch_size to {max(1, per_rank)} or less"
        )
    return (
        f"data.batch_size={batch}: train.grad_accum_steps={accum} batches of {batch} "
        f"({batch * accum}) > {where}; lower data.batch_size or train.grad_accum_steps"
    )


@torch.no_grad()
def evaluate(
    task: Task,
    model: nn.Module,
    loader: ShardedLoader,
    precision: Any,
    device: torch.device,
    *,
    copies: int = 1,
    share: Share | None = None,
    label: str = "evaluation",
) -> dict[str, Any]:
    """`val_<metric>` over all of `loader`'s data once, and `val_samples`; with a task that
    answers prompts (`eval.generate`), `val_exact_match` and `val_token_f1` too.

    The task's `eval_metrics` sums (padded samples, `valid=False`, left out by the task) are
    added over batches here and over ranks in one all-reduce, then its `summarize` (default:
    divide by `count`) makes the final metrics. Every rank must call it (the loader gives
    every rank the same number of batches). The model's train/eval mode is restored.

    Args:
        precision: the run's precision plan (its `autocast()` context).
        copies: ranks that evaluate the same batches (a tensor-parallel group), counted once.
        share: this rank's share of the prompts a task answers (`eval.generate`: its
            `answer_sums`, counts added to the same all-reduce); default: this process alone.
        label: what the progress lines of a long evaluation call it (rank 0 only).
    """
    was_training = model.training
    model.eval()
    loader.set_epoch(0)
    sums: dict[str, torch.Tensor] = {}
    main = not dist.is_initialized() or dist.get_rank() == 0
    ticker = Ticker(label, total=len(loader), enabled=main)
    for batch in loader:
        with precision.autocast():
            values = task.eval_metrics(model, to_device(batch, device))
        for name, value in values.items():
            value = value.detach().double()
            sums[name] = sums[name] + value if name in sums else value
        ticker.update()
    if getattr(task, "generates_answers", False):
        if main:  # greedy decoding, token by token: seconds to minutes
            log.info("%s: generating the answers to the held-out prompts (eval.generate)", label)
        with precision.autocast():
            answered = task.answer_sums(model, share or Share())  # type: ignore[attr-defined]
        sums.update({name: value.double() for name, value in answered.items()})
    model.train(was_training)
    totals = {name: total.cpu() / copies for name, total in all_reduce_tensors(sums).items()}
    summarize = getattr(task, "summarize", divide_by_count)
    record = {f"val_{name}": float(value) for name, value in summarize(totals).items()}
    record["val_samples"] = int(totals["count"]) if "count" in totals else 0
    return record


def loss_counters(loader: ShardedLoader, device: torch.device) -> dict[str, int]:
    """`loader_<counter>` of what every rank's loader lost (failed shards, skipped samples)."""
    stats = loader.stats()
    local = {name: torch.tensor(float(stats[name]), device=device) for name in LOSS_COUNTERS}
    totals = all_reduce_tensors(local)
    return {f"loader_{name}": int(totals[name]) for name in LOSS_COUNTERS}
