"""One way to write a small file whole or not at all, locally or at an fsspec URL.

Local paths: a temporary name in the same folder, then `os.replace`; `durable=True` also
fsyncs the file and its folder, so the new name survives a power cut (checkpoint pointers,
indexes, exports). Remote URLs: one `pipe_file` (a single PUT, atomic on object stores).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hpctrain.errors import UsageError

TEMP_MARKER = ".tmp-"

Payload = bytes | Callable[[IO[bytes]], object]
# A full file system, or a full quota (what $WORK and $SCRATCH enforce per project).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the local file `path`; {} where it is missing, unreadable, not JSON
    (a record cut by a kill) or not an object: records a failure may have left half-written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def no_space(exc: BaseException) -> bool:
    """Whether `exc` is a write that found no room (a full disk or quota)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def write_atomic(url: str | Path, data: Payload, *, durable: bool = True, what: str = "") -> None:
    """Write `data` (bytes, or a function writing to a binary file) to `url` atomically.

    `what` (e.g. "the export"): an `OSError` becomes a one-line `UsageError` naming `url`
    ("cannot write the export: No space left on device"); without it the `OSError` is raised.
    A temporary file is never left behind.
    """
    try:
        if "://" not in str(url) and "::" not in str(url):  # a path: no fsspec to import
            _write_local(os.path.abspath(os.path.expanduser(str(url))), data, durable)
            return
        import fsspec  # only for URLs: its import costs the job script's steps ~0.1 s each
        from fsspec.implementations.local import LocalFileSystem

        fs, path = fsspec.core.url_to_fs(str(url))
        if isinstance(fs, LocalFileSystem):
            _write_local(path, data, durable)
        elif callable(data):
            with fs.open(path, "wb") as f:
                data(f)
        else:
            fs.pipe_file(path, data)
    except OSError as exc:
        if not what:
            raise
        raise UsageError(f"{url}: cannot write {what}: {exc.strerror or exc}") from None


def fsync_folder(path: str) -> None:
    """Make a new or renamed entry of folder `path` survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local(path: str, data: Payload, durable: bool) -> None:
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".{name}{TEMP_MARKER}{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        if os.path.lexists(temp):
            os.unlink(temp)
    if durable:
        fsync_folder(folder)
