"""The few file operations the commit protocol needs, on a local disk or an fsspec URL.

Local paths get the durable versions (fsync of files and folders, atomic `os.replace`).
fsspec URLs (`s3://`, `memory://`, ...) get the closest the store offers: an object PUT is
atomic, a folder rename is copy + delete, so there the `latest` pointer and the manifest
(written inside the folder before it is renamed) are what make a checkpoint trustworthy.

Content checksums: the writers here compute a CRC32C of every DCP item (one tensor or one
blob: a byte range of a `.distcp` file) while DCP writes it, in DCP's writer threads, and hand
them to the coordinator with DCP's own write results; the manager puts them into the manifest.
The readers check each item's CRC32C on the bytes DCP reads anyway (`safety.py`), so a load
verifies exactly what it uses at the cost of the CRC (hardware CRC32C, several GB/s per core),
without a second pass over the files. `.metadata` stays a plain DCP file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import fsspec
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hpctrain.checkpoint.safety import (
    ItemChecksums,
    SafeFileSystemReader,
    SafeFsspecReader,
    check_trusted,
)
from hpctrain.compat_torch import FsspecWriter, StorageInfo, StorageWriterTransforms
from hpctrain.files import fsync_folder, write_atomic

_HASH_CHUNK = 8 << 20
LAST_FILE = "manifest.json"  # written last into a checkpoint folder, removed first from it


def is_local(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def open_store(root: str) -> Store:
    """The store for a checkpoint root: a local path, `file://` path or another fsspec URL."""
    if root.startswith("file://"):
        return LocalStore(root[len("file://") :])
    if "://" not in root:
        return LocalStore(root)
    return FsspecStore(root)


class Store:
    """Operations on one checkpoint root; paths are names relative to it."""

    root: str

    def path(self, *names: str) -> str:
        return "/".join([self.root.rstrip("/"), *names])

    def makedirs(self, name: str = "") -> None:
        raise NotImplementedError

    def listdir(self, name: str = "") -> list[str]:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def isdir(self, name: str) -> bool:
        raise NotImplementedError

    def size(self, name: str) -> int:
        raise NotImplementedError

    def read_bytes(self, name: str) -> bytes:
        raise NotImplementedError

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace `name` by `data` so a reader sees the old or the new content, never a mix:
        durable on a local disk (file and folder fsynced), one PUT on an object store."""
        write_atomic(self.path(name), data, durable=True)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def rmtree(self, name: str) -> None:
        """Remove a folder and its files, or a single file."""
        raise NotImplementedError

    def remove_dir(self, name: str, trash: str) -> None:
        """Remove a committed folder so that a kill midway never leaves a half of it."""
        raise NotImplementedError

    def sync_dir(self, name: str) -> None:
        """Make the files of `name` and its entries durable (no-op where the store is)."""

    def check_trusted(self, names: list[str]) -> None:
        """Refuse paths others could have written (local stores only)."""

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with self._open_read(name) as stream:
            while chunk := stream.read(_HASH_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def _open_read(self, name: str) -> Any:
        raise NotImplementedError

    def writer(self, name: str, *, checksums: bool = True) -> StorageWriter:
        """A DCP writer into folder `name` (a `ChecksumWriter`, computing CRC32Cs or not)."""
        raise NotImplementedError

    def reader(self, name: str, checksums: ItemChecksums | None = None) -> StorageReader:
        """A DCP reader of folder `name` that checks items against `checksums` (if given)."""
        raise NotImplementedError


@dataclasses.dataclass
class _ChecksummedInfo(StorageInfo):
    """DCP's storage info of one item plus its CRC32C, on its way to the coordinator."""

    crc32c: int = 0


class _ChecksumStream(io.IOBase):
    """Passes one item's bytes on to DCP's stream and keeps their CRC32C."""

    def __init__(self, inner: Any, on_close: Callable[[int], None]) -> None:
        self._inner = inner
        self._on_close = on_close
        self._crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._crc = crc32c.crc32c(data, self._crc)  # releases the GIL for large buffers
        return int(self._inner.write(data))

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
            self._on_close(self._crc)
        super().close()


class _ChecksumTransforms(StorageWriterTransforms):
    """Wraps the stream DCP writes each item to (the hook DCP offers per item)."""

    def __init__(self, sink: dict[MetadataIndex, int]) -> None:
        super().__init__(())  # no compression: the CRC covers the bytes on disk
        self._sink = sink

    def transform_save_stream(self, write_item: WriteItem, raw_stream: Any) -> tuple[Any, list]:
        stream, descriptors = super().transform_save_stream(write_item, raw_stream)

        def record(crc: int) -> None:
            self._sink[write_item.index] = crc  # one key per item: no lock needed

        return _ChecksumStream(stream, record), descriptors


class _ErrorRecordingFileSystem:
    """DCP's file system, remembering every error raised while a stream is open, and able to
    tell when no writer thread writes any more.

    DCP's extra writer threads only print their exception and return no results; without
    this, a save whose second thread hit a full disk would look complete. And when DCP's own
    thread fails, DCP returns without joining the others: they may still be writing into the
    save's folder (on a full disk, filling what the removal of that folder frees). After an
    error no new file is opened, and `stop_writing` returns once every open one is closed.
    """

    def __init__(self, fs: Any, errors: list[BaseException]) -> None:
        self._fs = fs
        self._errors = errors
        self._streams = threading.Condition()
        self._open = 0
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def start_writing(self) -> None:
        with self._streams:
            self._stopped = False

    def stop_writing(self) -> None:
        """Refuse new files; return once no writer thread has a file open."""
        with self._streams:
            self._stopped = True
            self._streams.wait_for(lambda: self._open == 0)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._streams:
            if self._stopped:  # another writer failed: this save is lost, write nothing more
                raise OSError(errno.ECANCELED, f"{path}: not written, another writer failed")
            self._open += 1
        try:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
        except BaseException as exc:
            with self._streams:
                self._stopped = True
            self._errors.append(exc)
            raise
        finally:
            with self._streams:
                self._open -= 1
                self._streams.notify_all()


class ChecksumWriter:
    """Mixin for DCP file writers: CRC32C per item while writing, collected by `finish`.

    After a save, the coordinator's writer holds `checksums`: for every file, the
    `[offset, length, crc32c]` of each item in it. With `compute_checksums` False it only
    makes a failure in any of DCP's writer threads fail the save.
    """

    transforms: Any
    fs: Any

    def _set_up_checksums(self, compute: bool) -> None:
        self.compute_checksums = compute
        self._item_crcs: dict[MetadataIndex, int] = {}
        self._errors: list[BaseException] = []
        if compute:
            self.transforms = _ChecksumTransforms(self._item_crcs)
        self.fs = _ErrorRecordingFileSystem(self.fs, self._errors)
        self.checksums: dict[str, list[list[int]]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._item_crcs.clear()
        self._errors.clear()
        self.fs.start_writing()
        failure: BaseException | None = None
        try:
            results = super().write_data(plan, planner).wait()  # type: ignore[misc]
        except BaseException as exc:
            self.fs.stop_writing()  # the caller may remove the folder once this returns
            failure = exc
        if self._errors:
            failure = self._errors[0]  # the first failure, not a writer refused after it
        if failure is not None:
            # Raised here, not in the `except`: that would replace the `__context__` of the
            # first failure, where the OS error behind torch.save's RuntimeError is.
            raise failure
        if len(results) != len(plan.items):
            raise OSError(f"DCP wrote {len(results)} of {len(plan.items)} items (a writer failed)")
        if self.compute_checksums:
            results = [
                dataclasses.replace(
                    result,
                    storage_data=_ChecksummedInfo(
                        **vars(result.storage_data), crc32c=self._item_crcs[result.index]
                    ),
                )
                for result in results
            ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        checksums: dict[str, list[list[int]]] = {}
        plain_results = []
        for rank_results in results:
            plain = []
            for result in rank_results:
                info = result.storage_data
                if isinstance(info, _ChecksummedInfo):
                    checksums.setdefault(info.relative_path, []).append(
                        [info.offset, info.length, info.crc32c]
                    )
                    fields = {
                        f.name: getattr(info, f.name) for f in dataclasses.fields(StorageInfo)
                    }
                    result = dataclasses.replace(result, storage_data=StorageInfo(**fields))
                plain.append(result)
            plain_results.append(plain)
        super().finish(metadata, plain_results)  # type: ignore[misc]
        self.checksums = {name: sorted(items) for name, items in checksums.items()}


class ChecksumFileSystemWriter(ChecksumWriter, FileSystemWriter):
    def __init__(self, path: str, *, checksums: bool = True, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._set_up_checksums(checksums)


class ChecksumFsspecWriter(ChecksumWriter, FsspecWriter):
    def __init__(self, path: str, *, checksums: bool = True, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._set_up_checksums(checksums)


def crc32c_of(data: bytes) -> int:
    return int(crc32c.crc32c(data))


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))

    def makedirs(self, name: str = "") -> None:
        os.makedirs(self.path(name) if name else self.root, exist_ok=True)

    def listdir(self, name: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(name) if name else self.root))
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def isdir(self, name: str) -> bool:
        return os.path.isdir(self.path(name))

    def size(self, name: str) -> int:
        return os.stat(self.path(name)).st_size

    def read_bytes(self, name: str) -> bytes:
        with open(self.path(name), "rb") as f:
            return f.read()

    def rename_dir(self, src: str, dst: str) -> None:
        # os.rename of a folder is atomic on POSIX file systems (also Lustre/GPFS); the
        # parent's fsync makes the new name survive a crash.
        os.rename(self.path(src), self.path(dst))
        fsync_folder(self.root)

    def rmtree(self, name: str) -> None:
        path = self.path(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)

    def remove_dir(self, name: str, trash: str) -> None:
        self.rename_dir(name, trash)  # atomic: the folder is gone from its name at once
        self.rmtree(trash)

    def sync_dir(self, name: str) -> None:
        folder = self.path(name)
        for entry in os.listdir(folder):
            full = os.path.join(folder, entry)
            if os.path.isfile(full):
                _fsync_file(full)
        fsync_folder(folder)

    def check_trusted(self, names: list[str]) -> None:
        check_trusted([self.path(n) if n else self.root for n in names], root=self.root)

    def _open_read(self, name: str) -> Any:
        return open(self.path(name), "rb")

    def writer(self, name: str, *, checksums: bool = True) -> StorageWriter:
        # Two writer threads (one file each per rank) overlap serialization with I/O.
        return ChecksumFileSystemWriter(
            self.path(name), checksums=checksums, sync_files=True, overwrite=True, thread_count=2
        )

    def reader(self, name: str, checksums: ItemChecksums | None = None) -> StorageReader:
        return SafeFileSystemReader(self.path(name), checksums=checksums)


class FsspecStore(Store):
    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.fs, _ = fsspec.core.url_to_fs(self.root)

    def makedirs(self, name: str = "") -> None:
        self.fs.makedirs(self.path(name) if name else self.root, exist_ok=True)

    def listdir(self, name: str = "") -> list[str]:
        folder = self.path(name) if name else self.root
        try:
            entries = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(str(e).rstrip("/")) for e in entries)

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def isdir(self, name: str) -> bool:
        return bool(self.fs.isdir(self.path(name)))

    def size(self, name: str) -> int:
        return int(self.fs.size(self.path(name)))

    def read_bytes(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(name)))

    def rename_dir(self, src: str, dst: str) -> None:
        # Object stores have no folder rename: copy file by file, the manifest last, so a copy
        # cut short leaves a `step-<N>/` without a manifest, which no load accepts. (fsspec's
        # recursive `mv` also fails on s3fs trying to copy the folder's own key.)
        source = self.path(src)
        base = self.fs._strip_protocol(source).rstrip("/")
        files = sorted(self.fs.find(source), key=lambda f: f.endswith("/" + LAST_FILE))
        for path in files:
            assert path.startswith(base + "/"), (path, base)
            self.fs.copy(path, self.path(dst, path[len(base) + 1 :]))
        self.fs.rm(source, recursive=True)

    def remove_dir(self, name: str, trash: str) -> None:
        manifest = self.path(name, LAST_FILE)
        if self.fs.exists(manifest):
            self.fs.rm(manifest)  # uncommitted from here on, whatever happens next
        self.fs.rm(self.path(name), recursive=True)

    def rmtree(self, name: str) -> None:
        self.fs.rm(self.path(name), recursive=True)

    def _open_read(self, name: str) -> Any:
        return self.fs.open(self.path(name), "rb")

    def writer(self, name: str, *, checksums: bool = True) -> StorageWriter:
        # Remote streams have no fileno to fsync; a closed object is durable once its PUT returns.
        return ChecksumFsspecWriter(
            self.path(name), checksums=checksums, sync_files=False, overwrite=True
        )

    def reader(self, name: str, checksums: ItemChecksums | None = None) -> StorageReader:
        return SafeFsspecReader(self.path(name), checksums=checksums)
