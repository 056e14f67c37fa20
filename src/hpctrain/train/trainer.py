"""The Trainer: builds everything from the config, then runs one readable loop (`fit`)."""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from hpctrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelOptimizerState,
    PerRankState,
    RNGState,
)
from hpctrain.config import Config, ConfigError, config_to_yaml
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.index import ShardIndex
from hpctrain.data.mixture import describe as describe_train
from hpctrain.data.mixture import open_train_index
from hpctrain.dist import DistEnv, all_reduce_sum, new_cpu_group
from hpctrain.train import init_from
from hpctrain.train.classes import (
    ClassNamesError,
    check_class_names,
    checkpoint_class_names,
    differ,
    mismatch,
)
from hpctrain.train.ema import CHECKPOINT_KEY as EMA_KEY
from hpctrain.train.ema import build_ema
from hpctrain.train.evaluation import evaluate, require_items, to_device
from hpctrain.train.flops import throughput_fields
from hpctrain.train.gpu_stats import GpuCounters
from hpctrain.train.hangs import HangWatch
from hpctrain.train.memory import OOMSnapshots
from hpctrain.train.metrics import IntervalMeter, MetricMonitor, MetricsWriter, peak_memory_mb
from hpctrain.train.optim import (
    build_optimizer,
    build_scheduler,
    check_same_groups,
    freeze_parameters,
)
from hpctrain.train.parallel import broadcast_buffers, no_gradient_sync, parallelize
from hpctrain.train.precision import device_facts, make_grad_scaler, plan_training
from hpctrain.train.preemption import REQUEUE_EXIT_CODE, PreemptionFlag
from hpctrain.train.profiling import StepProfiler
from hpctrain.train.task import Batch, load_task, summary_line
from hpctrain.train.trackers import check_trackers, start_trackers

log = logging.getLogger("hpctrain")

SCALER_KEY = "scaler"  # fp16's gradient scaler in checkpoints (no other precision saves one)


class TrainState:
    """Counters that make a run resumable: optimizer steps, epoch, samples trained on."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.samples_seen = (
            int(state["step"]),
            int(state["epoch"]),
            int(state["samples_seen"]),
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def require_tensorboard() -> None:
    """Fail before any work when `logging.tensorboard` is on but tensorboard is missing."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package: "
            "pip install 'hpctrain[tensorboard]' (or set logging.tensorboard=false)"
        ) from None


def config_changes(cfg: Config, saved: object, limit: int = 8) -> list[str]:
    """`key=value (saved: old)` for each key where `cfg` differs from a checkpoint's saved
    config (its YAML text); [] when there is none to compare with."""
    if not isinstance(saved, str):
        return []
    try:
        old = yaml.safe_load(saved)
    except yaml.YAMLError:
        return []
    if not isinstance(old, dict):
        return []

    def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    new, old = flat(yaml.safe_load(config_to_yaml(cfg))), flat(old)  # both as YAML reads them
    changed = [
        f"{key}={new.get(key)!r} (saved: {old.get(key)!r})"
        for key in sorted(new.keys() | old.keys())
        if new.get(key) != old.get(key) and key != "checkpoint.resume"
    ]
    if len(changed) > limit:
        changed[limit:] = [f"and {len(changed) - limit} more"]
    return changed


class Trainer:
    """Everything a run needs, built once from the config, and the training loop."""

    def __init__(self, cfg: Config, env: DistEnv, device: torch.device) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.run_dir = Path(cfg.run_dir)
        self.check_config()
        self.configure_torch()
        train_index = open_train_index(cfg.data)  # one index, or a mixture of sources
        self.task = load_task(cfg, train_index)
        self.build_model()
        self.build_loaders(train_index)
        self.plan_steps()
        self.build_run_state()

    def check_config(self) -> None:
        """Refuse what cannot train (bf16 on a V100, no data, ...) before any model or loader work."""
        cfg = self.cfg
        if not cfg.data.train:
            raise ConfigError("data.train is empty: give an index.json path/URL or a shard pattern")
        if cfg.logging.tensorboard and self.env.is_main:
            require_tensorboard()
        if self.env.is_main:
            check_trackers(cfg.logging)
        if cfg.checkpoint.monitor and not cfg.data.val:
            raise ConfigError(
                f"checkpoint.monitor={cfg.checkpoint.monitor}: needs data.val (evaluations to rank by)"
            )
        # Both refuse bad settings here; they hold the run's state from here on.
        self.monitor = MetricMonitor(
            cfg.checkpoint.monitor,
            cfg.checkpoint.mode,
            cfg.checkpoint.keep_best,
            cfg.train.early_stop_patience,
        )
        self.profiler = StepProfiler(
            cfg.profile.steps,
            cfg.profile.ranks,
            rank=self.env.rank,
            world_size=self.env.world_size,
            run_dir=self.run_dir,
            device=self.device,
        )
        if cfg.train.ema_decay >= 1 or (cfg.train.ema_eval and not cfg.train.ema_decay):
            raise ConfigError(
                f"train.ema_decay={cfg.train.ema_decay}: must be in (0, 1) (e.g. 0.999); "
                "0 disables the EMA (and then train.ema_eval must be false)"
            )
        # Before the model is built: a recorded allocation history then shows its weights too.
        self.memory = OOMSnapshots(
            self.device,
            self.run_dir,
            self.env.rank,
            enabled=cfg.profile.oom_snapshot,
            history=cfg.profile.memory_history,
        )
        facts = device_facts(self.device, compile=cfg.train.compile)
        self.plan = plan_training(cfg.train, facts, self.env.world_size)
        self.precision = self.plan.precision

    def configure_torch(self) -> None:
        """Deterministic algorithms or fast kernels, and the global seeds."""
        if self.cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.device.type == "cuda":
            # Fixed input shapes: let cuDNN pick the fastest kernels; TF32 for fp32 matmuls.
            torch.backends.cudnn.benchmark = True
            torch.set_float32_matmul_precision("high")
        seed_everything(self.cfg.seed)

    def build_model(self) -> None:
        """The task's model, moved, wrapped and sharded; its optimizer and gradient scaler."""
        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank (FSDP2 needs it)
        init_from.check(self.cfg, self.task)
        model = self.task.build_model()
        trainable, frozen = freeze_parameters(model, self.cfg.train.freeze)  # before wrapping
        log.info(
            "parameters: %s trainable, %s frozen (train.freeze)", f"{trainable:,}", f"{frozen:,}"
        )
        self.model = parallelize(
            model,
            self.cfg.train,
            self.plan,
            self.device,
            channels_last=self.cfg.model.channels_last,
        )
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        self.ema = build_ema(self.model, self.cfg.train.ema_decay)  # None when disabled
        self.scaler = make_grad_scaler(self.precision)

    def build_loaders(self, train_index: ShardIndex) -> None:
        """The training loader and, with `data.val`, the evaluation loader.

        The task's optional `decode`/`collate` hooks replace the loader's defaults; they run
        in the loader workers like the transforms.
        """
        cfg = self.cfg
        loader_args: dict[str, Any] = {
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "seed": cfg.seed,
            "device": self.device,
        }
        for hook in ("decode", "collate"):
            if hasattr(self.task, hook):
                loader_args[hook] = getattr(self.task, hook)
        self.loader = ShardedLoader(
            train_index, cfg.data, transform=self.task.train_transform(), train=True, **loader_args
        )
        self.val_loader = None
        self.class_names = train_index.class_names  # stored in every checkpoint
        if cfg.data.val:
            val_index = open_index(cfg.data.val, allow_pipe=cfg.data.allow_pipe)
            check_class_names(self.class_names, "data.train", val_index.class_names, "data.val")
            self.val_loader = ShardedLoader(
                val_index,
                cfg.data,
                transform=self.task.eval_transform(),
                train=False,
                **loader_args,
            )
            require_items(self.val_loader, "data.val", cfg.data.val, cfg.data.seq_len)

    def plan_steps(self) -> None:
        """Steps per epoch and in all (known before the first batch), and the LR schedule."""
        cfg = self.cfg
        self.loader.set_epoch(0)
        self.steps_per_epoch = len(self.loader) // cfg.train.grad_accum_steps
        if cfg.train.overfit_batches:
            self.steps_per_epoch = max(1, cfg.train.overfit_batches // cfg.train.grad_accum_steps)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"data.batch_size={cfg.data.batch_size}: {describe_train(cfg.data.train)} gives each of {self.env.world_size} ranks "
                f"fewer than train.grad_accum_steps={cfg.train.grad_accum_steps} batches per epoch"
            )
        self.total_steps = cfg.train.max_steps or cfg.train.max_epochs * self.steps_per_epoch
        if self.total_steps == 0:
            raise ConfigError("train.max_steps=0 and train.max_epochs=0: set one of them")
        self.scheduler = build_scheduler(self.optimizer, cfg.train, self.total_steps)

    def build_run_state(self) -> None:
        """Counters, the checkpoint manager, the preemption flag and the meters."""
        cfg = self.cfg
        self.state = TrainState()
        self.checkpoints = CheckpointManager(
            cfg.checkpoint_root(),
            keep_last=cfg.checkpoint.keep_last,
            keep_every=cfg.checkpoint.keep_every,
            async_save=cfg.checkpoint.async_save,
            verify=cfg.checkpoint.verify,
            timeout_s=cfg.train.collective_timeout_s,
            monitor=cfg.checkpoint.monitor,
            mode=cfg.checkpoint.mode,
            keep_best=cfg.checkpoint.keep_best,
        )
        self.preemption = PreemptionFlag(cfg.checkpoint.signals, cfg.checkpoint.deadline_margin_s)
        self.hangs = HangWatch(
            self.run_dir,
            self.env.rank,
            step_timeout_s=cfg.train.step_timeout_s,
            collective_timeout_s=cfg.train.collective_timeout_s,
            dump_on_usr1=signal.SIGUSR1 not in self.preemption.signals,
        )
        self.meter = IntervalMeter()
        self.lr = 0.0
        self.grad_norm = torch.zeros(())
        # Ranks agree on preemption flags every step. On a CPU (gloo) group, reading the result
        # never waits for the GPU; on the NCCL group it would sync the host with the device.
        self.flag_group: Any = None
        if self.env.is_distributed:
            self.flag_group = (
                new_cpu_group(cfg.train.collective_timeout_s)
                if self.device.type == "cuda"
                else dist.group.WORLD
            )
        self.gpu_counters = GpuCounters(self.device, self.flag_group)
        self.last_save = time.monotonic()
        self.resumed_loader = False
        self.last_eval: dict[str, Any] | None = None  # the newest evaluation record

    # ---------------------------------------------------------------- the loop
    def fit(self) -> int:
        """Train to `total_steps`; returns 0, or REQUEUE_EXIT_CODE after a preemption save."""
        self.prepare_run_dir()
        self.preemption.install()
        self.resume()
        self.write_run_config()
        metrics = MetricsWriter(
            self.run_dir,
            enabled=self.env.is_main,
            progress=self.cfg.logging.progress,
            total_steps=self.total_steps,
            tensorboard=self.cfg.logging.tensorboard,
            trackers=start_trackers(
                self.cfg,
                self.env.world_size,
                resumed=self.checkpoints.loaded_manifest is not None,
            )
            if self.env.is_main
            else None,
        )
        batches = self.batch_stream()
        self.model.train()
        status = "failed"  # how the run ends, for the trackers
        try:
            self.hangs.install()  # SIGUSR1 and train.step_timeout_s: stacks in RUN_DIR/hangs
            while self.state.step < self.total_steps:
                self.profiler.at_step(self.state.step)
                with self.memory.watch(self.state.step + 1), self.hangs.step(self.state.step + 1):
                    self.train_step(batches)
                if self.step_boundary(metrics):
                    status = "preempted"
                    return REQUEUE_EXIT_CODE
                if self.monitor.should_stop:  # every rank has the same evaluations
                    log.warning(
                        "early stop at step %d: %d evaluations without a better %s",
                        self.state.step,
                        self.monitor.evals_since_best,
                        self.monitor.name,
                    )
                    break
            self.profiler.close()
            if self.checkpoints.latest_step() != self.state.step:
                self.save()  # before the final evaluation: one that fails loses no training
            final_eval = self.last_eval  # the last step's, when eval_every evaluated it
            if final_eval is not None and final_eval["step"] != self.state.step:
                final_eval = None
            if final_eval is None and self.val_loader is not None:
                final_eval = self.evaluate()
                metrics.write(final_eval)
                self.monitor.observe(final_eval)
                if self.monitor.name:  # the saved step's score and monitor state, for best
                    self.checkpoints.annotate(
                        self.state.step,
                        metadata=self.checkpoint_metadata(),
                        score=self.monitor.score_at(self.state.step),
                    )
            self.checkpoints.wait()
            if self.env.is_main:
                self.print_summary(final_eval)
            status = "finished"
            return 0
        except Exception as exc:
            self.hangs.report_timeout(exc)  # a timed-out collective: dump, name the folder
            raise
        finally:
            self.hangs.uninstall()
            self.profiler.close()
            self.memory.close()
            metrics.close(status)
            self.checkpoints.close()
            self.preemption.uninstall()
            for loader in (self.loader, self.val_loader):
                if loader is not None:
                    loader.close()  # its workers too, now rather than at exit

    def train_step(self, batches: Iterator[Batch]) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        start = time.perf_counter()
        accum = self.cfg.train.grad_accum_steps
        data_wait, num_samples = 0.0, 0
        loss_sum: torch.Tensor | float = 0.0
        metric_sums: dict[str, torch.Tensor] = {}
        # Here, not right after the optimizer step: freeing the gradients there costs ~5% of a
        # resnet18 step on a CPU (glibc hands the freed heap back to the OS, and the next forward
        # page-faults it in again; BENCHMARKS.md). `free_gradients` drops them before a save.
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(accum):
            wait_start = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - wait_start
            self.log_samples(batch)
            num_samples += len(batch["key"])
            batch = to_device(batch, self.device)
            with no_gradient_sync(self.model, skip=micro < accum - 1):
                with self.precision.autocast():
                    loss, values = self.task.loss(self.model, batch)
                scaled = loss / accum if accum > 1 else loss
                if micro == accum - 1:  # up to the first gradient collective: the straggler check
                    compute_time = time.perf_counter() - start - data_wait
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            # Sums stay on the device: nothing waits for them until a log step.
            detached = loss.detach().float()  # float(): a no-op unless a task returns bf16
            loss_sum = detached if micro == 0 else loss_sum + detached
            for name, value in values.items():
                value = value.detach().float()
                metric_sums[name] = value if micro == 0 else metric_sums[name] + value
        self.clip_and_measure_gradients()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        group = self.optimizer.param_groups[0]  # the rate this step used, of train.lr itself
        self.lr = group["lr"] / group.get("lr_scale", 1.0)
        self.scheduler.step()
        self.state.step += 1
        self.state.samples_seen += num_samples * self.env.world_size
        assert isinstance(loss_sum, torch.Tensor)
        values = {"loss": loss_sum, **metric_sums}
        if accum > 1:
            values = {name: value / accum for name, value in values.items()}
        self.meter.add(
            samples=num_samples,
            step_time=time.perf_counter() - start,
            data_wait=data_wait,
            values=values,
            compute_time=compute_time,
        )

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
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of the global norm
            norm = norm.full_tensor()
        self.grad_norm = norm.detach().float()

    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.train.log_every == 0 or step == self.total_steps

    def step_boundary(self, metrics: MetricsWriter) -> bool:
        """Log, evaluate and save as due after a step; True once saved for a preemption."""
        step = self.state.step
        if self.is_log_step(step):
            metrics.write(self.log_record())
        eval_every = self.cfg.train.eval_every
        saved = False  # one save per step: the best-checkpoint save also serves the others
        if self.val_loader is not None and eval_every and step % eval_every == 0:
            record = self.last_eval = self.evaluate()
            metrics.write(record)
            if self.monitor.observe(record):  # among the checkpoint.keep_best best so far
                self.save()
                saved = True
        stop_requested, time_due = self.agree_on_flags()
        if stop_requested:
            log.warning("preemption requested: saving step %d, then exiting for requeue", step)
            if not saved:
                self.save()
            self.checkpoints.wait()
            self.preemption.exit_on_signal(REQUEUE_EXIT_CODE)  # saved: a TERM now only ends us
            return True
        every_steps = self.cfg.checkpoint.every_steps
        if not saved and (time_due or (every_steps and step % every_steps == 0)):
            self.save()
        return False

    def batch_stream(self) -> Iterator[Batch]:
        """Batches across epochs; after a resume the first epoch continues where it stopped."""
        if self.cfg.train.overfit_batches:
            yield from self.overfit_stream()
            return
        while True:
            if not self.resumed_loader:
                self.loader.set_epoch(self.state.epoch)
            self.resumed_loader = False
            yield from self.loader
            self.state.epoch += 1

    def overfit_stream(self) -> Iterator[Batch]:
        """The first `train.overfit_batches` batches, repeated: the loss must go to ~0."""
        self.loader.set_epoch(0)
        cached: list[Batch] = []
        for batch in self.loader:
            cached.append(batch)
            if len(cached) == self.cfg.train.overfit_batches:
                break
        while True:
            yield from cached

    # ---------------------------------------------------------------- evaluation and logging
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Metrics over all of `data.val` (padded samples are masked out, so counted once).

        The task's sums are added over batches here and over ranks in one all-reduce, then
        its `summarize` (default: divide by `count`) makes the final metrics.
        """
        assert self.val_loader is not None
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
                evaluate(self.task, self.model, self.val_loader, self.precision, self.device)
            )
        finally:
            if ema is not None:
                ema.swap()
        if self.ema is not None:
            record["weights"] = "ema" if ema is not None else "model"
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
        if not self.cfg.data.sample_log:
            return
        keys = [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]
        with self.sample_log_path().open("a") as f:
            f.write(
                json.dumps({"step": self.state.step + 1, "epoch": self.state.epoch, "keys": keys})
                + "\n"
            )

    def sample_log_path(self) -> Path:
        return self.run_dir / "samples" / f"rank-{self.env.rank}.jsonl"

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_states(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "app": ModelOptimizerState(self.model, self.optimizer),
            "scheduler": self.scheduler,
            "trainer": self.state,
            "loader": PerRankState(self.loader),
            "rng": PerRankState(RNGState()),
        }
        if self.scaler is not None:
            states[SCALER_KEY] = self.scaler
        if self.ema is not None:
            states[EMA_KEY] = self.ema
        return states

    def free_gradients(self) -> None:
        """Drop the last step's gradients (the next step would): before a checkpoint and an
        evaluation, which then need no memory for them.

        A checkpoint must see none: DCP creates the optimizer state it lacks (every step so
        far skipped by the fp16 scaler) only for parameters without gradients, and a resume
        expects the state it creates.
        """
        self.optimizer.zero_grad(set_to_none=True)

    def save(self) -> None:
        self.free_gradients()
        broadcast_buffers(self.model)  # FSDP2: one set of BatchNorm statistics, rank 0's
        self.checkpoints.save(
            self.state.step,
            self.checkpoint_states(),
            metadata=self.checkpoint_metadata(),
            score=self.monitor.score_at(self.state.step),
        )
        self.last_save = time.monotonic()

    def checkpoint_metadata(self) -> dict[str, Any]:
        metadata = {
            "config": config_to_yaml(self.cfg),
            "monitor": self.monitor.state_dict(),
            "class_names": list(self.class_names),
        }
        if hasattr(self.task, "model_metadata"):  # e.g. causal_lm's GPT shape, for exports
            metadata.update(self.task.model_metadata())
        return metadata

    def resume(self) -> None:
        try:
            step = self.checkpoints.load(
                self.checkpoint_states(),
                which=self.cfg.checkpoint.resume,
                optional=(EMA_KEY, SCALER_KEY),
            )
        except CheckpointError as exc:
            check_same_groups(self.cfg.train, self.checkpoints.tried_manifest)
            tried = self.checkpoints.tried_manifest
            changes = config_changes(self.cfg, tried["metadata"].get("config")) if tried else []
            if not changes:
                raise
            raise type(exc)(
                f"{str(exc).rstrip('.')}; the config differs from the checkpoint's in "
                f"{', '.join(changes)}: set back the key that changes what the checkpoint "
                "holds (model, optimizer, precision), or start over with --resume none"
            ) from None
        except ValueError:  # DCP's own when the optimizer's groups differ: say which key
            check_same_groups(self.cfg.train, self.checkpoints.tried_manifest)
            raise
        if step is None:
            if self.cfg.model.init_from:
                self.init_weights()
            return
        check_same_groups(self.cfg.train, self.checkpoints.loaded_manifest)
        self.check_resumed_class_names(step)
        if self.cfg.model.init_from:
            log.info("model.init_from=%s not read: the run resumes", self.cfg.model.init_from)
        if self.ema is not None and EMA_KEY in self.checkpoints.missing_states:
            self.ema.reset()
            log.warning(
                "the checkpoint of step %d has no EMA: the EMA starts from its weights", step
            )
        if self.scaler is not None and SCALER_KEY in self.checkpoints.missing_states:
            log.warning(
                "the checkpoint of step %d has no fp16 gradient scaler (saved with another "
                "train.precision): a fresh one starts at scale %g",
                step,
                self.scaler.get_scale(),
            )
        self.resumed_loader = True
        if self.checkpoints.loaded_manifest is not None:
            self.monitor.load_state_dict(
                self.checkpoints.loaded_manifest["metadata"].get("monitor")
            )
        log.info(
            "resumed from step %d (epoch %d) of %s",
            self.state.step,
            self.state.epoch,
            self.checkpoints.loaded_from,
        )
        if self.cfg.data.sample_log:
            self.truncate_sample_log()

    def check_resumed_class_names(self, step: int) -> None:
        """Refuse to go on training on data whose labels mean other classes than the
        checkpoint's (data.train re-converted with renamed or reordered classes). A checkpoint
        saved before class names were stored (none in its manifest) resumes as before.

        Raises:
            ClassNamesError: the checkpoint and data.train both name classes, not the same.
        """
        saved = checkpoint_class_names(self.checkpoints.loaded_manifest or {})
        if differ(saved, self.class_names):
            raise ClassNamesError(
                f"{mismatch(saved, f'the checkpoint of step {step}', self.class_names, 'data.train')}"
                ": the resumed run would train on shifted labels; convert data.train with the "
                "checkpoint's classes, or start over with --resume none"
            )

    def init_weights(self) -> None:
        """A new run's starting weights from `model.init_from` (the task reads them); the EMA
        starts from them too."""
        source = init_from.load_initial_weights(self.model, self.cfg, self.task)
        if self.ema is not None:
            self.ema.reset()
        log.info("a new run from step 0: %s", source)

    def truncate_sample_log(self) -> None:
        """Drop audit lines of steps after the checkpoint: they are trained again."""
        path = self.sample_log_path()
        if not path.exists():
            return
        kept = [
            line
            for line in path.read_text().splitlines()
            if json.loads(line)["step"] <= self.state.step
        ]
        path.write_text("".join(line + "\n" for line in kept))

    def agree_on_flags(self) -> tuple[bool, bool]:
        """One all-reduce at the step boundary: does any rank want to stop, is a timed save due?

        Signals reach ranks at different moments and clocks differ, so every rank must act on
        the same answer, or some would enter a collective save that others never join.
        """
        minutes = self.cfg.checkpoint.every_minutes
        time_due = bool(minutes) and time.monotonic() - self.last_save >= minutes * 60
        if self.flag_group is None:
            return self.preemption.requested, time_due
        flags = torch.tensor(
            [float(self.preemption.requested), float(time_due)], dtype=torch.float64
        )
        dist.all_reduce(flags, group=self.flag_group)
        stop, due = flags.tolist()
        return stop > 0, due > 0

    def print_summary(self, final_eval: dict[str, Any] | None) -> None:
        lines = [
            f"finished {self.state.step} steps ({self.state.samples_seen} samples, epoch {self.state.epoch})"
        ]
        if final_eval is not None:
            lines.append(summary_line(self.task, final_eval))
        lines.append(f"run folder: {self.run_dir}")
        lines.append(f"checkpoint: {self.checkpoints.root}/step-{self.state.step}")
        print("\n".join(lines), flush=True)

    def prepare_run_dir(self) -> None:
        if self.env.is_main:
            self.write_run_folder(
                lambda: self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            )
        if self.cfg.data.sample_log:
            self.sample_log_path().parent.mkdir(parents=True, exist_ok=True)

    def write_run_config(self) -> None:
        """`RUN_DIR/config.yaml`, once the resume succeeded: a failed one keeps the run's own."""
        if self.env.is_main:
            path = self.run_dir / "config.yaml"
            self.write_run_folder(lambda: path.write_text(config_to_yaml(self.cfg)))

    def write_run_folder(self, write: Callable[[], object]) -> None:
        try:
            write()
        except OSError as exc:
            raise ConfigError(
                f"run_dir={self.cfg.run_dir!r}: cannot write the run folder: {exc.strerror or exc}"
            ) from None
