"""The run lock: one run at a time owns a checkpoint root.

Two runs on one root (a duplicated submission, a manual run during a job, orphaned ranks)
would resume from each other's checkpoints, remove each other's `.tmp-step-N` and delete
each other's checkpoints by retention. Rank 0 of a run takes this lock before it touches the
root (see `CheckpointManager`) and keeps it until `close()`; a second run fails at once with
`RunLockedError` naming the lock, the holder's host, pid, SLURM job and since when.

The lock is the file (or object) `<root>/.lock` holding a JSON record of its holder: host,
pid, SLURM job id and restart count, a random token, `since`, and `expires`, a lease that a
thread renews every `lease_s / 4` while the run lives.

- Local roots (POSIX file systems): `flock` on the file; the kernel drops it when the holder
  dies, however it dies. flock is exact on one node, but on some cluster file systems it does
  not reach other nodes (Lustre mounted with `localflock`) or is refused (`noflock`); the
  record covers that: a record of a holder on another host whose lease has not expired is
  honoured even when flock succeeds.
- Object stores (`s3://`, any fsspec URL): no lock primitive, only the record (one PUT). A
  start writes its record, waits `settle_s` and reads it back: of two runs starting together,
  the one whose record was overwritten fails.

A holder is taken over as gone when: flock was granted and the record is from this host (the
kernel released it); its lease has expired (it stopped renewing: dead, or frozen for longer
than the lease); or the record is from the same SLURM job with a lower restart count (a
requeued job: SLURM ended all processes of the previous run of the job before restarting it),
or with the same restart count and a lower attempt (`HPCTRAIN_ATTEMPT`, set by the job script:
a restart inside the allocation begins after srun ended every task of the attempt before).
Wall clocks of nodes are compared: they are assumed to agree within seconds (NTP).
A root this user cannot write is not locked (a warning says so): such a run can neither
save nor remove anything there.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec

from hpctrain.errors import RunLockedError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
LEASE_S = 120.0
SETTLE_S = 1.0


def holder_record(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This process as a lock holder (without the lease times)."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job_id": job,
        "restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        "attempt": int(env.get("HPCTRAIN_ATTEMPT", "0") or 0),
        "token": uuid.uuid4().hex,
    }


def _when(t: Any) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(t), datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC"
        )
    except (TypeError, ValueError, OverflowError):
        return "an unknown time"


def describe_holder(path: str, record: dict[str, Any]) -> str:
    """The one-line message of `RunLockedError` for `record` holding `path`."""
    job = record.get("job_id") or "none"
    return (
        f"{path} is held by another run: host {record.get('host', '?')}, "
        f"pid {record.get('pid', '?')}, SLURM job {job}, since {_when(record.get('since'))} "
        f"(lease renewed until {_when(record.get('expires'))}); stop that run or wait for it "
        "(a dead holder's lease expires by itself), or give this run another checkpoint.dir"
    )


def takeover_reason(
    record: dict[str, Any], me: dict[str, Any], now: float, *, flock_granted: bool
) -> str | None:
    """Why the holder of `record` is gone and may be replaced by `me`, or None if it may live.

    A pure function of the records (see the module docstring for the rules).
    """
    if flock_granted and record.get("host") == me["host"]:
        return "its flock was released (the holder on this host is gone)"
    try:
        expires = float(record.get("expires", 0))
    except (TypeError, ValueError):
        expires = 0.0
    if expires < now:
        return f"its lease expired at {_when(expires)}"
    try:
        restart = int(record.get("restart", 0))
    except (TypeError, ValueError):
        restart = me["restart"]
    if me["job_id"] and record.get("job_id") == me["job_id"] and restart < me["restart"]:
        return f"it is the previous run of the requeued job {me['job_id']}"
    try:
        attempt = int(record.get("attempt", 0))
    except (TypeError, ValueError):
        attempt = 0
    same_run = me["job_id"] and record.get("job_id") == me["job_id"] and restart == me["restart"]
    if same_run and 0 < attempt < me.get("attempt", 0):
        return f"it is attempt {attempt} of job {me['job_id']}, which ended before this one began"
    return None


class RunLock:
    """An exclusive, renewed lock on a checkpoint root (see the module docstring).

    Args:
        root: local folder or fsspec URL of the checkpoint root (it must exist).
        lease_s: how long a record stays valid without renewal.
        settle_s: object stores only: wait before reading the record back after writing it.
    """

    def __init__(self, root: str, *, lease_s: float = LEASE_S, settle_s: float = SETTLE_S) -> None:
        self.lease_s = lease_s
        self.settle_s = settle_s
        self.me = holder_record()
        self._local = "://" not in root or root.startswith("file://")
        if self._local:
            folder = os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
            self.path = os.path.join(folder, LOCK_NAME)
        else:
            self.fs, _ = fsspec.core.url_to_fs(root)
            self.path = f"{root.rstrip('/')}/{LOCK_NAME}"
        self._fd: int | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- taking and giving back ------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock or raise `RunLockedError` naming the holder."""
        flock_granted = False
        if self._local:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                if exc.errno not in _READ_ONLY:
                    raise
                self._unlocked(exc)
                return
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flock_granted = True
            except BlockingIOError:
                self._close_fd()
                raise RunLockedError(describe_holder(self.path, self._read() or {})) from None
            except OSError as exc:  # a mount without flock (Lustre `noflock`): the record only
                log.warning(
                    "%s: flock unavailable (%s); using the lease record only", self.path, exc
                )
        try:
            record = self._read()
            if record and record.get("token") != self.me["token"]:
                why = takeover_reason(record, self.me, time.time(), flock_granted=flock_granted)
                if why is None:
                    raise RunLockedError(describe_holder(self.path, record))
                # A holder whose flock the kernel released on this host is certainly gone (a
                # run that failed or was killed): routine, not a warning. A lease judged
                # expired, or a requeued job's previous run, is worth a look.
                (log.info if flock_granted else log.warning)(
                    "taking over %s from host %s pid %s (job %s): %s",
                    self.path,
                    record.get("host"),
                    record.get("pid"),
                    record.get("job_id") or "none",
                    why,
                )
            self.me["since"] = time.time()
            try:
                self._write()
            except PermissionError as exc:  # an object store that lets this user only read
                self._unlocked(exc)
                return
            except OSError as exc:
                if exc.errno in _NO_SPACE:  # a full disk, not another run: say which
                    raise OSError(
                        exc.errno,
                        f"{os.strerror(exc.errno)}: cannot write the run lock record "
                        f"{self.path} (the file system is full, not locked by another run)",
                    ) from exc
                raise
            if not flock_granted:  # another run may have written its record at the same time
                time.sleep(self.settle_s)
                record = self._read()
                if record is None or record.get("token") != self.me["token"]:
                    raise RunLockedError(describe_holder(self.path, record or {}))
        except BaseException:
            self._close_fd()
            raise
        self._renewer = threading.Thread(target=self._renew, name="hpctrain-run-lock", daemon=True)
        self._renewer.start()

    def _unlocked(self, exc: OSError) -> None:
        # This run cannot write into the root, so it cannot damage another run's files there
        # either (nor save: its first save fails with the path).
        log.warning("%s: no run lock taken, the folder is not writable (%s)", self.path, exc)

    def release(self) -> None:
        """Stop renewing, clear the record if it is still ours, drop the flock."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        with contextlib.suppress(OSError):
            record = self._read()
            if record is not None and record.get("token") == self.me["token"]:
                self._clear()
        self._close_fd()

    # -- the record --------------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        for attempt in range(2):
            try:
                if self._local:
                    with open(self.path, "rb") as f:  # another descriptor: our flock stays
                        data = f.read()
                else:
                    data = self.fs.cat_file(self.path)
            except FileNotFoundError:
                return None
            if not data.strip():
                return None  # released
            try:
                record = json.loads(data)
                return record if isinstance(record, dict) else None
            except ValueError:
                if attempt == 0:
                    time.sleep(0.2)  # read while the holder renewed it: read again
        return None  # cut short by a crash mid-write: no holder

    def _write(self) -> None:
        self.me["expires"] = time.time() + self.lease_s
        data = json.dumps(self.me).encode()
        if self._local:
            # In place, never by rename: the flock belongs to this file's inode.
            assert self._fd is not None
            os.pwrite(self._fd, data, 0)  # then cut: never empty (free) while renewed
            os.ftruncate(self._fd, len(data))
            os.fsync(self._fd)
        else:
            self.fs.pipe_file(self.path, data)  # one PUT

    def _clear(self) -> None:
        if self._local:
            assert self._fd is not None
            os.ftruncate(self._fd, 0)  # kept, not unlinked: others may wait on this inode
            os.fsync(self._fd)
        else:
            self.fs.rm(self.path)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                record = self._read()
                if record is not None and record.get("token") != self.me["token"]:
                    log.error(
                        "%s was taken over by host %s pid %s (job %s): this run no longer owns "
                        "its checkpoint folder",
                        self.path,
                        record.get("host"),
                        record.get("pid"),
                        record.get("job_id") or "none",
                    )
                    return
                self._write()
            except Exception as exc:  # a transient store error: the lease still has time
                log.warning("renewing %s failed: %s", self.path, exc)

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


_held: dict[str, tuple[RunLock, int]] = {}  # lock path → (lock, users) in this process
_held_lock = threading.Lock()


def lock_run(root: str, *, lease_s: float = LEASE_S) -> RunLock:
    """Take the run lock of `root` for this process (shared by managers of one process)."""
    with _held_lock:
        lock = RunLock(root, lease_s=lease_s)
        if lock.path in _held:
            held, users = _held[lock.path]
            _held[lock.path] = (held, users + 1)
            return held
        lock.acquire()
        _held[lock.path] = (lock, 1)
        return lock


def unlock_run(lock: RunLock) -> None:
    """Give back one use of `lock`; the last one releases it."""
    with _held_lock:
        held, users = _held.get(lock.path, (lock, 1))
        if users > 1:
            _held[lock.path] = (held, users - 1)
            return
        _held.pop(lock.path, None)
    lock.release()
