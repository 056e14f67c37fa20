"""`CheckpointManager`: DCP checkpoints with an atomic commit, retention and safe loading.

Layout of a checkpoint root (`checkpoint.dir`, default `RUN_DIR/checkpoints`):

    step-<N>/            committed checkpoints: DCP files (`.metadata`, `__<r>_<i>.distcp`)
      manifest.json      step, world size, versions, user metadata, size (+ sha256) per file
    latest               "step-<N>": the newest committed checkpoint, written last
    .tmp-step-<N>/       a save in progress (or killed); never loaded, removed on restart
    .damaged-step-<N>/   a checkpoint that failed verification when an older one was loaded
    .abandoned-step-<N>/ a checkpoint past the step a run resumed from (e.g. a rollback)
    .lock                the run lock (lock.py): one run at a time owns the root

Commit protocol (rank 0, after every rank's DCP write returned, which DCP reports only once
all ranks' files are written and fsynced): write `manifest.json` inside `.tmp-step-<N>/`,
fsync the files and the folder, rename it to `step-<N>/`, fsync the root, then replace
`latest` atomically. A kill at any point leaves either no `step-<N>/` or a complete one.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager

import hpctrain
from hpctrain.checkpoint.lock import RunLock, lock_run, unlock_run
from hpctrain.checkpoint.retention import steps_to_delete
from hpctrain.checkpoint.safety import (
    CheckpointError,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_metadata_bytes,
)
from hpctrain.checkpoint.state import PerRankState
from hpctrain.checkpoint.storage import LAST_FILE, Store, open_store
from hpctrain.errors import CheckpointFailure, RunLockedError

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-step-"
DAMAGED_PREFIX = ".damaged-step-"
ABANDONED_PREFIX = ".abandoned-step-"
LATEST_NAME = "latest"
MANIFEST_NAME = LAST_FILE
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")

# DCP warns on every save/load without a process group; a single process is a normal case here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


class CheckpointSaveError(CheckpointFailure, RuntimeError):
    """A save failed (in the background for async saves); the message names the path."""


def _describe(exc: BaseException) -> str:
    """One line for an error; DCP's CheckpointException (a BaseException) wraps per-rank ones."""
    if isinstance(exc, CheckpointException) and exc.failures:
        _, (inner, _trace) = sorted(exc.failures.items(), key=lambda item: item[0])[0]
        exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _planner() -> DefaultSavePlanner:
    # A value under the same key on every rank is written once. DCP's default picks the rank
    # with the least to write, but "replicated" values can differ: BatchNorm running stats
    # under DDP are updated from each rank's batch and made equal again only by the broadcast
    # from rank 0 at the next forward. Saving rank 0's copy is what makes a resume bitwise
    # identical; sharded (FSDP2) tensors are unaffected, each rank still writes its shards.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _written_at(store: Store, step: int) -> float:
    """When checkpoint `step` was saved (its manifest's time); -inf when unreadable."""
    try:
        return float(json.loads(store.read_bytes(f"{step_dir_name(step)}/{MANIFEST_NAME}"))["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("-inf")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def committed_steps(store: Store) -> list[int]:
    """Steps with a committed `step-<N>/` folder in the store, ascending (not verified)."""
    steps = []
    for name in store.listdir():
        match = _STEP_DIR.match(name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def verify_checkpoint(store: Store, name: str, verify: str = "size") -> dict[str, Any]:
    """Check `name` against its manifest and return the manifest, or raise `CheckpointError`.

    Raises `UnsafeCheckpointError` (not a damage to fall back from) when the folder is not
    trusted or its `.metadata` would run code.
    """
    where = store.path(name)
    store.check_trusted(["", name])
    if not store.exists(f"{name}/{MANIFEST_NAME}"):
        raise CheckpointError(f"{where}: no {MANIFEST_NAME} (not a committed hpctrain checkpoint)")
    try:
        manifest = json.loads(store.read_bytes(f"{name}/{MANIFEST_NAME}"))
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}/{MANIFEST_NAME}: unreadable manifest ({exc})") from exc
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{where}: manifest format {manifest.get('format')!r} unknown")
    present = set(store.listdir(name))
    store.check_trusted([f"{name}/{f}" for f in sorted(present)])
    for fname, info in sorted(files.items()):
        if fname not in present:
            raise CheckpointError(f"{where}/{fname}: missing")
        size = store.size(f"{name}/{fname}")
        if size != info["size"]:
            raise CheckpointError(f"{where}/{fname}: {size} bytes, manifest says {info['size']}")
        if verify == "sha256" and "sha256" in info:
            digest = store.sha256(f"{name}/{fname}")
            if digest != info["sha256"]:
                raise CheckpointError(f"{where}/{fname}: sha256 differs from the manifest")
    if ".metadata" not in files:
        raise CheckpointError(f"{where}: the manifest lists no DCP .metadata")
    # Refuse a crafted .metadata here already, before any rank hands the folder to DCP.
    load_metadata_bytes(store.read_bytes(f"{name}/.metadata"), f"{where}/.metadata")
    manifest["step"] = step
    return manifest


class _ReusedBufferStager(AsyncStager):
    """Stages a state dict into CPU buffers allocated once and reused by later saves.

    The copy is the only time an async save blocks training; allocating fresh buffers each time
    (DCP's default stager) roughly doubles it. Buffers are pinned when CUDA is available so
    device-to-host copies run at full speed. They are rebuilt when the structure changes.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._signature: list[Any] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict)
        if self._buffers is None or signature != self._signature:
            pin = torch.cuda.is_available()
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=pin)
            self._signature = signature
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers = None
        self._signature = None


def _signature(obj: Any) -> list[Any]:
    """Structure of a state dict: keys, and shape/dtype of every tensor (local shard)."""
    out: list[Any] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            out.append((path, tuple(local.shape), local.dtype, local.device.type))
        elif isinstance(value, dict):
            for key in value:
                walk(value[key], f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            out.append((path, type(value).__name__, len(value)))
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}")
        else:
            out.append((path, type(value).__name__))

    walk(obj, "")
    return out


class CheckpointManager:
    """Saves and loads DCP checkpoints under `root` with an atomic commit.

    Collective: construct it, `save`, `load`, `wait` and `close` on every rank at the same
    points. With a process group it creates a gloo group of its own, because async saves run
    collectives from a background thread, which must never interleave with the training's
    collectives on the default group (and `dcp.async_save` needs a CPU backend).

    Args:
        root: local folder or fsspec URL holding `step-<N>/` folders and `latest`.
        keep_last: committed checkpoints kept, newest first (at least 1).
        keep_every: also keep steps that are multiples of this (0: none).
        async_save: save with `dcp.async_save`; training continues while files are written;
            at most one save in flight; the commit happens when the write completes.
        verify: "size" (file sizes against the manifest) or "sha256" (also checksums,
            computed at save time).
        timeout_s: how long a collective of the manager's group waits for the other ranks
            (`train.collective_timeout_s`).
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int,
        keep_every: int = 0,
        async_save: bool = False,
        verify: str = "size",
        timeout_s: float = 600.0,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be at least 1, got {keep_last}")
        if verify not in ("size", "sha256"):
            raise ValueError(f"checkpoint.verify must be 'size' or 'sha256', got {verify!r}")
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.verify = verify
        self.loaded_manifest: dict[str, Any] | None = None
        self._store = open_store(root)
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._world_size = dist.get_world_size() if self._distributed else 1
        self._group: dist.ProcessGroup | None = None
        if self._distributed:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self._group = group
        self._executor = ThreadPoolExecutor(1, "hpctrain-checkpoint") if async_save else None
        self._stager = _ReusedBufferStager() if async_save else None
        self._pending: Future[None] | None = None
        self._pending_where = ""
        self._pending_step: int | None = None
        # One run at a time owns the root (lock.py): rank 0 locks it before any clean-up,
        # and every rank fails with the holder's description when another run has it.
        self._lock: RunLock | None = None
        locked_by = ""
        if self._rank == 0:
            self._store.makedirs()
            try:
                self._lock = lock_run(root)
            except RunLockedError as exc:
                locked_by = str(exc)
            else:
                self._remove_leftovers()
        locked_by = self._broadcast(locked_by)
        if locked_by:
            self.close()
            raise RunLockedError(locked_by)

    # -- public API -------------------------------------------------------------------------

    def save(self, step: int, states: dict[str, Any], *, metadata: dict | None = None) -> None:
        """Save `states` as checkpoint `step` (collective; returns at once when async).

        `states` values are `Stateful` objects or plain dicts of tensors and plain data.
        `metadata` (JSON-serializable) goes into the manifest. A step that is already
        committed is not saved again. Raises `CheckpointSaveError` for a failed save,
        including an earlier async one that failed in the background.
        """
        self.wait()
        name = step_dir_name(step)
        exists = self._store.exists(name) if self._rank == 0 else False
        if self._broadcast(exists):
            log.info("checkpoint %s already committed; not saved again", self._store.path(name))
            return
        tmp = f"{TMP_PREFIX}{step}"
        if self._rank == 0 and self._store.exists(tmp):
            self._store.rmtree(tmp)  # a save of this step killed before its commit
        # Other ranks write files only after DCP's first collective, which rank 0 joins
        # after the removal above: no barrier needed.
        manifest = self._manifest_head(step, metadata)
        writer = self._store.writer(tmp)
        where = self._store.path(tmp)
        if self._executor is None:
            self._pending = Future()
            try:
                dcp.save(
                    states, storage_writer=writer, planner=_planner(), process_group=self._group
                )
                self._commit(step, manifest)
                self._pending.set_result(None)
            except (Exception, CheckpointException) as exc:
                self._pending.set_exception(exc)
            self._pending_where = where
            self.wait()
            return
        upload = dcp.async_save(
            states,
            storage_writer=writer,
            planner=_planner(),
            process_group=self._group,
            async_stager=self._stager,
        )
        assert isinstance(upload, Future)
        self._pending = self._executor.submit(self._finish_async, upload, step, manifest)
        self._pending_where = where
        self._pending_step = step

    def wait(self) -> None:
        """Finish an in-flight save; raise `CheckpointSaveError` if it failed on any rank.

        Collective when a save is in flight (then it is in flight on every rank: saves are
        collective); returns at once otherwise.
        """
        error = self._finish_local()
        if error is None:
            return
        where, message = error
        errors = self._gather(message)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            ranks = ",".join(str(r) for r, _ in failed)
            raise CheckpointSaveError(
                f"checkpoint save to {where} failed on rank {ranks}: {failed[0][1]}"
            )

    def _finish_local(self) -> tuple[str, str] | None:
        """Wait for this rank's save in flight: None if there was none, else (path, error)."""
        if self._pending is None:
            return None
        error = ""
        try:
            self._pending.result()
        except (Exception, CheckpointException) as exc:
            error = _describe(exc)
            log.error("checkpoint save to %s failed: %s", self._pending_where, error)
        where = self._pending_where
        self._pending, self._pending_where, self._pending_step = None, "", None
        return where, error

    def load(self, states: dict[str, Any], which: str = "latest") -> int | None:
        """Load a checkpoint into `states` (collective); return its step, or None.

        Args:
            states: the same keys as given to `save`; `Stateful` values load in place,
                plain dict values are replaced in `states`.
            which: "latest" (the newest committed checkpoint under the root that verifies,
                falling back to older ones with a logged reason), "none", or a path/URL of
                a `step-<N>` folder or of another checkpoint root.

        Raises:
            CheckpointError: the requested checkpoint, or every one under the root, fails
                verification; `UnsafeCheckpointError` when a folder is untrusted or a
                file would run code (no fallback then).
        """
        self.wait()
        if which == "none":
            return None
        choice: tuple[str, str, dict[str, Any]] | str | None = None
        if self._rank == 0:
            try:
                choice = self._choose(which)
                if choice is not None:
                    self._set_aside_newer(*choice)
            except CheckpointError as exc:
                choice = f"{type(exc).__name__}\t{exc}"
        choice = self._broadcast(choice)
        if isinstance(choice, str):
            kind, message = choice.split("\t", 1)
            raise (UnsafeCheckpointError if kind == "UnsafeCheckpointError" else CheckpointError)(
                message
            )
        if choice is None:
            return None
        root, name, manifest = choice
        store = open_store(root)
        to_load = self._prepare_per_rank(states, int(manifest.get("world_size", 1)))
        try:
            dcp.load(
                to_load,
                storage_reader=store.reader(name),
                planner=SafeLoadPlanner(),
                process_group=self._group,
            )
        except CheckpointException as exc:
            # DCP wraps every rank's error in a BaseException; surface ours as they are.
            inner = sorted(exc.failures.items(), key=lambda item: item[0])[0][1][0]
            if isinstance(inner, CheckpointError):
                raise type(inner)(f"{store.path(name)}: {inner}") from None
            raise CheckpointError(f"{store.path(name)}: load failed: {_describe(exc)}") from exc
        finally:
            for value in states.values():
                if isinstance(value, PerRankState):
                    value.source_rank = None
        for key, value in to_load.items():
            if not isinstance(states[key], PerRankState):
                states[key] = value
        self.loaded_manifest = manifest
        log.info("resumed from %s (step %d)", store.path(name), manifest["step"])
        return int(manifest["step"])

    def latest_step(self) -> int | None:
        """The newest step committed under the root or being saved by this manager.

        Local (not collective) and not verified. An async save in flight counts as its step,
        so every rank gives the same answer although rank 0 commits in the background.
        """
        steps = committed_steps(self._store)
        if self._pending_step is not None:
            steps.append(self._pending_step)
        return max(steps) if steps else None

    def close(self) -> None:
        """Finish this rank's save in flight, release threads, buffers and the group.

        Not collective, so that it is safe in a `finally` after an error on one rank (call
        `wait()` first on the normal path to learn about failures on other ranks). Raises
        `CheckpointSaveError` when this rank's save failed.
        """
        try:
            error = self._finish_local()
            if error is not None and error[1]:
                raise CheckpointSaveError(f"checkpoint save to {error[0]} failed: {error[1]}")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            if self._lock is not None:
                unlock_run(self._lock)
                self._lock = None

    # -- saving -----------------------------------------------------------------------------

    def _manifest_head(self, step: int, metadata: dict | None) -> dict[str, Any]:
        head = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "world_size": self._world_size,
            "time": time.time(),
            "versions": {"hpctrain": hpctrain.__version__, "torch": torch.__version__},
            "metadata": metadata or {},
        }
        json.dumps(head)  # fail now, in the caller, for metadata that cannot be written
        return head

    def _finish_async(self, upload: Future[Any], step: int, manifest: dict[str, Any]) -> None:
        upload.result()
        self._commit(step, manifest)

    def _commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Rank 0: manifest, fsync, rename, `latest`, retention (see the module docstring)."""
        if self._rank != 0:
            return
        store, tmp, name = self._store, f"{TMP_PREFIX}{step}", step_dir_name(step)
        files: dict[str, dict[str, Any]] = {}
        for fname in store.listdir(tmp):
            if fname == MANIFEST_NAME:
                continue
            info: dict[str, Any] = {"size": store.size(f"{tmp}/{fname}")}
            if self.verify == "sha256":
                info["sha256"] = store.sha256(f"{tmp}/{fname}")
            files[fname] = info
        if ".metadata" not in files:
            raise CheckpointSaveError(f"{store.path(tmp)}: DCP wrote no .metadata")
        store.write_atomic(
            f"{tmp}/{MANIFEST_NAME}", json.dumps({**manifest, "files": files}).encode()
        )
        store.sync_dir(tmp)
        store.rename_dir(tmp, name)
        store.write_atomic(LATEST_NAME, f"{name}\n".encode())
        log.info("checkpoint committed: %s", store.path(name))
        self._apply_retention(protect=step)

    def _apply_retention(self, protect: int) -> None:
        store = self._store
        for step in steps_to_delete(
            committed_steps(store),
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            protect={protect},
        ):
            # Never a half-deleted step-<N> after a kill: rename first (local) or remove the
            # manifest first (object stores).
            store.remove_dir(step_dir_name(step), f"{TRASH_PREFIX}{step}")

    def _remove_leftovers(self) -> None:
        for entry in self._store.listdir():
            if entry.startswith((TMP_PREFIX, TRASH_PREFIX, f"{LATEST_NAME}.tmp-")):
                log.warning("removing %s left by an interrupted save", self._store.path(entry))
                self._store.rmtree(entry)

    # -- loading ----------------------------------------------------------------------------

    def _choose(self, which: str) -> tuple[str, str, dict[str, Any]] | None:
        """Rank 0: (root, folder name, manifest) of the checkpoint to load, or None."""
        if which != "latest":
            parent, _, leaf = which.rstrip("/").rpartition("/")
            store = open_store(parent or ".")
            if store.exists(f"{leaf}/{MANIFEST_NAME}"):
                return store.root, leaf, verify_checkpoint(store, leaf, self.verify)
            root_store = open_store(which)
            if not committed_steps(root_store):
                raise CheckpointError(f"{which}: neither a checkpoint nor a folder of checkpoints")
            return self._choose_newest(root_store)
        return self._choose_newest(self._store)

    def _choose_newest(self, store: Store) -> tuple[str, str, dict[str, Any]] | None:
        steps = committed_steps(store)
        if not steps:
            return None
        pointer = self._read_latest(store)
        problems, damaged = [], []
        # Most recently written first, not highest step: after a resume from an older step
        # (`--resume PATH` to roll back), the new branch's checkpoints are the current ones.
        for step in sorted(steps, key=lambda s: (_written_at(store, s), s), reverse=True):
            name = step_dir_name(step)
            try:
                manifest = verify_checkpoint(store, name, self.verify)
            except UnsafeCheckpointError:
                raise
            except CheckpointError as exc:
                log.warning("checkpoint %s is damaged, trying an older one: %s", name, exc)
                problems.append(str(exc))
                damaged.append(step)
                continue
            if pointer is not None and pointer != name:
                log.info("%s names %s; %s is newer and complete", LATEST_NAME, pointer, name)
            if problems:
                log.warning(
                    "falling back to %s (%d newer damaged)", store.path(name), len(problems)
                )
            if store.root == self._store.root:
                self._set_aside(damaged, DAMAGED_PREFIX, "damaged")
            return store.root, name, manifest
        raise CheckpointError(
            f"{store.root}: no loadable checkpoint ({'; '.join(problems)}); "
            "use --resume none to start over or --resume PATH"
        )

    def _set_aside(self, steps: list[int], prefix: str, why: str) -> None:
        """Rename own `step-<N>` folders to `<prefix><N>`: kept for inspection, never loaded,
        never removed by retention."""
        for step in steps:
            target = f"{prefix}{step}"
            suffix = 1
            while self._store.exists(target):
                target, suffix = f"{prefix}{step}.{suffix}", suffix + 1
            self._store.rename_dir(step_dir_name(step), target)
            log.warning(
                "set aside %s (%s) as %s", step_dir_name(step), why, self._store.path(target)
            )

    def _set_aside_newer(self, root: str, name: str, manifest: dict[str, Any]) -> None:
        """Set aside own checkpoints at or past the step being resumed, other than itself.

        Training redoes those steps. Left in place, a damaged or abandoned `step-<N>` would
        turn the next save of step N into a no-op, make `latest_step()` name it, and come
        back on the next automatic resume.
        """
        step = int(manifest["step"])
        chosen = open_store(root).path(name)
        newer = [
            s
            for s in committed_steps(self._store)
            if s > step or (s == step and self._store.path(step_dir_name(s)) != chosen)
        ]
        self._set_aside(newer, ABANDONED_PREFIX, f"newer than the resumed step {step}")

    @staticmethod
    def _read_latest(store: Store) -> str | None:
        try:
            return store.read_bytes(LATEST_NAME).decode().strip() or None
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def _prepare_per_rank(self, states: dict[str, Any], saved_world_size: int) -> dict[str, Any]:
        to_load = {}
        for key, value in states.items():
            if isinstance(value, PerRankState):
                if self._rank < saved_world_size:
                    value.source_rank = self._rank
                elif value.fallback_rank is not None:
                    value.source_rank = value.fallback_rank
                else:
                    log.info(
                        "%s: no saved state for rank %d (saved at world size %d); kept fresh",
                        key,
                        self._rank,
                        saved_world_size,
                    )
                    continue
            to_load[key] = value
        return to_load

    # -- collectives on the manager's own group ---------------------------------------------

    def _broadcast(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)
