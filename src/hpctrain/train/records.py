"""What the Trainer writes about a run: train and eval records, the sample log, the summary.

A part of `Trainer` (`train/trainer.py`), split out by job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import CheckpointManager
from hpctrain.config import Config
from hpctrain.data import ShardedLoader
from hpctrain.distributed import DistEnv, all_reduce_sum
from hpctrain.files import write_atomic
from hpctrain.models.flops import throughput_fields
from hpctrain.observe.gpu_stats import GpuCounters
from hpctrain.observe.heartbeat import Progress
from hpctrain.observe.metrics import IntervalMeter, epoch_text, peak_memory_mb
from hpctrain.parallel.parallelize import broadcast_buffers
from hpctrain.parallel.precision import Precision, TrainingPlan
from hpctrain.tasks.answers import Share
from hpctrain.tasks.task import Batch, Task, summary_line
from hpctrain.train.evaluation import evaluate


class RunRecords:
    """`Trainer.evaluate`, the train records, the `data.sample_log` audit trail, the summary."""

    cfg: Config
    env: DistEnv
    plan: TrainingPlan  # the mesh: data-parallel ranks and TP groups
    device: torch.device
    run_dir: Path
    task: Task
    model: torch.nn.Module
    ema: Any  # hpctrain.train.ema.EMA, or None
    precision: Precision
    loader: ShardedLoader
    val_loader: ShardedLoader | None
    meter: IntervalMeter
    gpu_counters: GpuCounters
    checkpoints: CheckpointManager
    state: Any  # hpctrain.train.checkpointing.TrainState
    lr: float
    grad_norm: torch.Tensor
    free_gradients: Callable[[], None]  # Checkpointing's
    progress: Progress  # the rank's heartbeat for its watcher
    num_epochs: int  # the epochs the console counts to (0: not shown)
    first_step: int  # the step this process started from
    total_steps: int

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """`evaluate_now` with the watcher's allowance of an evaluation."""
        with self.progress.phase("eval"):
            return self.evaluate_now()

    def evaluate_now(self) -> dict[str, Any]:
        """Metrics over all of `data.val` (padded samples are masked out, so counted once).

        The task's sums are added over batches here and over ranks in one all-reduce, then
        its `summarize` (default: divide by `count`) makes the final metrics.
        """
        assert self.val_loader is not None
        start = time.perf_counter()
        record: dict[str, Any] = {
            "kind": "eval",
            "step": self.state.step,
            "epoch": self.state.epoch,
        }
        self.free_gradients()
        broadcast_buffers(self.model)  # FSDP2: rank 0's BatchNorm statistics, as under DDP
        ema = self.ema if self.cfg.train.ema_eval else None
        if ema is not None:
            ema.swap()  # the EMA into the model for this evaluation, swapped back below
        try:
            record.update(
                evaluate(
                    self.task,
                    self.model,
                    self.val_loader,
                    self.precision,
                    self.device,
                    label=f"evaluation of step {self.state.step}",
                    copies=self.plan.tp,  # a TP group evaluates the same batches
                    share=Share(
                        rank=self.plan.data_parallel_rank(self.env.rank),
                        size=self.plan.data_parallel_size,
                        lockstep=self.env.is_distributed,  # sharded or split models decode together
                    ),
                )
            )
        finally:
            if ema is not None:
                ema.swap()
        if self.ema is not None:
            record["weights"] = "ema" if ema is not None else "model"
        record["eval_time_s"] = time.perf_counter() - start  # the run's goodput counts it
        return record

    def log_record(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            # Steps only queue GPU work; the work still queued belongs to this interval's steps.
            start = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.meter.step_time += time.perf_counter() - start
        summary = self.meter.summarize(self.device, self.env.world_size)
        self.meter.reset()
        record: dict[str, Any] = {
            "kind": "train",
            "step": self.state.step,
            "epoch": self.state.epoch,
        }
        record.update(summary)
        # tokens/s and MFU for tasks that define tokens_per_sample (causal_lm)
        record.update(
            throughput_fields(self.task, summary["samples_per_s"], self.env.world_size, self.device)
        )
        record["lr"] = self.lr
        record["grad_norm"] = float(self.grad_norm)  # of the logged step
        record["peak_memory_mb"] = peak_memory_mb(self.device)
        record.update(self.gpu_counters.read())  # CUDA with NVML only
        record["samples_seen"] = self.state.samples_seen
        for name, value in self.loader.stats().items():
            record[f"loader_{name}"] = value
        per_source = self.loader.source_stats()  # a mixture's (every rank has one or none)
        if per_source:
            totals = all_reduce_sum([float(v) for v in per_source.values()], self.device)
            record.update({name: int(v) for name, v in zip(per_source, totals, strict=True)})
        return record

    def log_samples(self, batch: Batch) -> None:
        """The audit trail of `data.sample_log`: which keys this rank trained on at which step."""
        if not self.cfg.data.sample_log or self.env.rank % self.plan.tp:
            return  # one log per data-parallel rank: a TP group trains on the same keys
        keys = [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]
        with self.sample_log_path().open("a") as f:
            f.write(
                json.dumps({"step": self.state.step + 1, "epoch": self.state.epoch, "keys": keys})
                + "\n"
            )

    def sample_log_path(self) -> Path:
        rank = self.plan.data_parallel_rank(self.env.rank)
        return self.run_dir / "samples" / f"rank-{rank}.jsonl"

    def truncate_sample_log(self) -> None:
        """Drop audit lines of steps after the checkpoint: they are trained again."""
        path = self.sample_log_path()
        if self.env.rank % self.plan.tp or not path.exists():
            return  # the TP group's first rank owns the log (log_samples)
        kept = [
            line
            for line in path.read_text().splitlines()
            if json.loads(line)["step"] <= self.state.step
        ]
        write_atomic(path, "".join(line + "\n" for line in kept).encode(), durable=False)

    def print_summary(self, final_eval: dict[str, Any] | None) -> None:
        lines = [
            f"finished {self.state.step} steps ({self.state.samples_seen} samples, "
            f"epoch {epoch_text(self.state.epoch, self.num_epochs)})"
        ]
        if final_eval is not None:
            lines.append(summary_line(self.task, final_eval))
        lines.append(f"run folder: {self.run_dir}")
        latest = self.checkpoints.latest_step()
        if latest is None:
            lines.append("checkpoint: none saved (checkpoint.final=false)")
        else:
            lines.append(f"checkpoint: {self.checkpoints.root}/step-{latest}")
        print("\n".join(lines), flush=True)

    def complete_line(self) -> str:
        """What a run resumed at (or past) its last step says instead of training."""
        train = self.cfg.train
        key = "train.max_steps" if train.max_steps else "train.max_epochs"
        value = train.max_steps or train.max_epochs
        return (
            f"run complete: {self.run_dir} is at step {self.first_step} of {self.total_steps} "
            f"({key}={value}): nothing trained; to train further, a larger {key}; "
            "to start again, another run_dir (or --checkpoint none)"
        )
