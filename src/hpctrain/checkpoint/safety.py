"""Loading checkpoints without running code from them.

DCP stores three kinds of bytes: tensor data (read by DCP with `torch.load(weights_only=True)`),
non-tensor values such as counters and RNG tuples (read by `DefaultLoadPlanner.load_bytes`
with full unpickling in torch 2.14), and the `.metadata` file (read with a bare
`pickle.load`). The last two would run whatever a crafted file asks for, so hpctrain replaces
both readers:

- `.metadata` goes through `RestrictedUnpickler`, whose `find_class` only returns the DCP
  metadata dataclasses, `torch.Size`, torch dtypes/layouts and `pathlib` paths. A pickle can
  only call what `find_class` hands it (REDUCE/NEWOBJ/BUILD need a callable from the stack,
  and every callable reaches the stack through GLOBAL/STACK_GLOBAL), so a file that names
  `os.system` or `builtins.exec` fails with `UnsafeCheckpointError` before anything runs.
- non-tensor values go through `torch.load(weights_only=True)` (`SafeLoadPlanner`), which
  accepts tensors, primitive types, tuples, lists, dicts and `OrderedDict`.

The `.metadata` also says where each item's bytes are (`storage_data`: a file name, an
offset, a length). DCP joins that name to the folder, so an absolute or `..` name would read
another checkpoint's files: every name must be a plain file name inside the folder.

Local checkpoint folders are further trusted only when the user owns them and others cannot
write them, and no folder above them lets others replace them (`check_trusted`). Many projects
switch weights-only loading off again after torch 2.6 made it the default; hpctrain never does.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import stat
from pathlib import Path
from typing import IO, Any

import crc32c
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hpctrain.compat_torch import FsspecReader, StorageInfo, metadata_path, set_element
from hpctrain.errors import CheckpointFailure


class CheckpointError(CheckpointFailure, ValueError):
    """A checkpoint cannot be used: missing, damaged, untrusted or unsafe."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code or comes from a folder others may write."""


class ChecksumMismatchError(CheckpointError):
    """Bytes read from a checkpoint file differ from the checksum written with them."""


# (file name, offset) -> (length, crc32c) of every item DCP wrote, from the manifest.
ItemChecksums = dict[tuple[str, int], tuple[int, int]]


def is_plain_file_name(name: object) -> bool:
    """A name that stays inside its folder: no separator, not empty, not `.` or `..`."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata needs (see module docstring)."""

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeCheckpointError(
            f"{self._source}: refused to unpickle {module}.{name} (not DCP metadata; "
            "the file may be crafted to run code)"
        )


def load_metadata_bytes(data: bytes, source: str) -> Metadata:
    """Unpickle DCP `.metadata` bytes with `RestrictedUnpickler`."""
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{source}: unreadable DCP metadata ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{source}: holds a {type(metadata).__name__}, not DCP metadata"
        )
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{source}: DCP metadata without storage entries")
    for info in metadata.storage_data.values():
        if not isinstance(info, StorageInfo):
            raise CheckpointError(f"{source}: storage entry is a {type(info).__name__}")
        if not is_plain_file_name(info.relative_path):
            raise UnsafeCheckpointError(
                f"{source}: storage path {info.relative_path!r} is outside the checkpoint "
                "folder (the file may be crafted to read other files)"
            )
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise CheckpointError(f"{source}: storage entry with a bad offset or length")
    return metadata


def _read_metadata_safely(reader: Any, rank: int | None) -> Metadata:
    path = metadata_path(reader, rank)
    with reader.fs.create_stream(path, "rb") as stream:
        data = stream.read()
    metadata = load_metadata_bytes(data, os.fspath(path))
    # Same post-processing as FileSystemReader.read_metadata.
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    assert metadata.storage_meta is not None
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def _crc_of_file_range(file: IO[bytes], name: str, offset: int, length: int) -> int | None:
    """CRC32C of bytes offset..offset+length of a local file through a memory map, or None
    for a stream without a file descriptor. Reading into memory instead and handing DCP a
    BytesIO made `torch.load` of the item 2x slower; the map costs only the CRC."""
    try:
        fd = file.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    if length == 0:
        return 0
    if offset + length > os.fstat(fd).st_size:  # never touch a mapped page past the end
        raise ChecksumMismatchError(f"{name}: shorter than bytes {offset}..{offset + length}")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a map starts on a page boundary
    # MAP_POPULATE maps the (page-cached) range in one call instead of a fault per page.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with (
        mmap.mmap(fd, offset + length - start, flags, mmap.PROT_READ, offset=start) as mapped,
        memoryview(mapped) as view,
    ):
        return int(crc32c.crc32c(view[offset - start :]))


def _read_checked(file: IO[bytes], info: StorageInfo, checksums: ItemChecksums) -> IO[bytes] | None:
    """Check one item's CRC32C before DCP reads it.

    Returns the item's bytes for a stream that had to be read to check them, None when DCP
    can read the item from `file` as usual (a local file, checked through a memory map, or a
    file written without checksums).
    """
    name = info.relative_path
    expected = checksums.get((name, info.offset))
    if expected is None:
        if any(key[0] == name for key in checksums):  # a range the writer never wrote
            raise ChecksumMismatchError(
                f"{name}: no crc32c for bytes {info.offset}+{info.length} (metadata and "
                "manifest disagree)"
            )
        return None
    length, crc = expected
    mismatch = ChecksumMismatchError(
        f"{name}: crc32c mismatch in bytes {info.offset}..{info.offset + info.length} "
        "(the file changed after it was written)"
    )
    if length != info.length:
        raise mismatch
    local = _crc_of_file_range(file, name, info.offset, length)
    if local is not None:
        if local != crc:
            raise mismatch
        return None
    file.seek(info.offset)
    data = file.read(length)
    if len(data) != length or crc32c.crc32c(data) != crc:
        raise mismatch
    return io.BytesIO(data)


class SafeReader:
    """Mixin for DCP file readers: `.metadata` through `RestrictedUnpickler`, and each item
    read checked against `checksums` (see `storage.py`)."""

    checksums: ItemChecksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata_safely(self, kwargs.get("rank"))

    def _slice_file(self, file: Any, sinfo: StorageInfo) -> IO[bytes]:
        checked = _read_checked(file, sinfo, self.checksums) if self.checksums else None
        if checked is not None:
            return checked
        return super()._slice_file(file, sinfo)  # type: ignore[misc]


class SafeFileSystemReader(SafeReader, FileSystemReader):
    def __init__(self, path: str | os.PathLike, checksums: ItemChecksums | None = None) -> None:
        super().__init__(path)
        self.checksums = checksums or {}


class SafeFsspecReader(SafeReader, FsspecReader):
    def __init__(self, path: str | os.PathLike, checksums: ItemChecksums | None = None) -> None:
        super().__init__(path)
        self.checksums = checksums or {}


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor values load with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} is not plain data "
                f"(weights_only refused it: {str(exc).splitlines()[0]})"
            ) from exc
        # Mirrors DefaultLoadPlanner.load_bytes, with the safe load above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def trust_problem(path: str, st: os.stat_result, uid: int) -> str | None:
    """Why a local checkpoint path should not be trusted, or None (a pure check on a stat)."""
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def parent_problem(path: str, st: os.stat_result) -> str | None:
    """Why a folder above a checkpoint root lets others replace it, or None (pure).

    Others may write a parent only with the sticky bit (/tmp, a tmpfs): there only an entry's
    owner can rename or remove it, so nobody can swap the run's folder for theirs.
    """
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (
            f"{path} is writable by other users without the sticky bit "
            f"(mode {stat.filemode(st.st_mode)}): anyone could replace the folders in it"
        )
    return None


def parents_of(root: str) -> list[str]:
    """The existing folders above `root` (its real path), nearest first."""
    real = Path(os.path.realpath(root))
    return [str(p) for p in real.parents if p.exists()]


def check_trusted(paths: list[str], *, root: str | None = None) -> None:
    """Refuse local checkpoint paths not owned by this user or writable by others, and
    (with `root`) a root in a folder others can write without the sticky bit.

    DCP's `.metadata` is a pickle; even with the restricted reader, a folder someone else can
    write could swap the weights. The user fixes it with chown/chmod o-w, or copies the
    checkpoint into a folder of their own.
    """
    uid = os.getuid()
    problems = [trust_problem(path, os.stat(path), uid) for path in paths]
    if root is not None:
        problems += [parent_problem(p, os.stat(p)) for p in parents_of(root)]
    for problem in problems:
        if problem is not None:
            raise UnsafeCheckpointError(
                f"refusing checkpoint: {problem}; copy it to a folder you own or chmod o-w"
            )
