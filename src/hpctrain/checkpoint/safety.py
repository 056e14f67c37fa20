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

Local checkpoint folders are further trusted only when the user owns them and others cannot
write them (`check_trusted`). Many projects switch weights-only loading off again after torch
2.6 made it the default; hpctrain never does.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hpctrain.errors import CheckpointFailure


class CheckpointError(CheckpointFailure, ValueError):
    """A checkpoint cannot be used: missing, damaged, untrusted or unsafe."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code or comes from a folder others may write."""


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
    return metadata


def _read_metadata_safely(reader: FileSystemReader, rank: int | None) -> Metadata:
    path = reader._get_metadata_path(rank)
    with reader.fs.create_stream(path, "rb") as stream:
        data = stream.read()
    metadata = load_metadata_bytes(data, os.fspath(path))
    # Same post-processing as FileSystemReader.read_metadata.
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    assert metadata.storage_meta is not None
    metadata.storage_meta.load_id = reader.load_id
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that reads `.metadata` through `RestrictedUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata_safely(self, kwargs.get("rank"))


class SafeFsspecReader(FsspecReader):
    """`FsspecReader` that reads `.metadata` through `RestrictedUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata_safely(self, kwargs.get("rank"))


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


def check_trusted(paths: list[str]) -> None:
    """Refuse local checkpoint paths not owned by this user or writable by others.

    DCP's `.metadata` is a pickle; even with the restricted reader, a folder someone else can
    write could swap the weights. The user fixes it with chown/chmod o-w, or copies the
    checkpoint into a folder of their own.
    """
    uid = os.getuid()
    for path in paths:
        problem = trust_problem(path, os.stat(path), uid)
        if problem is not None:
            raise UnsafeCheckpointError(
                f"refusing checkpoint: {problem}; copy it to a folder you own or chmod o-w"
            )
