"""One optimizer step of the Trainer (`train_step`): micro-batches, backward, clip, step.

A part of `Trainer` (`train/trainer.py`), split out by job: it reads the Trainer's model,
optimizer, scaler, EMA, scheduler, meter and counters, built in `Trainer.__init__`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.config import Config
from hpctrain.distributed import DistEnv
from hpctrain.observe.heartbeat import Progress
from hpctrain.observe.metrics import GpuForwardTimer, IntervalMeter
from hpctrain.parallel.grad_norm import clip_grad_norm, global_grad_norm
from hpctrain.parallel.parallelize import no_gradient_sync
from hpctrain.parallel.precision import Precision, TrainingPlan
from hpctrain.tasks.task import Batch, Task, count_targets
from hpctrain.train.evaluation import to_device

log = logging.getLogger("hpctrain")

# warn when at least this share of a start's steps (10 or more) had no target
EMPTY_STEPS_WARNED = 0.1


class OptimizerStep:
    """`Trainer.train_step` and the gradient norm it logs."""

    cfg: Config
    env: DistEnv
    plan: TrainingPlan  # the mesh: data-parallel ranks and TP groups
    device: torch.device
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    ema: Any  # hpctrain.train.ema.EMA, or None
    precision: Precision
    meter: IntervalMeter
    state: Any  # hpctrain.train.checkpointing.TrainState
    total_steps: int
    lr: float
    grad_norm: torch.Tensor
    log_samples: Callable[[Batch], None]  # RunRecords'
    flag_group: Any  # a CPU process group of every rank (None: one process)
    empty_steps: int  # steps of this start without any target (`watch_empty_steps`)
    warned_empty: bool
    first_step: int  # the step this start began at
    progress: Progress  # the rank's heartbeat for its watcher

    def train_step(self, batches: Iterator[Batch]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches.

        The step's loss is the mean over all its targets (`count_targets`: masked tokens,
        labelled pixels, valid samples) on every data-parallel rank: each micro-batch's mean
        is weighed by its share of them. So accumulation and the number of ranks do not
        change the loss or the gradients: batch 4 on one rank equals 4 micro-batches of 1
        and 2 ranks of 2. The count is known before any forward: the step takes its
        micro-batches first and adds their counts over the ranks in one all-reduce on the
        CPU group (`flag_group`), which never waits for the device.
        """
        start = time.perf_counter()
        self.meter.clock.start_step()
        accum = self.cfg.train.grad_accum_steps
        data_wait, num_samples = 0.0, 0
        micro_batches: list[Batch] = []
        for _ in range(accum):
            wait_start = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - wait_start
            self.log_samples(batch)
            num_samples += len(batch["key"])
            micro_batches.append(batch)
        self.progress.data_ready()  # a rank stuck in its loader beats no further
        counts = [count_targets(self.task, batch) for batch in micro_batches]
        step_targets = self.count_step_targets(sum(counts))
        # DDP and FSDP average the gradients over the data-parallel ranks: weigh by that
        # many times the micro-batch's share, so that the average is the step's mean.
        ranks = self.plan.data_parallel_size
        # a TP group's ranks compute the same values: the first one's count in the logs
        logged = 1.0 if self.env.rank % self.plan.tp == 0 else 0.0
        loss_sum: torch.Tensor | float = 0.0
        metric_sums: dict[str, torch.Tensor] = {}
        # Here, not right after the optimizer step: freeing the gradients there costs ~5% of a
        # resnet18 step on a CPU (glibc hands the freed heap back to the OS, and the next forward
        # page-faults it in again; BENCHMARKS.md). `free_gradients` drops them before a save.
        self.optimizer.zero_grad(set_to_none=True)
        for micro, count in enumerate(counts):
            share = count / step_targets if step_targets else 0.0
            batch = to_device(micro_batches[micro], self.device)
            micro_batches[micro] = {}  # its memory goes back as soon as it is on the device
            with no_gradient_sync(self.model, skip=micro < accum - 1):
                with self.precision.autocast():
                    loss, values = self.task.loss(self.model, batch)
                weight = share * ranks
                scaled = loss * weight if weight != 1.0 else loss
                if micro == accum - 1:  # up to the first gradient collective: the straggler check
                    compute_time = time.perf_counter() - start - data_wait
                    self.meter.clock.mark("backward")
                    if self.meter.gpu_forward is not None:
                        self.meter.gpu_forward.backward_starts()
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            # Sums stay on the device: nothing waits for them until a log step. Summed over
            # the ranks (a log step's all-reduce) they are the step's loss and metrics.
            detached = loss.detach().float() * (share * logged)  # float(): a task's bf16
            loss_sum = detached if micro == 0 else loss_sum + detached
            for name, value in values.items():
                value = value.detach().float() * (share * logged)
                metric_sums[name] = value if micro == 0 else metric_sums[name] + value
        if step_targets:
            self.clip_and_measure_gradients()
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        else:
            # Nothing to learn from (every rank's batches hold no target): no update, as
            # AdamW's momentum and weight decay would still move the weights.
            self.grad_norm = torch.zeros(())
        group = self.optimizer.param_groups[0]  # the rate this step used, of train.lr itself
        self.lr = group["lr"] / group.get("lr_scale", 1.0)
        self.scheduler.step()
        self.state.step += 1
        self.state.samples_seen += num_samples * self.plan.data_parallel_size
        self.watch_empty_steps(empty=not step_targets)
        assert isinstance(loss_sum, torch.Tensor)
        self.meter.add(
            samples=num_samples if logged else 0,
            step_time=time.perf_counter() - start,
            data_wait=data_wait,
            values={"loss": loss_sum, **metric_sums},
            compute_time=compute_time,
            targets=step_targets,
        )

    def count_step_targets(self, local: int) -> int:
        """The step's targets on every data-parallel rank: one all-reduce of this rank's on
        the CPU group (the ranks of a TP group count the same batches: once)."""
        if self.flag_group is None:
            return local
        total = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(total, group=self.flag_group)
        return int(total.item()) // self.plan.tp

    def watch_empty_steps(self, empty: bool) -> None:
        """Count the steps without any target; warn once when they are a large share."""
        self.empty_steps += empty
        steps = self.state.step - self.first_step
        judged = steps >= min(10, self.total_steps - self.first_step)  # not on a few steps
        if self.warned_empty or not judged or self.empty_steps < EMPTY_STEPS_WARNED * steps:
            return
        self.warned_empty = True
        if self.env.is_main:
            log.warning(
                "%d of the %d steps so far had no target on any rank (nothing the loss "
                "counts: e.g. instruction prompts that fill data.seq_len): they train nothing "
                "and are left out of the logged loss (`empty_steps` in the train records); "
                "check the data (hpctrain inspect) or raise data.seq_len",
                self.empty_steps,
                steps,
            )

    def watch_sync_points(self) -> None:
        """Mark this rank's arrival at the model's call, before any wrapper's collective
        (DDP's buffer broadcast, FSDP2's first all-gather), and on GPUs start the forward's
        device timer there: the straggler check (`observe.metrics.StragglerWatch`)."""
        clock = self.meter.clock
        gpu = None
        if self.device.type == "cuda":
            gpu = self.meter.gpu_forward = GpuForwardTimer()

        def at_model_call(module: torch.nn.Module, args: Any) -> None:
            if module.training:  # not an evaluation's forward
                clock.mark("model_call")
                if gpu is not None:
                    gpu.forward_starts()

        # first among the forward pre-hooks: FSDP2's own gathers the root's parameters
        self.model.register_forward_pre_hook(at_model_call, prepend=True)

    def clip_and_measure_gradients(self) -> None:
        """Clip to `train.grad_clip`, and keep the global gradient norm for the next log line.

        Without clipping the norm is computed only before a logged step: it reads every
        gradient once more (a few % of a small model's step on a CPU), for a number that is
        only ever logged.
        """
        clip = self.cfg.train.grad_clip
        if not clip and not self.is_log_step(self.state.step + 1):
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the norm of the true gradients
        # one order of summation under DDP, FSDP2 and HSDP: the same norm, bit for bit
        if clip:
            norm = clip_grad_norm(self.model.parameters(), clip)
        else:
            norm = global_grad_norm(self.model.parameters())
        self.grad_norm = norm.detach().float()

    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.total_steps
