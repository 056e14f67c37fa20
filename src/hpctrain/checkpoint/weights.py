"""A checkpoint's model weights, read whole in one process: what eval, predict, export and
generate load, and what `model.init_from` starts a run from.

`locate_checkpoint` finds the step folder a run folder, a checkpoint root or a step folder
names; `read_model_weights` reads only the model's entries of it (`app.model.*`, the fully
qualified names of the plain module: DCP's `get_state_dict` already strips DDP's `module.` and
wrapper prefixes), consolidated from DDP or FSDP2 checkpoints alike, without a process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.checkpoint import CheckpointError, committed_steps, verify_checkpoint
from hpctrain.checkpoint.manager import BEST_NAME, item_checksums, read_latest, steps_to_try
from hpctrain.checkpoint.safety import SafeLoadPlanner, UnsafeCheckpointError
from hpctrain.checkpoint.storage import Store, open_store

# `Trainer.checkpoint_states` stores ModelOptimizerState under "app", which puts the model under
# "model": DCP flattens nested keys with dots.
MODEL_PREFIX = "app.model."
EMA_PREFIX = "ema."  # hpctrain.train.ema.CHECKPOINT_KEY


def locate_checkpoint(path: str, *, best: bool = False) -> tuple[Store, str, dict]:
    """(store, step folder name, manifest) for a run folder, a checkpoint root or a step folder.

    A run folder's checkpoints are where its `config.yaml` says (`checkpoint.dir`), else
    `RUN_DIR/checkpoints`. Of a root, the checkpoint a resume would load (the step `latest`
    names, or the highest below it that verifies; see `hpctrain.checkpoint.manager`), or with
    `best` the one the `best` pointer names (`checkpoint.keep_best`).
    """
    path = path.rstrip("/") or "/"
    parent, _, leaf = path.rpartition("/")
    parent_store = open_store(parent or ".")
    if parent_store.exists(f"{leaf}/manifest.json"):
        return parent_store, leaf, verify_checkpoint(parent_store, leaf)
    root = path
    config_path = Path(path) / "config.yaml"
    if "://" not in path and config_path.is_file():
        from hpctrain.config import load_config
        from hpctrain.config.schema import checkpoint_root

        root = checkpoint_root(load_config(str(config_path)).checkpoint.dir, path)
    store = open_store(root)
    steps = committed_steps(store)
    if best:
        step = read_latest(store, BEST_NAME)
        if step is None or step not in steps:
            raise CheckpointError(
                f"{root}: no best checkpoint (the `{BEST_NAME}` pointer is written by runs "
                "with checkpoint.monitor and checkpoint.keep_best)"
            )
        name = f"step-{step}"
        return store, name, verify_checkpoint(store, name)
    if not steps:
        raise CheckpointError(
            f"{path}: no committed checkpoint (give a run folder, a checkpoint folder or a step-<N> folder)"
        )
    problems = []
    for step in steps_to_try(steps, read_latest(store))[0]:
        name = f"step-{step}"
        try:
            return store, name, verify_checkpoint(store, name)
        except UnsafeCheckpointError:  # no fallback
            raise
        except CheckpointError as exc:
            problems.append(str(exc))
    raise CheckpointError(f"{root}: no loadable checkpoint ({'; '.join(problems)})")


def read_model_weights(
    store: Store, name: str, manifest: dict | None = None, *, ema: bool = False
) -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint `name`, consolidated in this process (no process group).

    With the `manifest` (from `verify_checkpoint`), every item read is checked against its
    CRC32C; `.metadata` is read through the same checks as a training load. With `ema`, the
    EMA's parameters replace the model's (its buffers stay).
    """
    checksums = item_checksums(manifest) if manifest is not None else None
    metadata = store.reader(name).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata):
            weights[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not weights:
        raise CheckpointError(f"{store.path(name)}: holds no model weights ({MODEL_PREFIX}*)")
    if ema:
        averaged = {
            key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(EMA_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }
        if not averaged:
            raise CheckpointError(
                f"{store.path(name)}: holds no EMA weights (the run trained without "
                "train.ema_decay); read its trained weights: without --ema "
                "(export, generate) or with train.ema_eval=false (eval, predict)"
            )
        names = [key[len(EMA_PREFIX) :] for key in averaged]
        unknown = sorted(n for n in names if MODEL_PREFIX + n not in weights)
        if unknown:
            raise CheckpointError(
                f"{store.path(name)}: EMA entries without a model weight: {unknown[:3]}"
            )
        for param_name in names:  # the model's copy is not read: the EMA's replaces it
            del weights[MODEL_PREFIX + param_name]
        weights.update(averaged)
    # DCP reads each tensor from every shard file that holds a piece of it (resharding to one).
    # no_dist: this process alone, also inside a job's process group (`hpctrain eval` ranks);
    # DCP then warns that it loads in one process, which is the intent.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                weights,
                storage_reader=store.reader(name, checksums),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except CheckpointException as exc:
        inner = sorted(exc.failures.items())[0][1][0]
        text = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
        kind = type(inner) if isinstance(inner, CheckpointError) else CheckpointError
        raise kind(f"{store.path(name)}: {text}") from None
    return {
        key[len(MODEL_PREFIX) if key.startswith(MODEL_PREFIX) else len(EMA_PREFIX) :]: value
        for key, value in weights.items()
    }
