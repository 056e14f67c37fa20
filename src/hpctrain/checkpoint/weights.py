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
from typing import Any

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


def weight_entries(
    store: Store, name: str, *, ema: bool = False
) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """The model's tensors in checkpoint `name`: plain name -> (its key in the checkpoint, its
    global size and dtype). With `ema`, the EMA's parameters stand for the model's (its
    buffers stay). Reads `.metadata` only."""
    metadata = store.reader(name).read_metadata()
    tensors = {
        key: entry
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    entries = {
        key[len(MODEL_PREFIX) :]: (key, entry)
        for key, entry in tensors.items()
        if key.startswith(MODEL_PREFIX)
    }
    if not entries:
        raise CheckpointError(f"{store.path(name)}: holds no model weights ({MODEL_PREFIX}*)")
    if not ema:
        return entries
    averaged = {
        key[len(EMA_PREFIX) :]: (key, entry)
        for key, entry in tensors.items()
        if key.startswith(EMA_PREFIX)
    }
    if not averaged:
        raise CheckpointError(
            f"{store.path(name)}: holds no EMA weights (the run trained without "
            "train.ema_decay); read its trained weights: without --ema "
            "(export, generate) or with train.ema_eval=false (eval, predict)"
        )
    unknown = sorted(n for n in averaged if n not in entries)
    if unknown:
        raise CheckpointError(
            f"{store.path(name)}: EMA entries without a model weight: {unknown[:3]}"
        )
    return {**entries, **averaged}  # the model's copy is not read: the EMA's replaces it


def read_model_weights(
    store: Store, name: str, manifest: dict | None = None, *, ema: bool = False
) -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint `name`, consolidated in this process (no process group).

    With the `manifest` (from `verify_checkpoint`), every item read is checked against its
    CRC32C; `.metadata` is read through the same checks as a training load. With `ema`, the
    EMA's parameters replace the model's (its buffers stay).
    """
    entries = weight_entries(store, name, ema=ema)
    weights = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.values()
    }
    # DCP reads each tensor from every shard file that holds a piece of it (resharding to one).
    # no_dist: this process alone, also inside a job's process group (`hpctrain eval` ranks);
    # DCP then warns that it loads in one process, which is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_entries(store, name, manifest, weights, no_dist=True)
    return {plain: weights[key] for plain, (key, _) in entries.items()}


def load_model_weights_sharded(
    store: Store,
    name: str,
    manifest: dict | None,
    entries: dict[str, tuple[str, TensorStorageMetadata]],
    targets: dict[str, torch.Tensor],
    *,
    process_group: Any = None,
) -> None:
    """Fill `targets` (plain name -> this rank's tensor: the DTensors of a sharded model, as
    `get_model_state_dict` gives them) from checkpoint `name` (`entries`: its
    `weight_entries`), in place, with every rank of `process_group` taking part: each rank
    reads the pieces of the checkpoint its own shards need, whatever mesh wrote it (DCP
    reshards), and never the whole model.

    Raises:
        CheckpointError: a name of `targets` the checkpoint does not hold, or a damaged item.
    """
    missing = sorted(set(targets) - set(entries))
    if missing:
        raise CheckpointError(f"{store.path(name)}: holds no weights for {', '.join(missing)}")
    state = {entries[plain][0]: tensor for plain, tensor in targets.items()}
    load_entries(store, name, manifest, state, process_group=process_group)


def load_entries(
    store: Store,
    name: str,
    manifest: dict | None,
    state: dict[str, Any],
    *,
    no_dist: bool = False,
    process_group: Any = None,
) -> None:
    """`dcp.load` of `state` (checkpoint keys -> tensors filled in place) from `name`, item
    checksums checked when the `manifest` is given; DCP's failure becomes one line."""
    checksums = item_checksums(manifest) if manifest is not None else None
    try:
        dcp.load(
            state,
            storage_reader=store.reader(name, checksums),
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as exc:
        inner = sorted(exc.failures.items())[0][1][0]
        text = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
        kind = type(inner) if isinstance(inner, CheckpointError) else CheckpointError
        raise kind(f"{store.path(name)}: {text}") from None
