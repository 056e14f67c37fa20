"""The Trainer's checkpoints: what a checkpoint holds, saving, and resuming (or starting) a run.

A part of `Trainer` (`train/trainer.py`), split out by job; the save/commit protocol itself is
`hpctrain.checkpoint`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hpctrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelOptimizerState,
    PerRankState,
    RNGState,
)
from hpctrain.checkpoint.interval import CheckpointInterval
from hpctrain.config import Config, config_to_yaml
from hpctrain.data import ShardedLoader
from hpctrain.models import lora, lora_base
from hpctrain.models.init_from import load_initial_weights
from hpctrain.observe.heartbeat import Progress
from hpctrain.observe.metrics import MetricMonitor
from hpctrain.observe.timeline import Timeline
from hpctrain.parallel.parallelize import broadcast_buffers
from hpctrain.tasks.classes import ClassNamesError, checkpoint_class_names, differ, mismatch
from hpctrain.tasks.task import Task
from hpctrain.train.ema import CHECKPOINT_KEY as EMA_KEY
from hpctrain.train.optim import check_same_groups, keep_fused_adamw

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


class Checkpointing:
    """`Trainer.save`, `Trainer.resume` and what they need."""

    cfg: Config
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    ema: Any  # hpctrain.train.ema.EMA, or None
    adapted: lora.Adapted | None  # model.lora: what carries adapters (None: no LoRA)
    lora_base: dict[str, Any]  # with adapters: the base's fingerprint
    base_on_meta: bool  # the model was built on the meta device (FSDP2 reads the base late)
    loader: ShardedLoader
    class_names: Sequence[str]
    checkpoints: CheckpointManager
    monitor: MetricMonitor
    state: TrainState
    last_save: float
    timeline: Timeline  # RUN_DIR/timeline.jsonl: one record per save
    save_interval: CheckpointInterval  # checkpoint.every_minutes (auto: re-evaluated here)
    save_wait_s: float  # blocked on background saves (checkpoint.async) at the end
    resumed_loader: bool
    truncate_sample_log: Callable[[], None]  # RunRecords'
    progress: Progress  # the rank's heartbeat for its watcher

    def checkpoint_states(self) -> dict[str, Any]:
        # A LoRA run saves what trains (adapters, a new head) and buffers: the frozen base
        # stays in model.init_from, named by the fingerprint in the metadata.
        options = (
            StateDictOptions(ignore_frozen_params=True, strict=False) if self.adapted else None
        )
        states: dict[str, Any] = {
            "app": ModelOptimizerState(self.model, self.optimizer, options=options),
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
        """Save (and commit) a checkpoint of this step; its blocking time goes to the
        timeline and, with `checkpoint.every_minutes: auto`, into the next interval."""
        start = time.monotonic()
        with self.progress.phase("save"):  # the watcher's allowance: a save's, not a step's
            self.free_gradients()
            broadcast_buffers(self.model)  # FSDP2: one set of BatchNorm statistics, rank 0's
            self.checkpoints.save(
                self.state.step,
                self.checkpoint_states(),
                metadata=self.checkpoint_metadata(),
                score=self.monitor.score_at(self.state.step),
            )
        self.last_save = time.monotonic()
        blocking_s = self.last_save - start  # with checkpoint.async: the staging only
        self.save_interval.after_save(blocking_s)
        self.timeline.write(
            "checkpoint", step=self.state.step, blocking_s=blocking_s, **self.save_interval.inputs()
        )

    def wait_for_saves(self) -> None:
        """Block until background saves are committed (before exiting); counted as saving."""
        start = time.monotonic()
        with self.progress.phase("save"):  # a save's allowance, not a step's
            self.checkpoints.wait()
        self.save_wait_s += time.monotonic() - start

    def checkpoint_metadata(self) -> dict[str, Any]:
        metadata = {
            "config": config_to_yaml(self.cfg),
            "monitor": self.monitor.state_dict(),
            "class_names": list(self.class_names),
        }
        if hasattr(self.task, "model_metadata"):  # e.g. causal_lm's GPT shape, for exports
            metadata.update(self.task.model_metadata())
        if self.adapted is not None:  # the adapters' settings and the base's fingerprint
            metadata[lora_base.KEY] = lora_base.metadata(self.cfg, self.lora_base, self.adapted)
        return metadata

    def resume(self) -> None:
        fresh = self.cfg.checkpoint.resume == "none"
        if self.adapted is not None and self.base_on_meta:
            # each rank's shards of the base, before the checkpoint's trained entries
            line = load_initial_weights(
                self.model, self.cfg, self.task, process_group=self.checkpoints.group
            )
            log.info("LoRA base: %s", line)
        elif fresh and self.cfg.model.init_from and self.adapted is None:
            # Read before `--resume none` sets the older run's checkpoints aside: init_from
            # may name this run folder or a step in it (a new run from its own weights).
            self.init_weights()
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
            # The cause first; what torch said ("Missing key in checkpoint state_dict: ...")
            # last, as the detail it is.
            where, _, detail = str(exc).rstrip(".").partition(": load failed: ")
            raise type(exc)(
                f"{where}: the config differs from the checkpoint's in {', '.join(changes)}: "
                "set back the key that changes what the checkpoint holds (model, optimizer, "
                "precision), or start over with --checkpoint none"
                + (f" (the load failed: {detail})" if detail else "")
            ) from None
        except ValueError:  # DCP's own when the optimizer's groups differ: say which key
            check_same_groups(self.cfg.train, self.checkpoints.tried_manifest)
            raise
        if step is None:
            if self.adapted is not None:
                self.start_adapters()
            elif self.cfg.model.init_from and not fresh:
                self.init_weights()
            return
        check_same_groups(self.cfg.train, self.checkpoints.loaded_manifest)
        keep_fused_adamw(self.optimizer)  # the checkpoint's groups bring their `fused`
        self.check_resumed_class_names(step)
        if self.adapted is not None:
            saved = lora_base.lora_metadata(self.checkpoints.loaded_manifest or {})
            lora_base.check_same_base(saved and saved.get("base"), self.lora_base, step)
        elif self.cfg.model.init_from:
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

    def start_adapters(self) -> None:
        """A new LoRA run's adapters (its base is loaded already); the EMA starts from them."""
        line = lora_base.start_adapters(self.model, self.cfg, self.task)
        if self.ema is not None:
            self.ema.reset()
        log.info(
            "a new LoRA run from step 0 on model.init_from=%s: %s", self.cfg.model.init_from, line
        )

    def init_weights(self) -> None:
        """A new run's starting weights from `model.init_from` (the task reads them); the EMA
        starts from them too."""
        source = load_initial_weights(
            self.model, self.cfg, self.task, process_group=self.checkpoints.group
        )
        if self.ema is not None:
            self.ema.reset()
        log.info("a new run from step 0: %s", source)
