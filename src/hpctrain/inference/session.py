"""What `hpctrain eval` and `hpctrain predict` share: a checkpoint's model on every rank.

Each rank reads the checkpoint's model weights consolidated (`hpctrain.checkpoint.weights`, from
DDP or FSDP2 checkpoints alike, each rank on its own: no collective), builds the task's
model from the same seed, loads the weights, then wraps it as training would
(`train.strategy`, `train.precision`: DDP, or FSDP2 sharding it again) and reads the data
with an evaluation loader: index order, padded to equal batches on every rank with padding
flagged `valid=False`, so every sample is seen exactly once in the job.

The weights are those the training evaluated with: the EMA's (`ema.<name>`, with the model's
buffers) when the run's `train.ema_eval` is true, so that `hpctrain eval --checkpoint best`
measures what picked the best checkpoint; `train.ema_eval=false` on the command line reads the
trained weights instead. A LoRA run's adapters are merged into its base as the run held it
(QLoRA's NF4 copy: what its evaluations scored), or with `eval.lora_base=full` into the base's
own weights (`hpctrain.models.lora_base.read_weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.checkpoint import CheckpointError
from hpctrain.checkpoint.weights import locate_checkpoint
from hpctrain.config import Config, ConfigError, with_overrides
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.index import ShardIndex, ShardIndexError, redact_url
from hpctrain.data.mixture_index import open_train_index
from hpctrain.data.tokenizer import check_recorded_tokenizer
from hpctrain.distributed import DistEnv, process_group, start_process
from hpctrain.distributed.signals import start_compile_workers
from hpctrain.errors import UsageError
from hpctrain.models.lora_base import describe_base, read_weights
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.precision import (
    Precision,
    configure_backends,
    device_facts,
    plan_training,
)
from hpctrain.tasks.classes import check_class_names, checkpoint_class_names, differ, mismatch
from hpctrain.tasks.task import Task, load_task

log = logging.getLogger("hpctrain")


def find_checkpoint(cfg: Config, which: str) -> tuple[Any, str, dict[str, Any]]:
    """(store, step folder, verified manifest) of `which`: `latest`, `best` or a path/URL.

    `latest` is the checkpoint a resume would load (the newest committed one that verifies);
    `best` the one `checkpoints/best` names (`checkpoint.keep_best`); a path may be a run
    folder, a checkpoint folder or one `step-<N>` folder.

    Raises:
        CheckpointError: none there, or damaged (exit code 4).
    """
    root = cfg.checkpoint_root()
    if which in ("", "latest"):
        return locate_checkpoint(root)
    if which == "best":
        return locate_checkpoint(root, best=True)
    return locate_checkpoint(which)


def class_index(cfg: Config, data_index: ShardIndex) -> ShardIndex:
    """The index the task learns its classes from: the training index when it can be read.

    The model's classes (their count and names) are the training data's; data to predict
    on may carry no class names. A shard pattern is not read (counting its samples reads
    every shard, and it names no classes).
    """
    spec = cfg.data.train
    if not isinstance(spec, str):  # a mixture: its sources agree on the classes
        try:
            return open_train_index(cfg.data)
        except ShardIndexError as exc:
            log.warning("class names from the data's own index: data.train unreadable (%s)", exc)
            return data_index
    if not spec or spec.startswith("pipe:") or spec.endswith(".tar") or "{" in spec:
        return data_index
    try:
        return open_index(spec, allow_pipe=False)
    except ShardIndexError as exc:
        log.warning("class names from the data's own index: data.train unreadable (%s)", exc)
        return data_index


def model_classes(
    cfg: Config, manifest: dict[str, Any], data_index: ShardIndex, key: str, *, strict: bool
) -> ShardIndex:
    """The index the task is built from, with the checkpoint's class names, checked against the
    data's.

    A checkpoint stores its training index's class names (`metadata.class_names`): they are
    the model's, also when `data.train` has since been re-converted with other names (a
    warning). Older checkpoints keep `class_index`'s names. Data that names other classes is
    refused with `strict` (eval: its labels would be scored as other classes) and warned
    about otherwise (predict: the outputs carry the model's names).

    Raises:
        ClassNamesError: `strict` and the data names other classes than the model (exit 3).
    """
    index = class_index(cfg, data_index)
    names = checkpoint_class_names(manifest)
    if names:
        if differ(names, index.class_names) and index is not data_index:
            log.warning(
                "%s; the model's are the checkpoint's",
                mismatch(names, "the checkpoint", index.class_names, "data.train"),
            )
        index = replace(index, class_names=names)
    if strict:
        check_class_names(index.class_names, "the model", data_index.class_names, key)
    elif differ(index.class_names, data_index.class_names):
        log.warning(
            "%s; the predictions name the model's classes",
            mismatch(index.class_names, "the model", data_index.class_names, key),
        )
    return index


def check_data_tokenizer(
    manifest: dict[str, Any], data_index: ShardIndex, key: str, where: str
) -> None:
    """Refuse token data converted with another tokenizer than the one the checkpoint's
    model was trained on (a causal_lm checkpoint records it); an older checkpoint without
    the record, or data without tokens, is not checked.

    Raises:
        DataError: one line naming both tokenizers (exit 3).
    """
    recorded = (manifest.get("metadata") or {}).get("tokenizer")
    info = getattr(data_index, "tokenizer", None)
    if isinstance(recorded, dict) and info:
        check_recorded_tokenizer(recorded, dict(info), f"the checkpoint {where}", key)


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy the checkpoint's weights into `model`; a mismatch names the first keys at fault."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    wrong = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        problems = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
            if keys:
                problems.append(f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}")
        raise CheckpointError(
            f"{where}: the checkpoint's weights do not fit the config's model "
            f"({'; '.join(problems)}); check model.* overrides"
        )
    model.load_state_dict(weights)


def use_run_tokenizer(task: Task, cfg: Config, manifest: dict[str, Any], spec: str) -> None:
    """Give a text task the run's tokenizer (see `inference_session`).

    Raises:
        UsageError: `spec` for a task without text, or not the checkpoint's tokenizer.
        DataError: the recorded tokenizer is gone and none given (naming `--tokenizer`).
    """
    from hpctrain.inference.generate import run_tokenizer

    use = getattr(task, "use_text_tokenizer", None)
    if use is None:
        if spec:
            raise UsageError(f"--tokenizer {spec}: task {cfg.task} reads no text")
        return
    recorded = (manifest.get("metadata") or {}).get("tokenizer")
    tree = {"data": {"train": cfg.data.train, "tokenizer": cfg.data.tokenizer}}
    use(run_tokenizer(tree, spec, recorded if isinstance(recorded, dict) else None))


@dataclass
class InferenceRun:
    """One rank's share of an eval or predict job."""

    cfg: Config
    env: DistEnv
    device: torch.device
    task: Task
    model: nn.Module
    precision: Precision
    loader: ShardedLoader | None  # None for a session of the model alone (`data=""`)
    step: int  # the checkpoint's
    checkpoint: str  # its folder (credentials stripped)
    weights: str  # "ema" (train.ema_eval) or "model"
    data: str  # the data spec (credentials stripped)
    lora_base: str | None = None  # a LoRA run: the base merged into (`describe_base`)


@contextmanager
def inference_session(
    cfg: Config,
    checkpoint: str,
    data: str,
    *,
    key: str,
    predict: bool,
    tokenizer_spec: str = "",
    text: bool = False,
    label: str = "",
) -> Iterator[InferenceRun]:
    """This process as one rank: the checkpoint's model, wrapped, and a loader over `data`.

    Args:
        checkpoint: `latest`, `best`, or a path (see `find_checkpoint`).
        data: an index, folder or shard pattern; `key` names where it came from in errors.
            "" gives the model alone (no loader), the task built from `data.train`'s index
            (answers to a JSONL file: `hpctrain.inference.answers`).
        predict: read samples with the task's `predict_transform` (when it has one), in
            batches that carry the samples' source paths (`__source__`).
        tokenizer_spec: `--tokenizer` (bytes or a file), where the run's has moved; `text`:
            the task's text tokenizer is needed (answers). Either: the tokenizer the
            checkpoint records, found as `generate` and `export` find it (`run_tokenizer`:
            `--tokenizer` checked by sha256), is the task's (`use_text_tokenizer`).
        label: what the log line names as the data where `data` is "" (eval --data's file).

    Raises:
        ConfigError: no data given; ShardIndexError: the data cannot be read (naming it);
        CheckpointError: no usable checkpoint; ClassNamesError: eval data naming other
        classes than the model. All before any process group or model.
    """
    env, device = start_process(deterministic=cfg.train.deterministic)
    if cfg.train.strategy == "none" and env.world_size > 1:
        # `none` is refused for several training ranks (each would train its own copy);
        # evaluating or predicting trains nothing, so the ranks share one model as under DDP.
        cfg = with_overrides(cfg, ["train.strategy=ddp"])
    if cfg.train.tp_degree > 1:
        # Every process reads the whole model here (`read_weights`): evaluating or
        # predicting with it needs no tensor-parallel split, on any number of ranks.
        cfg = with_overrides(cfg, ["train.tp_degree=1"])
    if not data and key:
        raise ConfigError(
            f"{key} is empty: give an index.json path/URL, a folder or a shard pattern"
        )
    data_index = (
        open_index(data, allow_pipe=cfg.data.allow_pipe) if data else open_train_index(cfg.data)
    )
    store, name, manifest = find_checkpoint(cfg, checkpoint)
    where = redact_url(store.path(name))
    ema = cfg.train.ema_eval  # the weights the training evaluated with: see the module
    # this process alone; a LoRA run: merged into its base as eval.lora_base says
    weights = read_weights(store, name, manifest, ema=ema, lora_base=cfg.eval.lora_base)
    classes = model_classes(cfg, manifest, data_index, key, strict=not predict)
    shown = redact_url(label or data or "data.train's model")
    log.info("rank %d/%d on %s: %s, data %s", env.rank, env.world_size, device, where, shown)
    # A caller that already joined the job's process group (a test, a notebook) keeps it.
    group = (
        nullcontext()
        if dist.is_initialized()
        else process_group(env, device, cfg.train.collective_timeout_s)
    )
    with group:
        facts = device_facts(device, compile=cfg.train.compile)
        plan = plan_training(cfg.train, facts, env.world_size)
        # the kernels training used (TF32, cuDNN's autotuner, deterministic algorithms)
        note = configure_backends(facts, cfg.train.deterministic)
        if note:
            log.info(note)
        task = load_task(cfg, classes, manifest)  # the model the checkpoint records
        check_data_tokenizer(manifest, data_index, key, where)
        if tokenizer_spec or text:
            use_run_tokenizer(task, cfg, manifest, tokenizer_spec)
        torch.manual_seed(cfg.seed)  # FSDP2 needs equal weights everywhere: they are loaded
        model = task.build_model()
        load_weights(model, weights, where)
        del weights
        if cfg.train.compile:  # deaf to SLURM's signals, unlike those torch would start
            start_compile_workers()
        model = parallelize(model, cfg.train, plan, device, channels_last=cfg.model.channels_last)
        transform = (
            task.predict_transform()  # type: ignore[attr-defined]
            if predict and hasattr(task, "predict_transform")
            else task.eval_transform()
        )
        hooks = {h: getattr(task, h) for h in ("decode", "collate") if hasattr(task, h)}
        loader = None
        if data:
            loader = ShardedLoader(
                data_index,
                cfg.data,
                rank=env.rank,
                world_size=env.world_size,
                seed=cfg.seed,
                transform=transform,
                train=False,
                device=device,
                keep_source=predict,
                **hooks,
            )
        try:
            yield InferenceRun(
                cfg=cfg,
                env=env,
                device=device,
                task=task,
                model=model,
                precision=plan.precision,
                loader=loader,
                step=int(manifest["step"]),
                checkpoint=where,
                weights="ema" if ema else "model",
                data=redact_url(data),
                lora_base=describe_base(manifest, cfg.eval.lora_base),
            )
        finally:
            if loader is not None:
                loader.close()
