"""What every source kind shares: the listed records (`SampleRef`, `Source`), how to read
a source (`ListOptions`), the error of one unreadable record, and the helpers to list files
and read their bytes.

Listing a source gives `SampleRef`s in a stable order (the order keys are derived from);
reading one gives its tar members. Listing runs once in the main process; reading runs in the
shard writers (possibly other processes), so refs are small picklable records.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.convert.errors import ConvertError
from hpctrain.data.index import redact_url


class SourceRecordError(Exception):
    """A record of a source (a file, a manifest row, a shard member) that cannot be read or is
    not an image: its sample is skipped under `--on-error skip`, the conversion stops under
    `fail`. (A sample the loader cannot decode is `hpctrain.data.decode.SampleError`.)"""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{redact_url(url)}: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class FieldRef:
    """One member of a sample besides the legacy image/label/meta: a file to copy, or bytes.

    Attributes:
        name: the field name (the member is `KEY.<name>`).
        url: the file whose bytes become the member, or "" when `data` is the member.
        data: the member's bytes when `url` is "".
        size: bytes of the member as planned (the file's size when known).
        column: the manifest column it comes from (named in errors).
    """

    name: str
    url: str = ""
    data: bytes = b""
    size: int = 0
    column: str = ""


@dataclass(frozen=True)
class SampleRef:
    """One sample to write.

    Attributes:
        key: the sample key in the output shard (stable: derived from the source order).
        url: the image file (image folders, a manifest's path column); for re-sharding and
            generated sources the tar holding the sample's members; "" when neither.
        size: estimated bytes of the sample's `url` image or members (plans `--shard-size`).
        label: integer label (`.cls` member), or None for no label.
        meta: JSON text of the `.json` member, or None.
        members: re-sharding and generated sources: (field, data offset, size) of each member
            in `url`.
        fields: manifests: the members of the other columns, in column order.
        origin: what names the sample in messages ("list.csv row 3", "pkg.mod:fn sample 7");
            "" when `url` names it.
        error: why the sample cannot be written, found while listing (a bad value in a row):
            raised when the sample is written, so that `--on-error` decides, as for a bad file.
        source: the file the sample comes from, as the user knows it (the path under an
            image folder, a manifest's path column): written as `KEY.__source__`
            (`hpctrain.data.fieldnames.SOURCE_FIELD`); "" writes none.
    """

    key: str
    url: str
    size: int
    label: int | None = None
    meta: str | None = None
    members: tuple[tuple[str, int, int], ...] = ()
    fields: tuple[FieldRef, ...] = ()
    origin: str = ""
    error: str = ""
    source: str = ""


@dataclass(frozen=True)
class Source:
    """A listed source: its samples in source order, and class names when known."""

    kind: str  # "folder" | "images" | "manifest" | "shards" | "python" | "arrow"
    samples: tuple[SampleRef, ...]
    class_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class ListOptions:
    """How to read a source (see `hpctrain convert --help`).

    Attributes:
        path_column: manifests: the column of the (legacy) image path.
        label_column: manifests: the column of the label (class names or integers).
        columns: Arrow/parquet: (column, field) renames; field "" leaves the column out.
        args: Python sources: keyword arguments of the callable, as `k=v` text pairs.
        spool_dir: a local folder where generated sources (Python, Arrow) spool their
            encoded samples; deleted with the conversion.
    """

    path_column: str = "path"
    label_column: str = "label"
    columns: tuple[tuple[str, str], ...] = ()
    args: tuple[tuple[str, str], ...] = ()
    spool_dir: str = ""


def sample_key(position: int) -> str:
    """Key of the sample at `position` in source order: fixed width, so keys sort like positions."""
    return f"{position:09d}"


def unsafe_key(key: str) -> bool:
    """A key whose members would land outside the folder a shard is extracted into (a part
    that is `..`, `.` or empty, an absolute path, a backslash), or that reads back differently."""
    return key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in key.split("/"))


def fs_and_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _local_files(root: str) -> dict[str, int]:
    """path -> size of every file under the local folder `root`, symlinked folders followed.

    A folder that leads back to one above it (a symlink loop) is an error naming it: walking
    it would never end. A symlink to nothing is kept as a file (reading it fails, by name).
    """
    files: dict[str, int] = {}
    start = os.stat(root)
    stack = [(root, frozenset({(start.st_dev, start.st_ino)}))]
    while stack:
        folder, above = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as exc:
            raise ConvertError(f"{folder}: cannot list: {exc.strerror or exc}") from None
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symlinks
                info = entry.stat() if is_dir or not entry.is_symlink() else os.stat(entry.path)
            except OSError:  # a dangling symlink
                files[entry.path] = 0
                continue
            if not is_dir:
                files[entry.path] = info.st_size
                continue
            identity = (info.st_dev, info.st_ino)
            if identity in above:
                raise ConvertError(
                    f"{entry.path}: a symlink loop (it leads back to {os.path.realpath(entry.path)}, "
                    "a folder above it)"
                )
            stack.append((entry.path, above | {identity}))
    return files


def find_files(src: str) -> dict[str, int]:
    """path -> size of every file under the folder `src` (recursively; folder symlinks followed)."""
    fs, root = fs_and_path(src)
    root = root.rstrip("/") or "/"
    if isinstance(fs, LocalFileSystem):
        return _local_files(root)
    found = fs.find(root, detail=True)
    return {
        path: int(info.get("size") or 0)
        for path, info in found.items()
        if info["type"] != "directory"
    }


# --- reading ---------------------------------------------------------------------------------

# Leading bytes of the formats PIL reads that image datasets use, with their member extension.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"P6", "ppm"),
    (b"P5", "pgm"),
    (b"P4", "pbm"),
)


def image_extension(data: bytes) -> str | None:
    """The member extension for image bytes, from their signature; None when not an image.

    A signature check, not a decode: copying stays as fast as a plain tar writer. Truncated or
    corrupt image bodies are caught by `hpctrain inspect --verify`, which decodes everything.
    """
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    try:  # a rarer format PIL knows (JPEG 2000, ICO, ...)
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            return (image.format or "").lower() or None
    except Exception:
        return None


def read_url(url: str) -> bytes:
    """All bytes of a file or URL (local paths bypass fsspec, which costs more than the read's
    own syscalls: BENCHMARKS.md, "Figures behind the code")."""
    if "://" not in url:
        with open(url, "rb") as f:
            return f.read()
    with fsspec.open(url, "rb") as f:
        return f.read()


class ShardReader:
    """Reads members of re-sharded samples, keeping the last shard open (samples come in runs)."""

    def __init__(self) -> None:
        self._url: str | None = None
        self._file: Any = None

    def read(self, url: str, offset: int, size: int) -> bytes:
        if url != self._url:
            self.close()
            self._file = fsspec.open(url, "rb").open()
            self._url = url
        self._file.seek(offset)
        data = self._file.read(size)
        if len(data) != size:
            raise SourceRecordError(url, f"truncated member at offset {offset}")
        return bytes(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._url = None
