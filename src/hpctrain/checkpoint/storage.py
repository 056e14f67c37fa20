"""The few file operations the commit protocol needs, on a local disk or an fsspec URL.

Local paths get the durable versions (fsync of files and folders, atomic `os.replace`).
fsspec URLs (`s3://`, `memory://`, ...) get the closest the store offers: an object PUT is
atomic, a folder rename is copy + delete, so there the `latest` pointer and the manifest
(written inside the folder before it is renamed) are what make a checkpoint trustworthy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

import fsspec
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from hpctrain.checkpoint.safety import SafeFileSystemReader, SafeFsspecReader, check_trusted

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
        """Replace `name` by `data` so a reader sees the old or the new content, never a mix."""
        raise NotImplementedError

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

    def writer(self, name: str) -> StorageWriter:
        raise NotImplementedError

    def reader(self, name: str) -> StorageReader:
        raise NotImplementedError


def _fsync_path(path: str, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
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

    def write_atomic(self, name: str, data: bytes) -> None:
        target = self.path(name)
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_path(os.path.dirname(target), directory=True)

    def rename_dir(self, src: str, dst: str) -> None:
        # os.rename of a folder is atomic on POSIX file systems (also Lustre/GPFS); the
        # parent's fsync makes the new name survive a crash.
        os.rename(self.path(src), self.path(dst))
        _fsync_path(self.root, directory=True)

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
                _fsync_path(full, directory=False)
        _fsync_path(folder, directory=True)

    def check_trusted(self, names: list[str]) -> None:
        check_trusted([self.path(n) if n else self.root for n in names])

    def _open_read(self, name: str) -> Any:
        return open(self.path(name), "rb")

    def writer(self, name: str) -> StorageWriter:
        # Two writer threads (one file each per rank) overlap serialization with I/O.
        return FileSystemWriter(self.path(name), sync_files=True, overwrite=True, thread_count=2)

    def reader(self, name: str) -> StorageReader:
        return SafeFileSystemReader(self.path(name))


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

    def write_atomic(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(name), data)  # one PUT: atomic on object stores

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

    def writer(self, name: str) -> StorageWriter:
        # Remote streams have no fileno to fsync; a closed object is durable once its PUT returns.
        return FsspecWriter(self.path(name), sync_files=False, overwrite=True)

    def reader(self, name: str) -> StorageReader:
        return SafeFsspecReader(self.path(name))
