"""Evaluation: the task's metrics over a dataset, summed over batches and ranks.

One implementation serves the Trainer's periodic and final evaluations and `hpctrain eval`
(`run_eval`: a checkpoint's model over `data.val`, under the same launchers as training).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.data import ShardedLoader
from hpctrain.data.index import redact_url
from hpctrain.dist import all_reduce_tensors
from hpctrain.errors import UsageError
from hpctrain.train.task import Batch, Task, divide_by_count
from hpctrain.train.trackers import check_trackers

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


@torch.no_grad()
def evaluate(
    task: Task,
    model: nn.Module,
    loader: ShardedLoader,
    precision: Any,
    device: torch.device,
    *,
    copies: int = 1,
) -> dict[str, Any]:
    """`val_<metric>` over all of `loader`'s data once, and `val_samples`.

    The task's `eval_metrics` sums (padded samples, `valid=False`, left out by the task) are
    added over batches here and over ranks in one all-reduce, then its `summarize` (default:
    divide by `count`) makes the final metrics. Every rank must call it (the loader gives
    every rank the same number of batches). The model's train/eval mode is restored.

    Args:
        precision: the run's precision plan (its `autocast()` context).
        copies: ranks that evaluate the same batches (a tensor-parallel group), counted once.
    """
    was_training = model.training
    model.eval()
    loader.set_epoch(0)
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        with precision.autocast():
            values = task.eval_metrics(model, to_device(batch, device))
        for name, value in values.items():
            value = value.detach().double()
            sums[name] = sums[name] + value if name in sums else value
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


def data_name(spec: str) -> str:
    """A short file-name-safe name for a dataset spec: `data/val/index.json` → `val`."""
    path = spec.rstrip("/").split("?", 1)[0]
    parts = [p for p in re.split(r"[/\\]", path) if p]
    leaf = parts[-1] if parts else "data"
    if leaf == "index.json" and len(parts) > 1:
        leaf = parts[-2]
    leaf = re.sub(r"\.(json|tar)$", "", leaf)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", leaf) or "data"


def record_name(spec: str) -> str:
    """The data's part of an eval record's name: `data_name` and 8 hex digits of the resolved
    path (`val-1a2b3c4d`), so two data folders with one last name get two records."""
    spec = spec.split("?", 1)[0].rstrip("/")
    if "://" in spec:
        canonical = redact_url(spec)
    else:
        canonical = str(Path(spec).resolve())
    canonical = canonical.removesuffix("/index.json")
    return f"{data_name(spec)}-{hashlib.sha256(canonical.encode()).hexdigest()[:8]}"


def check_record_path(out: str) -> None:
    """Refuse an `--out` that cannot be the record's file (a folder), before any work."""
    if out and Path(out).is_dir():
        raise UsageError(f"--out {out}: is a folder; give the record's file name")


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """`path` holds the whole record or nothing: written to a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:  # a folder in the way, a read-only place, a full disk
        raise UsageError(f"{path}: cannot write the record: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


def run_eval(cfg: Config, *, checkpoint: str = "latest", out: str = "") -> int:
    """`hpctrain eval` in this process, as one rank of the job; returns the exit code.

    Loads the model of `checkpoint` (`latest`, `best`, or a path: see
    `hpctrain.train.inference.find_checkpoint`), evaluates it over `cfg.data.val` with the
    task's `eval_metrics`/`summarize`, and rank 0 prints the record as one JSON line on
    stdout, writes it to `out` (default `RUN_DIR/eval/step-<N>.<data>-<hash>.json`, see
    `record_name`) and sends it to the trackers `logging.*` turns on.

    Raises:
        UsageError: `out` is a folder or cannot be written.
    """
    from hpctrain.train.inference import inference_session

    check_record_path(out)
    with inference_session(cfg, checkpoint, cfg.data.val, key="data.val", predict=False) as run:
        require_items(run.loader, "data.val", cfg.data.val, cfg.data.seq_len)
        if run.env.is_main:
            check_trackers(cfg.logging)  # a missing package fails before the work, not after
        metrics = evaluate(run.task, run.model, run.loader, run.precision, run.device)
        lost = loss_counters(run.loader, run.device)
        if not run.env.is_main:
            return 0
        name = data_name(cfg.data.val)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": run.step,
            "checkpoint": run.checkpoint,
            "weights": run.weights,
            "data": run.data,
            "world_size": run.env.world_size,
            **metrics,
            **lost,
        }
        default = Path(cfg.run_dir) / "eval" / f"step-{run.step}.{record_name(cfg.data.val)}.json"
        path = Path(out) if out else default
        record["record"] = str(path)
        write_json_atomic(path, record)
        print(json.dumps(record), flush=True)
        log_to_trackers(cfg, record, name, run.env.world_size)
        if any(lost.values()):
            log.warning(
                "evaluation lost data under data.on_error=skip: %s",
                ", ".join(f"{k} {v}" for k, v in lost.items() if v),
            )
        return 0


def log_to_trackers(cfg: Config, record: dict[str, Any], name: str, world_size: int) -> None:
    """Send the record to the run's tracked run (W&B/MLflow) as `eval.<data>/<metric>`.

    Its own kind (`eval.<data>`) keeps it apart from the training's evaluations, which the
    trackers have at the same steps.
    """
    from hpctrain.train.trackers import start_trackers

    trackers = start_trackers(cfg, world_size, resumed=True)
    if trackers is None:
        return
    kind = f"eval.{name}"
    values = {
        f"{kind}/{k}": v
        for k, v in record.items()
        if k.startswith(("val_", "loader_")) and isinstance(v, (int, float))
    }
    status = "failed"
    try:
        trackers.log({"kind": kind, "step": record["step"], **values})
        status = "finished"
    finally:
        trackers.close(status)
