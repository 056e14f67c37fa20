"""Export a training checkpoint as a consolidated, weights-only state dict.

A DCP checkpoint holds the model sharded (FSDP2) or replicated (DDP) across per-rank files,
next to the optimizer, scheduler, loader and RNG states. `export_weights` reads only the
model's entries (`app.model.*`, the fully qualified names of the plain module: DCP's
`get_state_dict` already strips DDP's `module.` and wrapper prefixes), in one process, and
writes them with `torch.save` so that `torch.load(path, weights_only=True)` gives a state dict
for `model.load_state_dict` of the plain, unwrapped model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.checkpoint import CheckpointError, committed_steps, verify_checkpoint
from hpctrain.checkpoint.manager import item_checksums, read_latest, steps_to_try
from hpctrain.checkpoint.safety import SafeLoadPlanner, UnsafeCheckpointError
from hpctrain.checkpoint.storage import Store, open_store
from hpctrain.errors import UsageError

# `Trainer.checkpoint_states` stores ModelOptimizerState under "app", which puts the model under
# "model": DCP flattens nested keys with dots.
MODEL_PREFIX = "app.model."


@dataclass(frozen=True)
class ExportResult:
    """What `export_weights` wrote."""

    source: str  # the step-<N> folder read
    step: int
    num_tensors: int
    num_elements: int
    out: Path


def locate_checkpoint(path: str) -> tuple[Store, str, dict]:
    """(store, step folder name, manifest) for a run folder, a checkpoint root or a step folder.

    A run folder's checkpoints are where its `config.yaml` says (`checkpoint.dir`), else
    `RUN_DIR/checkpoints`. Of a root, the checkpoint a resume would load (the step `latest`
    names, or the highest below it that verifies; see `hpctrain.checkpoint.manager`).
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

        root = load_config(str(config_path)).checkpoint.dir or str(Path(path) / "checkpoints")
    store = open_store(root)
    steps = committed_steps(store)
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
    store: Store, name: str, manifest: dict | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint `name`, consolidated in this process (no process group).

    With the `manifest` (from `verify_checkpoint`), every item read is checked against its
    CRC32C; `.metadata` is read through the same checks as a training load.
    """
    checksums = item_checksums(manifest) if manifest is not None else None
    metadata = store.reader(name).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata):
            weights[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not weights:
        raise CheckpointError(f"{store.path(name)}: holds no model weights ({MODEL_PREFIX}*)")
    # DCP reads each tensor from every shard file that holds a piece of it (resharding to one).
    try:
        dcp.load(weights, storage_reader=store.reader(name, checksums), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        inner = sorted(exc.failures.items())[0][1][0]
        text = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
        kind = type(inner) if isinstance(inner, CheckpointError) else CheckpointError
        raise kind(f"{store.path(name)}: {text}") from None
    return {key[len(MODEL_PREFIX) :]: value for key, value in weights.items()}


def export_weights(path: str, out: str | Path) -> ExportResult:
    """Write the consolidated model weights of the checkpoint at `path` to `out` (atomically).

    Args:
        path: a run folder, a checkpoint root, or one `step-<N>` folder (local or fsspec URL).
        out: the `.pt` file to write (local).
    """
    store, name, manifest = locate_checkpoint(path)
    weights = read_model_weights(store, name, manifest)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            torch.save(weights, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    except OSError as exc:  # a folder in the way, a read-only place, a full disk
        raise UsageError(f"{out}: cannot write the export: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(
        source=store.path(name),
        step=int(manifest["step"]),
        num_tensors=len(weights),
        num_elements=sum(v.numel() for v in weights.values()),
        out=out,
    )
