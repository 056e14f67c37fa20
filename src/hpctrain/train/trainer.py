"""The Trainer: builds everything from the config, then runs one readable loop (`fit`)."""

from __future__ import annotations

import logging
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hpctrain.models.init_from as init_from  # a module: tests patch its functions
from hpctrain.checkpoint import CheckpointManager
from hpctrain.checkpoint.interval import DEFAULT_FAILURE_RATE, CheckpointInterval, FailureRate
from hpctrain.checkpoint.selection import peek
from hpctrain.checkpoint.storage import open_store
from hpctrain.config import Config, ConfigError, config_to_yaml
from hpctrain.config.load import check_rules
from hpctrain.config.lora_rules import check_lora
from hpctrain.config.rules import describe_timeouts
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.index import ShardIndex
from hpctrain.data.mixture_index import describe as describe_train
from hpctrain.data.mixture_index import open_train_index
from hpctrain.data.plan_report import dropped_note
from hpctrain.distributed import DistEnv, new_cpu_group
from hpctrain.distributed.signals import start_compile_workers
from hpctrain.models import lora, lora_base
from hpctrain.observe.gpu_stats import GpuCounters
from hpctrain.observe.hangs import HangWatch
from hpctrain.observe.heartbeat import Progress
from hpctrain.observe.memory import OOMSnapshots
from hpctrain.observe.metrics import IntervalMeter, MetricMonitor, MetricsWriter
from hpctrain.observe.profiling import StepProfiler
from hpctrain.observe.timeline import StartupClock, Timeline, job_fields, last_save_cost
from hpctrain.observe.trackers import check_trackers, start_trackers
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.precision import (
    DeviceFacts,
    configure_backends,
    device_facts,
    make_grad_scaler,
    plan_training,
)
from hpctrain.tasks.classes import check_class_names
from hpctrain.tasks.task import Batch, check_monitor, load_task
from hpctrain.train.checkpointing import Checkpointing, TrainState
from hpctrain.train.ema import build_ema
from hpctrain.train.evaluation import require_items, too_few_batches
from hpctrain.train.optim import (
    build_optimizer,
    build_scheduler,
    freeze_parameters,
    warmup_warning,
)
from hpctrain.train.preemption import INTERRUPT_EXIT_CODE, REQUEUE_EXIT_CODE, PreemptionFlag
from hpctrain.train.records import RunRecords
from hpctrain.train.step import OptimizerStep

log = logging.getLogger("hpctrain")
# What rank 0 says when a second Ctrl-C ends the run at once (during a save, an evaluation).
INTERRUPTED_AGAIN = (
    "hpctrain train: interrupted again: stopped at once (committed checkpoints are kept)\n"
)


def heartbeat_of(cfg: Config) -> Progress:
    """The heartbeat its watcher named (`HPCTRAIN_HEARTBEAT`), with the config's allowances."""
    return Progress.from_environ(
        floor_s=cfg.train.heartbeat_timeout_s,
        factor=cfg.train.heartbeat_factor,
        first_s=cfg.train.first_step_timeout_s,
        save_s=cfg.checkpoint.save_timeout_s,
        prior_save_s=last_save_cost(Path(cfg.run_dir)),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer(Checkpointing, RunRecords, OptimizerStep):
    """Everything a run needs, built once from the config, and the training loop.

    Its parts by job, each in its own module: one optimizer step (`train/step.py`), the
    records and summary (`train/records.py`), saving and resuming (`train/checkpointing.py`).
    """

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        device: torch.device,
        *,
        startup: StartupClock | None = None,
        failure_rate: FailureRate = DEFAULT_FAILURE_RATE,
        progress: Progress | None = None,
    ) -> None:
        """`startup`: the process's start-up phases so far (`run_training` starts it);
        `failure_rate`: for `checkpoint.every_minutes: auto` (`checkpoint/interval.py`);
        `progress`: the heartbeat its watcher reads (`run_training` starts it)."""
        self.cfg, self.env, self.device = cfg, env, device
        self.progress = progress or heartbeat_of(cfg)
        self.run_dir = Path(cfg.run_dir)
        self.startup = startup or StartupClock()  # phases, then RUN_DIR/timeline.jsonl
        self.check_config()
        self.configure_torch()
        self.startup.mark("other")
        train_index = open_train_index(cfg.data)  # one index, or a mixture of sources
        self.startup.mark("index")
        # The checkpoint a resume will load, if any: the task builds the model it records
        # (a `model.init_from` folder is then never read, whatever became of it).
        self.resume_manifest = peek(open_store(cfg.checkpoint_root()), cfg.checkpoint.resume)
        self.task = load_task(cfg, train_index, self.resume_manifest)
        self.build_model()
        self.startup.mark("model_build")
        self.build_loaders(train_index)
        self.plan_steps()
        self.startup.mark("index")
        self.build_run_state(failure_rate)
        self.startup.mark("other")

    def check_config(self) -> None:
        """Refuse what cannot train (bf16 on a V100, no data, ...) before any model or loader work."""
        cfg = self.cfg
        check_rules(cfg)  # as loading does: this config may have been built in code
        if not cfg.data.train:
            raise ConfigError("data.train is empty: give an index.json path/URL or a shard pattern")
        if self.env.is_main:
            check_trackers(cfg.logging)  # tensorboard, W&B, MLflow: their packages
        check_lora(cfg)
        if cfg.train.tp_degree > 1 and cfg.task in ("image_classification", "segmentation"):
            raise ConfigError(
                f"train.tp_degree={cfg.train.tp_degree} with task={cfg.task}: tensor "
                "parallelism splits the causal_lm GPT only; set train.tp_degree=1"
            )
        if cfg.checkpoint.monitor and not cfg.data.val:
            raise ConfigError(
                f"checkpoint.monitor={cfg.checkpoint.monitor}: needs data.val (evaluations to rank by)"
            )
        check_monitor(cfg)  # a metric the task's evaluation reports
        if self.env.is_main:
            log.info(describe_timeouts(cfg))
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
        # Before the model is built: a recorded allocation history then shows its weights too.
        self.memory = OOMSnapshots(
            self.device,
            self.run_dir,
            self.env.rank,
            enabled=cfg.profile.oom_snapshot,
            history=cfg.profile.memory_history,
        )
        self.facts = self.device_facts()
        self.plan = plan_training(
            cfg.train, self.facts, self.env.world_size, self.env.local_world_size
        )
        self.precision = self.plan.precision
        if self.plan.why_precision:
            log.info(self.plan.why_precision)
        if self.plan.precision_cost and self.env.is_main:
            log.warning(self.plan.precision_cost)
        if self.env.is_distributed:
            log.info("mesh: %s (train.strategy=%s)", self.plan.describe_mesh(), self.plan.strategy)
        if self.plan.strategy == "fsdp" and self.env.local_world_size < self.env.world_size:
            log.warning(
                "train.strategy=fsdp over %d nodes: every all-gather crosses the network; "
                "train.strategy=hsdp shards inside a node and replicates across nodes",
                -(-self.env.world_size // max(1, self.env.local_world_size)),
            )

    def device_facts(self) -> DeviceFacts:
        """What the plan needs to know about this device (a dry run gives a GPU's instead)."""
        return device_facts(self.device, compile=self.cfg.train.compile)

    def configure_torch(self) -> None:
        """Deterministic algorithms or fast kernels (`configure_backends`), the global seeds."""
        note = configure_backends(self.facts, self.cfg.train.deterministic)
        if note:
            log.info(note)
        seed_everything(self.cfg.seed)

    def build_model(self) -> None:
        """The task's model, moved, wrapped and sharded; its optimizer and gradient scaler."""
        torch.manual_seed(self.cfg.seed)  # identical initial weights on every rank (FSDP2 needs it)
        # A resume never reads model.init_from (the checkpoint records the model), except for
        # a LoRA run's base: its checkpoints hold the adapters only.
        if self.resume_manifest is None or self.cfg.model.lora.rank:
            init_from.check(self.cfg, self.task)
            source = self.cfg
        else:
            source = replace(self.cfg, model=replace(self.cfg.model, init_from=""))
        built = init_from.build_model(self.task, source, self.plan.strategy, tp=self.plan.tp)
        model = built.model
        self.base_on_meta = built.on_meta
        self.adapted: lora.Adapted | None = None  # model.lora: the adapters, on the base
        if self.cfg.model.lora.rank:
            # every rank at once: the files to hash are split over the ranks; a resume reuses
            # the checkpoint's records of the files that did not change
            known = lora_base.lora_metadata(self.resume_manifest or {})
            self.lora_base = lora_base.fingerprint(
                self.cfg.model.init_from,
                ema=self.cfg.model.init_from_ema,
                known=known and known.get("base"),
            )
            self.adapted = lora_base.prepare(model, self.cfg, self.task)  # before wrapping
            log.info("model.lora: %s", self.adapted.describe())
        trainable, frozen = freeze_parameters(model, self.cfg.train.freeze)  # before wrapping
        log.info(
            "parameters: %s trainable, %s frozen (%s)",
            f"{trainable:,}",
            f"{frozen:,}",
            "the base and train.freeze" if self.adapted else "train.freeze",
        )
        if self.cfg.train.compile:  # deaf to SLURM's signals, unlike those torch would start
            start_compile_workers()
        self.model = parallelize(
            model,
            self.cfg.train,
            self.plan,
            self.device,
            channels_last=self.cfg.model.channels_last,
        )
        if built.init is not None:  # before anything reads the values (the EMA copies them)
            built.init.materialize(self.model)
        self.optimizer = build_optimizer(self.model, self.cfg.train)
        self.ema = build_ema(self.model, self.cfg.train.ema_decay)  # None when disabled
        self.scaler = make_grad_scaler(self.precision)

    def build_loaders(self, train_index: ShardIndex) -> None:
        """The training loader and, with `data.val`, the evaluation loader.

        The task's optional `decode`/`collate` hooks replace the loader's defaults; they run
        in the loader workers like the transforms.
        """
        cfg = self.cfg
        loader_args: dict[str, Any] = {  # the ranks of a TP group read the same batches
            "rank": self.plan.data_parallel_rank(self.env.rank),
            "world_size": self.plan.data_parallel_size,
            "seed": cfg.seed,
            "device": self.device,
        }
        for hook in ("decode", "collate"):
            if hasattr(self.task, hook):
                loader_args[hook] = getattr(self.task, hook)
        self.loader = ShardedLoader(
            train_index,
            cfg.data,
            transform=self.task.train_transform(),
            train=True,
            batches_held=cfg.train.grad_accum_steps,  # a step holds its micro-batches
            **loader_args,
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
                too_few_batches(cfg, self.loader.plan(), describe_train(cfg.data.train))
            )
        self.total_steps = cfg.train.max_steps or cfg.train.max_epochs * self.steps_per_epoch
        if self.total_steps == 0:
            raise ConfigError("train.max_steps=0 and train.max_epochs=0: set one of them")
        if (warning := warmup_warning(cfg.train, self.total_steps)) and self.env.is_main:
            log.warning("%s", warning)
        epoch_plan = self.loader.plan()
        if epoch_plan.num_dropped:
            # a tenth of the data out of every epoch is worth a look: say it louder
            large = epoch_plan.num_dropped >= 0.1 * epoch_plan.num_samples
            (log.warning if large else log.info)(
                "data.remainder=drop: %s (data.remainder=pad keeps them, as padding)",
                dropped_note(epoch_plan, "sequences" if cfg.data.seq_len else "samples"),
            )
        # the epochs the console counts to (0: not shown; --overfit-batches has none)
        epochs = -(-self.total_steps // self.steps_per_epoch)  # the last one may be partial
        self.num_epochs = 0 if cfg.train.overfit_batches else epochs
        self.scheduler = build_scheduler(self.optimizer, cfg.train, self.total_steps)

    def build_run_state(self, failure_rate: FailureRate = DEFAULT_FAILURE_RATE) -> None:
        """Counters, the checkpoint manager, the preemption flag, the meters, the timed-save
        interval."""
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
        self.preemption = PreemptionFlag(
            cfg.checkpoint.signals,
            cfg.checkpoint.deadline_margin_s,
            interrupt_line=INTERRUPTED_AGAIN if self.env.is_main else "",
        )
        self.hangs = HangWatch(
            self.run_dir,
            self.env.rank,
            step_timeout_s=cfg.train.step_timeout_s,
            first_step_timeout_s=cfg.train.first_step_timeout_s,
            collective_timeout_s=cfg.train.collective_timeout_s,
            dump_on_usr1=signal.SIGUSR1 not in self.preemption.signals,
            on_dump=self.progress.dumped,  # the watcher waits for the stacks, then kills
        )
        self.meter = IntervalMeter()
        self.empty_steps, self.warned_empty, self.first_step = 0, False, 0
        if self.env.is_distributed:
            self.watch_sync_points()
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
        self.timeline = Timeline(self.run_dir, enabled=self.env.is_main)
        self.save_wait_s = 0.0
        auto = cfg.checkpoint.every_minutes == "auto"
        self.save_interval = CheckpointInterval(
            cfg.checkpoint.every_minutes,
            nodes=-(-self.env.world_size // max(1, self.env.local_world_size)),
            failure_rate=failure_rate,
            last_save_s=last_save_cost(self.run_dir) if auto else None,  # an earlier process's
        )
        if auto and self.env.is_main:
            log.info("%s", self.save_interval.describe())
        self.last_save = time.monotonic()
        self.resumed_loader = False
        self.last_eval: dict[str, Any] | None = None  # the newest evaluation record

    # ---------------------------------------------------------------- the loop
    def fit(self) -> int:
        """Train to `total_steps`; returns 0, or REQUEUE_EXIT_CODE after a preemption save."""
        self.prepare_run_dir()
        self.preemption.install()
        self.startup.mark("other")
        self.resume()
        self.first_step = self.state.step
        self.startup.mark("checkpoint_load")
        self.write_run_config()
        metrics = MetricsWriter(
            self.run_dir,
            enabled=self.env.is_main,
            progress=self.cfg.logging.progress,
            total_steps=self.total_steps,
            num_epochs=self.num_epochs,
            start_step=self.state.step,
            tensorboard=self.cfg.logging.tensorboard,
            trackers=start_trackers(
                self.cfg,
                self.env.world_size,
                resumed=self.checkpoints.loaded_manifest is not None,
            )
            if self.env.is_main
            else None,
            first={"mesh": self.plan.describe_mesh()},
        )
        batches = self.batch_stream()
        self.model.train()
        status = "failed"  # how the run ends, for the trackers
        self.startup.mark("other")
        self.timeline.write(
            "startup",
            step=self.state.step,
            process_start=self.startup.process_start,
            phases=self.startup.phases,
            world_size=self.env.world_size,
            **job_fields(),
        )
        try:
            self.hangs.install()  # SIGUSR1 and train.step_timeout_s: stacks in RUN_DIR/hangs
            self.progress.arm_dumps(self.hangs.dump_signal)
            if self.first_step >= self.total_steps:  # a finished run, started again
                if self.env.is_main:
                    print(self.complete_line(), flush=True)
                status = "finished"
                return 0
            while self.state.step < self.total_steps:
                self.profiler.at_step(self.state.step)
                step = self.state.step + 1
                with self.memory.watch(step), self.hangs.step(step), self.progress.step(step):
                    self.train_step(batches)
                if (
                    self.state.step == self.first_step + 1
                ):  # a restart's end (resilience/recovery.py)
                    self.timeline.write("first_step", step=self.state.step)
                stopped = self.step_boundary(metrics)
                if stopped:
                    status = "preempted" if stopped == REQUEUE_EXIT_CODE else "interrupted"
                    return stopped
                if self.monitor.should_stop:  # every rank has the same evaluations
                    log.warning(
                        "early stop at step %d: %d evaluations without a better %s",
                        self.state.step,
                        self.monitor.evals_since_best,
                        self.monitor.name,
                    )
                    break
            self.profiler.close()
            saved_last = self.checkpoints.latest_step() == self.state.step
            if not saved_last and self.cfg.checkpoint.final:
                self.save()  # before the final evaluation: one that fails loses no training
                saved_last = True
            final_eval = self.last_eval  # the last step's, when eval_every evaluated it
            if final_eval is not None and final_eval["step"] != self.state.step:
                final_eval = None
            if final_eval is None and self.val_loader is not None:
                if self.env.is_main:
                    log.info("final evaluation of step %d on data.val", self.state.step)
                final_eval = self.evaluate()
                metrics.write(final_eval)
                self.monitor.observe(final_eval)
                if self.monitor.name and saved_last:  # the saved step's score, for best
                    self.checkpoints.annotate(
                        self.state.step,
                        metadata=self.checkpoint_metadata(),
                        score=self.monitor.score_at(self.state.step),
                    )
            self.wait_for_saves()
            self.progress.ending()
            if self.env.is_main:
                self.print_summary(final_eval)
            status = "finished"
            return 0
        except Exception as exc:
            self.hangs.report_timeout(exc)  # a timed-out collective: dump, name the folder
            raise
        finally:
            self.progress.ending()
            self.progress.arm_dumps(0)
            self.hangs.uninstall()
            self.profiler.close()
            self.memory.close()
            self.timeline.write(
                "end", step=self.state.step, status=status, save_wait_s=self.save_wait_s
            )
            metrics.close(status)
            self.checkpoints.close()
            # A failed rank of a job keeps noting TERM until it exits: srun's TERM (a peer
            # failed too) must not kill it while it unwinds, or its end would read as stopped
            # by SLURM rather than as its own exit (7: a peer went away).
            self.preemption.uninstall(keep_term=status == "failed" and self.env.is_distributed)
            for loader in (self.loader, self.val_loader):
                if loader is not None:
                    loader.close()  # its workers too, now rather than at exit

    def step_boundary(self, metrics: MetricsWriter) -> int:
        """Log, evaluate and save as due after a step; once saved for a preemption or a
        Ctrl-C, the exit code to end with (REQUEUE_EXIT_CODE or INTERRUPT_EXIT_CODE), else 0."""
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
        stop_requested, time_due, interrupted = self.agree_on_flags()
        if stop_requested or interrupted:
            # a preemption wins over a Ctrl-C: the job script must see 75 to requeue
            code = REQUEUE_EXIT_CODE if stop_requested else INTERRUPT_EXIT_CODE
            if stop_requested:
                log.warning("preemption requested: saving step %d, then exiting for requeue", step)
            if not saved:
                self.save()
            self.wait_for_saves()
            self.preemption.exit_on_signal(code)  # saved: a TERM (or ^C) now only ends us
            if interrupted and not stop_requested and self.env.is_main:
                sys.stderr.write(
                    f"hpctrain train: interrupted at step {step}: saved; "
                    "run the same command to resume\n"
                )
                sys.stderr.flush()
            return code
        every_steps = self.cfg.checkpoint.every_steps
        if not saved and (time_due or (every_steps and step % every_steps == 0)):
            self.save()
        return 0

    def batch_stream(self) -> Iterator[Batch]:
        """Batches across epochs; after a resume the first epoch continues where it stopped."""
        if self.cfg.train.overfit_batches:
            yield from self.overfit_stream()
            return
        while True:
            if not self.resumed_loader:
                self.loader.set_epoch(self.state.epoch)
                self.progress.loading()  # a new epoch may start its workers: a first step's time
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

    def agree_on_flags(self) -> tuple[bool, bool, bool]:
        """One all-reduce at the step boundary: does any rank want to stop (preempted), is a
        timed save due, did any rank get Ctrl-C?

        Signals reach ranks at different moments and clocks differ, so every rank must act on
        the same answer, or some would enter a collective save that others never join.
        """
        interval = self.save_interval.seconds  # None: no timed saves
        time_due = interval is not None and time.monotonic() - self.last_save >= interval
        flag = self.preemption
        if self.flag_group is None:
            return flag.requested, time_due, flag.interrupted
        flags = torch.tensor(
            [float(flag.requested), float(time_due), float(flag.interrupted)], dtype=torch.float64
        )
        self.meter.clock.mark("boundary")  # this rank's arrival: the straggler check
        dist.all_reduce(flags, group=self.flag_group)
        self.meter.add_arrivals()
        self.meter.clock.leave_boundary()  # every rank leaves at the same moment
        stop, due, interrupted = flags.tolist()
        return stop > 0, due > 0, interrupted > 0

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
