"""The commit of a saved checkpoint, retention after it, and the clean-up of failed saves.

Commit protocol (rank 0, after every rank's DCP write returned, which DCP reports only once
all ranks' files are written and fsynced): write `manifest.json` inside `.tmp-step-<N>/`,
fsync the files and the folder, rename it to `step-<N>/`, fsync the root, then replace
`latest` atomically. A kill at any point leaves either no `step-<N>/` or a complete one.

Best checkpoints (`keep_best` > 0): a save may carry a score, the value of the monitored
evaluation metric at that step; its manifest records it with the metric's name. After every
commit, retention keeps the `keep_best` best scored checkpoints (of the same metric) besides
the `keep_last` newest, and `best` is replaced (atomically, like `latest`) to name the best.

Everything here but `save_planner` and `manifest_head` runs on rank 0 only.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import hpctrain
from hpctrain.checkpoint.manifest import (
    BEST_NAME,
    LATEST_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    check_file_entry,
    committed_steps,
    parse_manifest,
    read_latest,
    step_dir_name,
)
from hpctrain.checkpoint.retention import best_steps, steps_to_delete
from hpctrain.checkpoint.safety import CheckpointError
from hpctrain.checkpoint.storage import ChecksumWriter, Store, crc32c_of
from hpctrain.errors import CheckpointFailure
from hpctrain.files import TEMP_MARKER

log = logging.getLogger(__name__)


class CheckpointSaveError(CheckpointFailure, RuntimeError):
    """A save failed (in the background for async saves); the message names the path."""


def save_planner() -> DefaultSavePlanner:
    # A value under the same key on every rank is written once. DCP's default picks the rank
    # with the least to write, but "replicated" values can differ: BatchNorm running stats
    # under DDP are updated from each rank's batch and made equal again only by the broadcast
    # from rank 0 at the next forward. Saving rank 0's copy is what makes a resume bitwise
    # identical; sharded (FSDP2) tensors are unaffected, each rank still writes its shards.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def manifest_head(
    step: int,
    *,
    world_size: int,
    parent: int | None,
    metadata: dict | None,
    monitor: str,
    score: float | None = None,
) -> dict[str, Any]:
    """The manifest of checkpoint `step` but its `files` (known once DCP wrote them)."""
    head = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "versions": {"hpctrain": hpctrain.__version__, "torch": torch.__version__},
        "metadata": metadata or {},
        "parent": parent,  # see rule 1 of selection.py
        "score": None if score is None else {"monitor": monitor, "value": float(score)},
    }
    json.dumps(head)  # fail now, in the caller, for metadata that cannot be written
    return head


def commit(store: Store, step: int, manifest: dict[str, Any], writer: Any, verify: str) -> None:
    """Manifest, fsync, rename, `latest` (see the module docstring); retention is the caller's."""
    tmp, name = f"{TMP_PREFIX}{step}", step_dir_name(step)
    # Item checksums of every rank's files, gathered by DCP into the coordinator's writer.
    checksums = (
        writer.checksums
        if isinstance(writer, ChecksumWriter) and writer.compute_checksums
        else None
    )
    files: dict[str, dict[str, Any]] = {}
    for fname in store.listdir(tmp):
        if fname == MANIFEST_NAME:
            continue
        info: dict[str, Any] = {"size": store.size(f"{tmp}/{fname}")}
        if checksums is not None and fname == ".metadata":
            info["crc32c"] = [[0, info["size"], crc32c_of(store.read_bytes(f"{tmp}/{fname}"))]]
        elif checksums is not None:
            info["crc32c"] = checksums.get(fname, [])
        if verify == "sha256":
            info["sha256"] = store.sha256(f"{tmp}/{fname}")
        files[fname] = info
    if ".metadata" not in files:
        raise CheckpointSaveError(f"{store.path(tmp)}: DCP wrote no .metadata")
    for fname, info in files.items():  # never commit what no load would accept
        problem = check_file_entry(fname, info)
        if problem is not None:
            raise CheckpointSaveError(f"{store.path(tmp)}: {problem}")
    store.write_atomic(f"{tmp}/{MANIFEST_NAME}", json.dumps({**manifest, "files": files}).encode())
    store.sync_dir(tmp)
    store.rename_dir(tmp, name)
    store.write_atomic(LATEST_NAME, f"{name}\n".encode())
    log.info("checkpoint committed: %s", store.path(name))


def discard_failed(store: Store, tmp: str) -> None:
    """Remove the temporary folder of a save that failed, lock still held.

    DCP reports a failed write on rank 0 only once every rank's write returned, and a
    writer returns only once none of its threads writes any more (storage.py): nothing
    writes into `tmp` now. Left in place, a save that filled the disk would keep it full,
    and the next start could not even write its run lock. Committed folders are never
    touched: `tmp` is gone once its commit renamed it.
    """
    try:
        if store.exists(tmp):
            store.rmtree(tmp)
            log.warning("removed %s of the failed save", store.path(tmp))
    except OSError as exc:
        log.warning(
            "could not remove %s of the failed save (%s); the next start removes it",
            store.path(tmp),
            exc.strerror or exc,
        )


# What interrupted saves leave: temporary folders, half-removed steps, pointers being
# replaced (`files.write_atomic`'s temporary names, and the names older versions used).
_LEFTOVER_PREFIXES = (
    TMP_PREFIX,
    TRASH_PREFIX,
    *(f"{dot}{pointer}{TEMP_MARKER}" for pointer in (LATEST_NAME, BEST_NAME) for dot in ("", ".")),
)


def remove_leftovers(store: Store) -> None:
    """Remove what interrupted saves left in the root (`_LEFTOVER_PREFIXES`)."""
    for entry in store.listdir():
        if entry.startswith(_LEFTOVER_PREFIXES):
            log.warning("removing %s left by an interrupted save", store.path(entry))
            store.rmtree(entry)


class Retention:
    """What stays after each commit, and the `best` pointer (rank 0).

    Args: as `CheckpointManager`'s. The scores of committed steps are read from their
    manifests once and cached; `forget` drops them when a manifest or the steps change.
    """

    def __init__(
        self,
        store: Store,
        *,
        keep_last: int,
        keep_every: int,
        keep_best: int,
        monitor: str,
        mode: str,
    ) -> None:
        self._store = store
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.monitor, self.mode = monitor, mode
        self._scores: dict[int, float | None] = {}  # step -> score, read from manifests

    def apply(self, protect: int) -> None:
        """Remove the committed steps retention does not keep (never `protect`), point `best`."""
        store = self._store
        committed = committed_steps(store)
        scores = self._read_scores(committed) if self.keep_best else {}
        for step in steps_to_delete(
            committed,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            protect={protect},
            scores=scores,
            keep_best=self.keep_best,
            mode=self.mode,
        ):
            # Never a half-deleted step-<N> after a kill: rename first (local) or remove the
            # manifest first (object stores).
            store.remove_dir(step_dir_name(step), f"{TRASH_PREFIX}{step}")
        if self.keep_best:
            self._point_best(scores)

    def forget(self, step: int | None = None) -> None:
        """Drop the cached score of `step` (its manifest changed), or of every step."""
        if step is None:
            self._scores.clear()
        else:
            self._scores.pop(step, None)

    def repoint_best(self) -> None:
        """Make `best` name the best of the committed steps again (some were set aside)."""
        self._scores.clear()
        self._point_best(self._read_scores(committed_steps(self._store)))

    def _read_scores(self, steps: list[int]) -> dict[int, float]:
        """The scores of `steps` for this metric (manifests read once)."""
        for step in steps:
            if step not in self._scores:
                name = step_dir_name(step)
                try:
                    score = parse_manifest(
                        self._store.read_bytes(f"{name}/{MANIFEST_NAME}"), name, name
                    ).get("score")
                except (OSError, CheckpointError):
                    score = None  # unreadable: never best; loading would set it aside anyway
                if score is not None and score["monitor"] == self.monitor:
                    self._scores[step] = float(score["value"])
                else:
                    self._scores[step] = None
        return {s: v for s in steps if (v := self._scores[s]) is not None}

    def _point_best(self, scores: dict[int, float]) -> None:
        """Make `best` name the best committed checkpoint (or remove a stale one)."""
        best = best_steps(scores, keep_best=1, mode=self.mode)
        if best:
            if read_latest(self._store, BEST_NAME) != best[0]:
                self._store.write_atomic(BEST_NAME, f"{step_dir_name(best[0])}\n".encode())
        elif self._store.exists(BEST_NAME):
            self._store.rmtree(BEST_NAME)  # names a checkpoint that is gone
