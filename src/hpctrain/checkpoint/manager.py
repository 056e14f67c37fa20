"""`CheckpointManager`: DCP checkpoints with an atomic commit, retention and safe loading.

Layout of a checkpoint root (`checkpoint.dir`, default `RUN_DIR/checkpoints`):

    step-<N>/            committed checkpoints: DCP files (`.metadata`, `__<r>_<i>.distcp`)
      manifest.json      step, world size, versions, user metadata; per file its size, the
                         [offset, length, crc32c] of every DCP item in it (+ sha256)
    latest               "step-<N>": the newest committed checkpoint, written last
    best                 "step-<N>": the best by `checkpoint.monitor` (with `keep_best`)
    .tmp-step-<N>/       a save in progress (or killed); never loaded, removed on restart
    .damaged-step-<N>/   a checkpoint that failed verification when an older one was loaded
    .abandoned-step-<N>/ a checkpoint past the step a run resumed from (e.g. a rollback), or
                         an earlier run's, set aside by a start with `--resume none`
    .lock                the run lock (lock.py): one run at a time owns the root

Commit protocol (rank 0, after every rank's DCP write returned, which DCP reports only once
all ranks' files are written and fsynced): write `manifest.json` inside `.tmp-step-<N>/`,
fsync the files and the folder, rename it to `step-<N>/`, fsync the root, then replace
`latest` atomically. A kill at any point leaves either no `step-<N>/` or a complete one.

Which checkpoint `load("latest")` picks, by step numbers and the pointer only (never by the
times in manifests: node clocks differ):

1. `latest` names the newest committed step of the current run. Each manifest names its
   `parent`: the step the saving run had loaded or saved before it (null for a run's first
   save). The one step past the pointer whose parent is the pointer's step is the current
   run's too (a commit cut between its rename and the pointer: a SIGKILL at the end of a
   preemption save must not lose that save): it is tried first. Other steps above the
   pointer (a run started over with `--resume none` over older, higher steps) are never
   loaded, and set aside as `.abandoned-step-<N>` when the run resumes below them (as for a
   rollback with `--resume PATH`, which sets aside everything past the resumed step).
2. Then the step the pointer names, if it verifies; else the highest step below it that
   verifies. Each one that fails is set aside as `.damaged-step-<N>` with the reason logged.
3. Without a readable pointer (a first save cut before it), the highest step that verifies.

Best checkpoints (`keep_best` > 0): a save may carry a score, the value of the monitored
evaluation metric at that step; its manifest records it with the metric's name. After every
commit, retention keeps the `keep_best` best scored checkpoints (of the same metric) besides
the `keep_last` newest, and `best` is replaced (atomically, like `latest`) to name the best.

Verification (`checkpoint.verify`): the manifest parses with the right types, every file has
its size, `.metadata` its CRC32C, and every storage path `.metadata` names is a file of this
folder; with "crc32c" (the default) each item read is checked against the CRC32C computed
while it was written, so a flipped byte found while loading also sets the checkpoint aside and
falls back. "sha256" also hashes every file on rank 0 before loading; "size" skips the
checksums (and saves without them).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time
import warnings
from collections.abc import Callable
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
from hpctrain.checkpoint.retention import best_steps, steps_to_delete
from hpctrain.checkpoint.safety import (
    CheckpointError,
    ChecksumMismatchError,
    ItemChecksums,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    is_plain_file_name,
    load_metadata_bytes,
)
from hpctrain.checkpoint.state import PerRankState
from hpctrain.checkpoint.storage import LAST_FILE, ChecksumWriter, Store, crc32c_of, open_store
from hpctrain.errors import CheckpointFailure, RunLockedError

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-step-"
DAMAGED_PREFIX = ".damaged-step-"
ABANDONED_PREFIX = ".abandoned-step-"
LATEST_NAME = "latest"
BEST_NAME = "best"
MANIFEST_NAME = LAST_FILE
MANIFEST_FORMAT = 1
VERIFY_MODES = ("size", "crc32c", "sha256")
DEFAULT_VERIFY = "crc32c"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _silence_single_process_warning() -> None:
    """DCP warns on every save and load without a process group, a normal case for a
    single-process run. Installed when such a manager is made, not at import: async saves
    warn from DCP's own thread, where a `catch_warnings` block around the call cannot reach."""
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninit"
    )


class CheckpointSaveError(CheckpointFailure, RuntimeError):
    """A save failed (in the background for async saves); the message names the path."""


# What every rank raises when rank 0 cannot start on the root (see `_start_on_rank0`).
_START_ERRORS: dict[str, type[Exception]] = {
    "unsafe": UnsafeCheckpointError,
    "locked": RunLockedError,
    "unusable": CheckpointError,
}


def _first_failure(exc: BaseException) -> BaseException:
    """The lowest rank's error inside DCP's CheckpointException (a BaseException), else exc."""
    if isinstance(exc, CheckpointException) and exc.failures:
        _, (inner, _trace) = sorted(exc.failures.items(), key=lambda item: item[0])[0]
        return inner
    return exc


def _describe(exc: BaseException) -> str:
    """One line for an error, naming the OS error behind it when there is one.

    A full disk met inside `torch.save` surfaces as "RuntimeError: ... unexpected pos"; the
    `OSError` (ENOSPC, EDQUOT, EIO...) it came from is in the chain, and is what the user
    must read.
    """
    exc = _first_failure(exc)
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno is not None:
            exc = cause
            break
        cause = cause.__cause__ or cause.__context__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _planner() -> DefaultSavePlanner:
    # A value under the same key on every rank is written once. DCP's default picks the rank
    # with the least to write, but "replicated" values can differ: BatchNorm running stats
    # under DDP are updated from each rank's batch and made equal again only by the broadcast
    # from rank 0 at the next forward. Saving rank 0's copy is what makes a resume bitwise
    # identical; sharded (FSDP2) tensors are unaffected, each rank still writes its shards.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


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


def _is_count(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_file_entry(fname: object, info: object) -> str | None:
    """What is wrong with one `files` entry of a manifest, or None."""
    if not is_plain_file_name(fname):
        return f"file name {fname!r} is not a plain name"
    if not isinstance(info, dict) or not _is_count(info.get("size")):
        return f"{fname}: entry without a byte size"
    if "sha256" in info and not (isinstance(info["sha256"], str) and _SHA256.match(info["sha256"])):
        return f"{fname}: sha256 is not 64 hex digits"
    if "crc32c" in info:
        chunks = info["crc32c"]
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 3 and all(_is_count(v) for v in c) for c in chunks
        ):
            return f"{fname}: crc32c is not a list of [offset, length, crc]"
        end = 0
        for offset, length, _crc in sorted(chunks):  # the items cover the file, no byte unchecked
            if offset != end:
                return f"{fname}: crc32c items do not cover bytes {end}..{offset}"
            end = offset + length
        if end != info["size"]:
            return f"{fname}: crc32c items cover {end} of {info['size']} bytes"
    return None


def parse_manifest(data: bytes, where: str, name: str = "") -> dict[str, Any]:
    """The manifest of checkpoint folder `name`, or `CheckpointError` for anything malformed
    (not JSON, a missing field, a wrong type, a step other than the folder's)."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: unreadable manifest ({why})")

    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise bad(f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{where}: manifest format {manifest.get('format')!r} unknown")
    for key, minimum in (("step", 0), ("world_size", 1)):
        if not _is_count(manifest.get(key), minimum):
            raise bad(f"{key} is {manifest.get(key)!r}, not an integer >= {minimum}")
    for key in ("metadata", "versions"):
        if not isinstance(manifest.get(key, {}), dict):
            raise bad(f"{key} is not an object")
    if manifest.get("parent") is not None and not _is_count(manifest["parent"], 0):
        raise bad(f"parent is {manifest['parent']!r}, not null or an integer >= 0")
    score = manifest.get("score")
    if score is not None and not (
        isinstance(score, dict)
        and isinstance(score.get("monitor"), str)
        and isinstance(score.get("value"), (int, float))
        and not isinstance(score.get("value"), bool)
    ):
        raise bad(f"score is {score!r}, not null or {{monitor: name, value: number}}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("files is not an object of file entries")
    for fname, info in files.items():
        problem = _check_file_entry(fname, info)
        if problem is not None:
            raise bad(problem)
    if ".metadata" not in files:
        raise CheckpointError(f"{where}: the manifest lists no DCP .metadata")
    match = _STEP_DIR.match(name)
    if match and int(match.group(1)) != manifest["step"]:
        raise bad(f"step {manifest['step']} in folder {name}")
    return manifest


def item_checksums(manifest: dict[str, Any]) -> ItemChecksums:
    """(file, offset) -> (length, crc32c) of every DCP item, for the readers."""
    return {
        (fname, offset): (length, crc)
        for fname, info in manifest["files"].items()
        if fname != ".metadata"
        for offset, length, crc in info.get("crc32c", ())
    }


def verify_checkpoint(store: Store, name: str, verify: str = DEFAULT_VERIFY) -> dict[str, Any]:
    """Check `name` against its manifest and return the manifest, or raise `CheckpointError`.

    Checks the manifest, file sizes, the CRC32C of `.metadata`, and that every storage path
    in `.metadata` is a file of this folder (see the module docstring; item checksums are
    checked while DCP reads). Raises `UnsafeCheckpointError` (not a damage to fall back
    from) when the folder is not trusted or its `.metadata` would run code or read outside.
    """
    where = store.path(name)
    store.check_trusted(["", name])
    if not store.exists(f"{name}/{MANIFEST_NAME}"):
        raise CheckpointError(f"{where}: no {MANIFEST_NAME} (not a committed hpctrain checkpoint)")
    manifest = parse_manifest(
        store.read_bytes(f"{name}/{MANIFEST_NAME}"), f"{where}/{MANIFEST_NAME}", name
    )
    files = manifest["files"]
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
    data = store.read_bytes(f"{name}/.metadata")
    chunks = files[".metadata"].get("crc32c")
    if verify != "size" and chunks and chunks[0][2] != crc32c_of(data):
        raise ChecksumMismatchError(f"{where}/.metadata: crc32c differs from the manifest")
    # Refuse a crafted .metadata here already, before any rank hands the folder to DCP.
    metadata = load_metadata_bytes(data, f"{where}/.metadata")
    for info in metadata.storage_data.values():
        entry = files.get(info.relative_path)
        if entry is None:
            raise CheckpointError(
                f"{where}/.metadata: names {info.relative_path!r}, not a file of the manifest"
            )
        if info.offset + info.length > entry["size"]:
            raise CheckpointError(f"{where}/{info.relative_path}: shorter than .metadata says")
    return manifest


def read_latest(store: Store, pointer: str = LATEST_NAME) -> int | None:
    """The step `latest` (or the `best` pointer) names; None when missing or not `step-<N>`."""
    try:
        text = store.read_bytes(pointer).decode().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    match = _STEP_DIR.match(text)
    if match is None:
        log.warning("%s holds %r, not step-<N>: ignored", store.path(pointer), text[:40])
        return None
    return int(match.group(1))


def _parent_of(store: Store, step: int) -> int | None:
    """The `parent` that step `step`'s manifest names; None when it names none or is
    unreadable (verification then says why, if the step is ever tried)."""
    name = step_dir_name(step)
    try:
        manifest = parse_manifest(store.read_bytes(f"{name}/{MANIFEST_NAME}"), name, name)
    except (OSError, CheckpointError):
        return None
    parent = manifest.get("parent")
    return parent if isinstance(parent, int) else None


def steps_to_try(
    steps: list[int], pointer: int | None, parent_of: Callable[[int], int | None] = lambda s: None
) -> tuple[list[int], list[int]]:
    """(steps to try in this order, steps past the pointer that are never loaded): the rule
    of the module docstring, from the committed steps, `latest`'s step and the `parent` that
    a step's manifest names (None when unreadable)."""
    if pointer is None:
        return sorted(steps, reverse=True), []
    below = sorted((s for s in steps if s <= pointer), reverse=True)
    past = sorted(s for s in steps if s > pointer)
    if past and parent_of(past[0]) == pointer:  # the next commit, cut before the pointer
        return [past[0], *below], past[1:]
    return below, past


def check_root_trusted(store: Store) -> None:
    """Refuse a checkpoint root that a later load would refuse (`UnsafeCheckpointError`).

    Checks what loads check (the root, `latest`, every committed `step-<N>` and its files,
    the folders above the root); run at start-up, so that a run never trains for hours
    towards checkpoints it will not load. A root that does not exist yet: its parents.
    """
    if not store.exists(""):
        store.check_trusted([])
        return
    names = [""] + ([LATEST_NAME] if store.exists(LATEST_NAME) else [])
    for step in committed_steps(store):
        folder = step_dir_name(step)
        names += [folder] + [f"{folder}/{f}" for f in store.listdir(folder)]
    store.check_trusted(names)


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
        verify: "crc32c" (default: a CRC32C per item computed while writing, checked while
            reading), "sha256" (also a sha256 per file, computed and checked by rank 0 in a
            full read) or "size" (file sizes only; no checksums written).
        timeout_s: how long a collective of the manager's group waits for the other ranks
            (`train.collective_timeout_s`).
        monitor: the name of the evaluation metric that `save(score=...)` values are of
            (`checkpoint.monitor`); scores saved under another name are not compared.
        mode: "max" or "min": which scores are better (`checkpoint.mode`).
        keep_best: keep the best K scored checkpoints and name the best in `best` (0: none).

    Raises:
        UnsafeCheckpointError: at construction, when anything under `root` that a load would
            read is not trusted (see `check_root_trusted`): the run must not start.
        RunLockedError: at construction, when another run holds the root's lock (lock.py).
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int,
        keep_every: int = 0,
        async_save: bool = False,
        verify: str = DEFAULT_VERIFY,
        timeout_s: float = 600.0,
        monitor: str = "",
        mode: str = "max",
        keep_best: int = 0,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be at least 1, got {keep_last}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"checkpoint.verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.verify = verify
        self.monitor, self.mode, self.keep_best = monitor, mode, keep_best
        if keep_best and not monitor:
            raise ValueError(
                "checkpoint.keep_best needs checkpoint.monitor (the metric to rank by)"
            )
        best_steps({}, keep_best=0, mode=mode)  # refuses an unknown mode now, not at a commit
        self._scores: dict[int, float | None] = {}  # rank 0: step -> score, read from manifests
        self.loaded_manifest: dict[str, Any] | None = None
        self.loaded_from = ""  # the path of the loaded checkpoint
        self.tried_manifest: dict[str, Any] | None = None  # of a load that failed, to explain it
        self.missing_states: list[str] = []  # `optional` states the loaded checkpoint lacked
        self._store = open_store(root)
        self._distributed = dist.is_available() and dist.is_initialized()
        self._rank = dist.get_rank() if self._distributed else 0
        self._world_size = dist.get_world_size() if self._distributed else 1
        self._group: dist.ProcessGroup | None = None
        if self._distributed:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self._group = group
        else:
            _silence_single_process_warning()
        self._executor = ThreadPoolExecutor(1, "hpctrain-checkpoint") if async_save else None
        self._stager = _ReusedBufferStager() if async_save else None
        self._pending: Future[None] | None = None
        self._pending_where = ""
        self._pending_step: int | None = None
        self._parent: int | None = None  # the step loaded or saved last (manifest "parent")
        # One run at a time owns the root (lock.py): rank 0 locks it before any clean-up.
        # Every rank fails with the same error when rank 0 cannot start: another run holds
        # the lock, or the root is untrusted (a run must not start towards checkpoints it
        # would refuse to load) or unusable.
        self._lock: RunLock | None = None
        problem = self._start_on_rank0() if self._rank == 0 else None
        problem = self._broadcast(problem)  # also the barrier: rank 0 has cleaned up
        if problem is not None:
            self.close()
            kind, message = problem
            raise _START_ERRORS[kind](message)

    # -- public API -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        states: dict[str, Any],
        *,
        metadata: dict | None = None,
        score: float | None = None,
    ) -> None:
        """Save `states` as checkpoint `step` (collective; returns at once when async).

        `states` values are `Stateful` objects or plain dicts of tensors and plain data.
        `metadata` (JSON-serializable) goes into the manifest, and so does `score`, the
        monitored metric's value at this step (for `keep_best` and `best`). A step that is already
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
        manifest = self._manifest_head(step, metadata, score)
        self._parent = step  # of the next save (a failed save fails the run at `wait`)
        writer = self._store.writer(tmp, checksums=self.verify != "size")
        where = self._store.path(tmp)
        if self._executor is None:
            self._pending = Future()
            try:
                dcp.save(
                    states, storage_writer=writer, planner=_planner(), process_group=self._group
                )
                self._commit(step, manifest, writer)
                self._pending.set_result(None)
            except (Exception, CheckpointException) as exc:
                self._discard_failed(tmp)
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
        self._pending = self._executor.submit(self._finish_async, upload, step, manifest, writer)
        self._pending_where = where
        self._pending_step = step

    def annotate(self, step: int, *, metadata: dict, score: float | None) -> None:
        """Replace the metadata and score of committed checkpoint `step` (collective).

        For an evaluation of the step that ran after its save (the final one: saved first,
        so that an evaluation that fails loses no training). Retention and `best` then take
        the new score into account.
        """
        self.wait()
        if self._rank == 0:
            name = step_dir_name(step)
            path = f"{name}/{MANIFEST_NAME}"
            manifest = parse_manifest(self._store.read_bytes(path), self._store.path(path), name)
            head = self._manifest_head(step, metadata, score)
            manifest.update(metadata=head["metadata"], score=head["score"])
            self._store.write_atomic(path, json.dumps(manifest).encode())
            self._scores.pop(step, None)
            self._apply_retention(protect=step)
        self._broadcast(None)  # every rank returns after the manifest is replaced

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

    def load(
        self, states: dict[str, Any], which: str = "latest", *, optional: tuple[str, ...] = ()
    ) -> int | None:
        """Load a checkpoint into `states` (collective); return its step, or None.

        Args:
            states: the same keys as given to `save`; `Stateful` values load in place,
                plain dict values are replaced in `states`.
            which: "latest" (the newest committed checkpoint under the root that verifies,
                falling back to older ones with a logged reason), "none", or a path/URL of
                a `step-<N>` folder or of another checkpoint root.
            optional: keys of `states` that a checkpoint may lack (state a feature adds,
                such as the EMA, and an older run saved without): those the loaded
                checkpoint has no entry for are left as they are and listed in
                `missing_states`; every other key must be in the checkpoint.

        Raises:
            CheckpointError: the requested checkpoint, or every one under the root, fails
                verification; `UnsafeCheckpointError` when a folder is untrusted or a
                file would run code (no fallback then).
        """
        self.wait()
        if which == "none":
            if self._rank == 0:
                self._set_aside_all()
            self._broadcast(None)  # no rank saves before rank 0 has set them aside
            return None
        skip: set[str] = set()  # rank 0: checkpoints found damaged while reading
        while True:
            self.tried_manifest = None
            choice: tuple[str, str, dict[str, Any]] | str | None = None
            if self._rank == 0:
                try:
                    choice = self._choose(which, skip)
                    if choice is not None:
                        self._set_aside_newer(*choice)
                except CheckpointError as exc:
                    choice = f"{type(exc).__name__}\t{exc}"
            choice = self._broadcast(choice)
            if isinstance(choice, str):
                kind, message = choice.split("\t", 1)
                error = (
                    UnsafeCheckpointError if kind == "UnsafeCheckpointError" else CheckpointError
                )
                raise error(message)
            if choice is None:
                return None
            root, name, manifest = choice
            self.tried_manifest = manifest
            try:
                return self._load_chosen(states, root, name, manifest, optional)
            except ChecksumMismatchError as exc:
                if which != "latest" and open_store(which).root == open_store(root).path(name):
                    raise  # the user named this checkpoint: no other one instead
                # Every rank got the same error from DCP: all try the next one together.
                log.warning("checkpoint %s is damaged, trying an older one: %s", name, exc)
                if self._rank == 0:
                    skip.add(open_store(root).path(name))
                    if open_store(root).root == self._store.root:
                        self._set_aside([manifest["step"]], DAMAGED_PREFIX, "damaged")

    def _load_chosen(
        self,
        states: dict[str, Any],
        root: str,
        name: str,
        manifest: dict[str, Any],
        optional: tuple[str, ...] = (),
    ) -> int:
        """Load checkpoint `name` of `root` (collective). Values DCP reads in place (tensors)
        may hold part of it after a `ChecksumMismatchError`; the next load overwrites them."""
        store = open_store(root)
        to_load = self._prepare_per_rank(states, manifest["world_size"])
        self.missing_states = []
        if optional:
            saved = store.reader(name).read_metadata().state_dict_metadata
            prefixes = {key.split(".", 1)[0] for key in saved}
            self.missing_states = [k for k in optional if k in to_load and k not in prefixes]
            for key in self.missing_states:
                del to_load[key]
        checksums = item_checksums(manifest) if self.verify != "size" else None
        try:
            dcp.load(
                to_load,
                storage_reader=store.reader(name, checksums),
                planner=SafeLoadPlanner(),
                process_group=self._group,
            )
        except CheckpointException as exc:
            # DCP wraps every rank's error in a BaseException; surface ours as they are.
            inner = _first_failure(exc)
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
        self.loaded_from = store.path(name)  # the caller logs the resume, with its own detail
        self._parent = int(manifest["step"])
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

    def _manifest_head(
        self, step: int, metadata: dict | None, score: float | None = None
    ) -> dict[str, Any]:
        head = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "world_size": self._world_size,
            "time": time.time(),
            "versions": {"hpctrain": hpctrain.__version__, "torch": torch.__version__},
            "metadata": metadata or {},
            "parent": self._parent,  # see the module docstring's rule 1
            "score": None if score is None else {"monitor": self.monitor, "value": float(score)},
        }
        json.dumps(head)  # fail now, in the caller, for metadata that cannot be written
        return head

    def _finish_async(
        self, upload: Future[Any], step: int, manifest: dict[str, Any], writer: Any
    ) -> None:
        try:
            upload.result()
            self._commit(step, manifest, writer)
        except BaseException:
            self._discard_failed(f"{TMP_PREFIX}{step}")
            raise

    def _discard_failed(self, tmp: str) -> None:
        """Rank 0: remove the temporary folder of a save that failed, lock still held.

        DCP reports a failed write on rank 0 only once every rank's write returned, and a
        writer returns only once none of its threads writes any more (storage.py): nothing
        writes into `tmp` now. Left in place, a save that filled the disk would keep it full,
        and the next start could not even write its run lock. Committed folders are never
        touched: `tmp` is gone once its commit renamed it.
        """
        if self._rank != 0:
            return
        try:
            if self._store.exists(tmp):
                self._store.rmtree(tmp)
                log.warning("removed %s of the failed save", self._store.path(tmp))
        except OSError as exc:
            log.warning(
                "could not remove %s of the failed save (%s); the next start removes it",
                self._store.path(tmp),
                exc.strerror or exc,
            )

    def _commit(self, step: int, manifest: dict[str, Any], writer: Any) -> None:
        """Rank 0: manifest, fsync, rename, `latest`, retention (see the module docstring)."""
        if self._rank != 0:
            return
        store, tmp, name = self._store, f"{TMP_PREFIX}{step}", step_dir_name(step)
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
            if self.verify == "sha256":
                info["sha256"] = store.sha256(f"{tmp}/{fname}")
            files[fname] = info
        if ".metadata" not in files:
            raise CheckpointSaveError(f"{store.path(tmp)}: DCP wrote no .metadata")
        for fname, info in files.items():  # never commit what no load would accept
            problem = _check_file_entry(fname, info)
            if problem is not None:
                raise CheckpointSaveError(f"{store.path(tmp)}: {problem}")
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

    def _read_scores(self, steps: list[int]) -> dict[int, float]:
        """Rank 0: the scores of `steps` for this manager's metric (manifests read once)."""
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
        """Rank 0: make `best` name the best committed checkpoint (or remove a stale one)."""
        best = best_steps(scores, keep_best=1, mode=self.mode)
        if best:
            if read_latest(self._store, BEST_NAME) != best[0]:
                self._store.write_atomic(BEST_NAME, f"{step_dir_name(best[0])}\n".encode())
        elif self._store.exists(BEST_NAME):
            self._store.rmtree(BEST_NAME)  # names a checkpoint that is gone

    def best_step(self) -> int | None:
        """The step `best` names (local, not verified), or None."""
        return read_latest(self._store, BEST_NAME)

    def _start_on_rank0(self) -> tuple[str, str] | None:
        """Create the root, refuse it if a load would, lock it, clean up.

        Returns None, or (kind, message) of the error every rank raises (`_START_ERRORS`)."""
        try:
            self._store.makedirs()
            check_root_trusted(self._store)
            self._lock = lock_run(self.root)
            self._remove_leftovers()
        except UnsafeCheckpointError as exc:
            return "unsafe", str(exc)
        except RunLockedError as exc:
            return "locked", str(exc)
        except OSError as exc:  # a file in the way, a read-only or unreachable place
            return (
                "unusable",
                f"{self.root}: cannot use the checkpoint folder: {exc.strerror or exc}",
            )
        return None

    def _remove_leftovers(self) -> None:
        for entry in self._store.listdir():
            if entry.startswith(
                (TMP_PREFIX, TRASH_PREFIX, f"{LATEST_NAME}.tmp-", f"{BEST_NAME}.tmp-")
            ):
                log.warning("removing %s left by an interrupted save", self._store.path(entry))
                self._store.rmtree(entry)

    # -- loading ----------------------------------------------------------------------------

    def _choose(self, which: str, skip: set[str]) -> tuple[str, str, dict[str, Any]] | None:
        """Rank 0: (root, folder name, manifest) of the checkpoint to load, or None."""
        if which != "latest":
            parent, _, leaf = which.rstrip("/").rpartition("/")
            store = open_store(parent or ".")
            if store.exists(f"{leaf}/{MANIFEST_NAME}"):
                return store.root, leaf, verify_checkpoint(store, leaf, self.verify)
            root_store = open_store(which)
            if not committed_steps(root_store):
                raise CheckpointError(f"{which}: neither a checkpoint nor a folder of checkpoints")
            return self._choose_newest(root_store, skip)
        return self._choose_newest(self._store, skip)

    def _choose_newest(
        self, store: Store, skip: set[str]
    ) -> tuple[str, str, dict[str, Any]] | None:
        """Rank 0: the checkpoint of `store` that the rule of the module docstring picks."""
        steps = committed_steps(store)
        if not steps:
            return None
        pointer = read_latest(store)
        candidates, past = steps_to_try(steps, pointer, lambda s: _parent_of(store, s))
        if past:
            log.warning(
                "%s names step-%d: %s past it are not the current run's and are not loaded",
                store.path(LATEST_NAME),
                pointer,
                ", ".join(step_dir_name(s) for s in past),
            )
        problems, damaged = [], []
        for step in candidates:
            name = step_dir_name(step)
            if store.path(name) in skip:
                continue
            try:
                manifest = verify_checkpoint(store, name, self.verify)
            except UnsafeCheckpointError:
                raise
            except CheckpointError as exc:
                log.warning("checkpoint %s is damaged, trying an older one: %s", name, exc)
                problems.append(str(exc))
                damaged.append(step)
                continue
            if problems:
                log.warning(
                    "falling back to %s (%d newer damaged)", store.path(name), len(problems)
                )
            if store.root == self._store.root:
                self._set_aside(damaged, DAMAGED_PREFIX, "damaged")
            return store.root, name, manifest
        if store.root == self._store.root:
            self._set_aside(damaged, DAMAGED_PREFIX, "damaged")
        found = (
            "; ".join(problems)
            or f"{LATEST_NAME} names step-{pointer}, and no step is at or below it"
        )
        raise CheckpointError(
            f"{store.root}: no loadable checkpoint ({found}); "
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
        if newer and self.keep_best:  # `best` may name one of them
            self._scores.clear()
            self._point_best(self._read_scores(committed_steps(self._store)))

    def _set_aside_all(self) -> None:
        """Rank 0, `--resume none`: set aside every committed step of the root (an earlier
        run's), so that this run's steps and `latest` are its own only.

        Left in place, an old `step-<N>` would turn this run's save of step N into a no-op,
        and `latest` would bring the old run back on the next automatic resume. The pointers
        are removed: the folders they name are set aside, kept under their new names.
        """
        steps = committed_steps(self._store)
        if not steps:
            return
        self._set_aside(steps, ABANDONED_PREFIX, "an earlier run's: --resume none starts over")
        for pointer in (LATEST_NAME, BEST_NAME):
            if self._store.exists(pointer):
                self._store.rmtree(pointer)
        self._scores.clear()

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
