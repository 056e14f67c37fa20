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

The manager runs the collectives; the jobs have their own modules: the manifest and its
verification (`manifest.py`), which checkpoint a load picks (`selection.py`), the commit
protocol and retention (`commit.py`), async staging (`staging.py`), file operations and
checksums (`storage.py`), safe loading (`safety.py`).
"""

from __future__ import annotations

import datetime
import json
import logging
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpctrain.checkpoint.commit import (
    CheckpointSaveError,
    Retention,
    commit,
    discard_failed,
    manifest_head,
    remove_leftovers,
    save_planner,
)
from hpctrain.checkpoint.lock import RunLock, lock_run, unlock_run
from hpctrain.checkpoint.manifest import (
    BEST_NAME,
    DAMAGED_PREFIX,
    DEFAULT_VERIFY,
    MANIFEST_NAME,
    TMP_PREFIX,
    VERIFY_MODES,
    check_root_trusted,
    committed_steps,
    item_checksums,
    parse_manifest,
    read_latest,
    step_dir_name,
    verify_checkpoint,
)
from hpctrain.checkpoint.retention import best_steps
from hpctrain.checkpoint.safety import (
    CheckpointError,
    ChecksumMismatchError,
    SafeLoadPlanner,
    UnsafeCheckpointError,
)
from hpctrain.checkpoint.selection import (
    choose,
    set_aside,
    set_aside_all,
    set_aside_newer,
    steps_to_try,
)
from hpctrain.checkpoint.staging import ReusedBufferStager, StagingTooLarge
from hpctrain.checkpoint.state import PerRankState
from hpctrain.checkpoint.storage import open_store
from hpctrain.errors import RunLockedError

# Imported from here by other modules (the checkpoint package re-exports the public ones).
__all__ = [
    "BEST_NAME",
    "CheckpointManager",
    "CheckpointSaveError",
    "check_root_trusted",
    "committed_steps",
    "item_checksums",
    "read_latest",
    "step_dir_name",
    "steps_to_try",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)


def _silence_single_process_warning() -> None:
    """DCP warns on every save and load without a process group, a normal case for a
    single-process run. Installed when such a manager is made, not at import: async saves
    warn from DCP's own thread, where a `catch_warnings` block around the call cannot reach."""
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninit"
    )


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
        self.loaded_manifest: dict[str, Any] | None = None
        self.loaded_from = ""  # the path of the loaded checkpoint
        self.tried_manifest: dict[str, Any] | None = None  # of a load that failed, to explain it
        self.missing_states: list[str] = []  # `optional` states the loaded checkpoint lacked
        self._store = open_store(root)
        self._retention = Retention(  # rank 0
            self._store,
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
        )
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
        self._stager = ReusedBufferStager(self._group) if async_save else None
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

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The gloo group every DCP load and save of this run coordinates over (None: one
        process); `model.init_from`'s sharded read of a run folder uses it too."""
        return self._group

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
        self._pending_where = self._store.path(tmp)
        if self._executor is not None:
            try:
                upload = dcp.async_save(
                    states,
                    storage_writer=writer,
                    planner=save_planner(),
                    process_group=self._group,
                    async_stager=self._stager,
                )
            except StagingTooLarge as exc:  # every rank: the stager decides on gathered sizes
                log.warning("%s: saving synchronously from now on", exc)
                self._stop_async()
            else:
                assert isinstance(upload, Future)
                finish = self._finish_async
                self._pending = self._executor.submit(finish, upload, step, manifest, writer)
                self._pending_step = step
                return
        self._pending = Future()
        try:
            dcp.save(
                states, storage_writer=writer, planner=save_planner(), process_group=self._group
            )
            self._commit(step, manifest, writer)
            self._pending.set_result(None)
        except (Exception, CheckpointException) as exc:
            self._discard_failed(tmp)
            self._pending.set_exception(exc)
        self.wait()

    def _stop_async(self) -> None:
        """Save synchronously from now on; release the thread and the staging buffer."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

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
            self._retention.forget(step)
            self._retention.apply(protect=step)
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
            if self._rank == 0 and set_aside_all(self._store):
                self._retention.forget()
            self._broadcast(None)  # no rank saves before rank 0 has set them aside
            return None
        skip: set[str] = set()  # rank 0: checkpoints found damaged while reading
        while True:
            self.tried_manifest = None
            choice: tuple[str, str, dict[str, Any]] | str | None = None
            if self._rank == 0:
                try:
                    choice = choose(self._store, which, self.verify, skip)
                    newer = set_aside_newer(self._store, choice) if choice is not None else []
                    if newer and self.keep_best:  # `best` may name one of them
                        self._retention.repoint_best()
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
                        set_aside(self._store, [manifest["step"]], DAMAGED_PREFIX, "damaged")

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
            self._stop_async()
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
        return manifest_head(
            step,
            world_size=self._world_size,
            parent=self._parent,
            metadata=metadata,
            monitor=self.monitor,
            score=score,
        )

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
        if self._rank == 0:
            discard_failed(self._store, tmp)

    def _commit(self, step: int, manifest: dict[str, Any], writer: Any) -> None:
        """Rank 0: commit checkpoint `step` (commit.py), then apply retention."""
        if self._rank == 0:
            commit(self._store, step, manifest, writer, self.verify)
            self._retention.apply(protect=step)

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
            remove_leftovers(self._store)
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

    # -- loading ----------------------------------------------------------------------------

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
