"""Where samples come from: image folders and existing shards here; manifests, Python
sources and Arrow/parquet in their own modules (`list_source` picks by `detect_kind`).

Listing a source gives `SampleRef`s in a stable order (the order keys are derived from);
reading one gives its tar members. Listing runs once in the main process; reading runs in the
shard writers (possibly other processes), so refs are small picklable records.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.data.index import INDEX_NAME, read_index, redact_url
from hpctrain.errors import DataError, UsageError


class ConvertError(DataError, ValueError):
    """A user-facing conversion error (names the file or URL, never a credential)."""


class ConvertOptionError(ConvertError, UsageError):
    """A bad `hpctrain convert` option: a command-line mistake (exit code 2), not bad data."""

    exit_code = UsageError.exit_code
    label = UsageError.label


class SampleError(Exception):
    """One sample cannot be read or is not an image (skipped under `--on-error skip`)."""

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


@dataclass(frozen=True)
class Source:
    """A listed source: its samples in source order, and class names when known."""

    kind: str  # "folder" | "manifest" | "shards" | "python" | "arrow"
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


def _fs_and_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


# `package.module:callable`: a Python source. Only ever matched against SRC as the user typed it
# on the command line: nothing read from an index or a manifest is imported.
_CALLABLE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
KINDS = ("folder", "manifest", "shards", "python", "arrow")


def is_python_spec(src: str) -> bool:
    """SRC names a Python callable (`pkg.module:function`), not a path."""
    return bool(_CALLABLE.fullmatch(src)) and not os.path.exists(src)


def detect_kind(src: str) -> str:
    """Guess the source kind from the URL and what is there."""
    lowered = src.lower().split("?", 1)[0]
    if lowered.endswith((".csv", ".jsonl", ".ndjson")):
        return "manifest"
    if lowered.endswith((".parquet", ".arrow")):
        return "arrow"
    if lowered.endswith(".tar") or "{" in src or lowered.endswith(INDEX_NAME):
        return "shards"
    if is_python_spec(src):
        return "python"
    fs, path = _fs_and_path(src)
    if not fs.isdir(path):
        if fs.exists(path):
            raise ConvertError(
                f"{redact_url(src)}: not a folder, manifest (.csv/.jsonl), parquet/arrow file "
                "or shard (.tar)"
            )
        raise ConvertError(f"{redact_url(src)}: source not found")
    if fs.exists(posixpath.join(path, INDEX_NAME)):
        return "shards"
    if fs.exists(posixpath.join(path, "train", INDEX_NAME)):
        raise ConvertError(
            f"{redact_url(src)}: holds train/ and val/ shard sets; convert one: {redact_url(src)}/train"
        )
    entries = fs.ls(path, detail=True)
    names = {posixpath.basename(e["name"].rstrip("/")) for e in entries}
    if names & {"state.json", "dataset_dict.json"} or any(
        n.endswith((".arrow", ".parquet")) for n in names
    ):
        return "arrow"
    has_dirs = any(
        e["type"] == "directory" or (e.get("islink") and os.path.isdir(e["name"])) for e in entries
    )
    has_tars = any(e["name"].endswith(".tar") for e in entries)
    return "shards" if has_tars and not has_dirs else "folder"


def list_source(src: str, kind: str = "auto", options: ListOptions | None = None) -> Source:
    """List the samples of `src` (see module doc) in source order."""
    options = options or ListOptions()
    if kind == "auto":
        kind = detect_kind(src)
    if kind == "folder":
        return list_image_folder(src)
    if kind == "manifest":
        from hpctrain.convert.manifest import list_manifest

        return list_manifest(
            src, path_column=options.path_column, label_column=options.label_column
        )
    if kind == "shards":
        return list_shards(src)
    if kind == "python":
        from hpctrain.convert.generated import list_python

        return list_python(src, options.args, options.spool_dir)
    if kind == "arrow":
        from hpctrain.convert.arrow import list_arrow

        return list_arrow(src, options.columns, options.spool_dir, options.label_column)
    raise ConvertOptionError(f"unknown source kind {kind!r} ({', '.join(KINDS)})")


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
    fs, root = _fs_and_path(src)
    root = root.rstrip("/") or "/"
    if isinstance(fs, LocalFileSystem):
        return _local_files(root)
    found = fs.find(root, detail=True)
    return {
        path: int(info.get("size") or 0)
        for path, info in found.items()
        if info["type"] != "directory"
    }


def list_image_folder(src: str) -> Source:
    """`src/<class>/**/<file>`: classes sorted by name give labels 0..C-1 (as torchvision's ImageFolder).

    Files are sorted by path within a class; hidden files (".name") and files directly in
    `src` are ignored. Files that are not images are kept here and rejected when read, so
    `--on-error` decides what happens to them.
    """
    fs, root = _fs_and_path(src)
    if not fs.isdir(root):
        raise ConvertError(f"{redact_url(src)}: source folder not found")
    root = root.rstrip("/")
    local = isinstance(fs, LocalFileSystem)
    class_dirs = sorted(
        posixpath.basename(e["name"].rstrip("/"))
        for e in fs.ls(root, detail=True)
        # a symlinked class folder (e.g. $SCRATCH -> $STORE) is a class folder
        if (e["type"] == "directory" or (local and e.get("islink") and os.path.isdir(e["name"])))
        and not posixpath.basename(e["name"].rstrip("/")).startswith(".")
    )
    if not class_dirs:
        raise ConvertError(f"{redact_url(src)}: no class folders (expected SRC/<class>/<image>)")
    samples: list[SampleRef] = []
    for label, name in enumerate(class_dirs):
        found = find_files(full_url(fs, posixpath.join(root, name)))
        for path in sorted(found):
            if posixpath.basename(path).startswith("."):
                continue
            samples.append(
                SampleRef(
                    key=sample_key(len(samples)),
                    url=full_url(fs, path),
                    size=found[path],
                    label=label,
                )
            )
    if not samples:
        raise ConvertError(f"{redact_url(src)}: no files under the class folders")
    return Source("folder", tuple(samples), tuple(class_dirs))


def _split_member_name(name: str) -> tuple[str | None, str]:
    """(key, extension) as webdataset splits a member name: at the first dot of the basename."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return None, ""
    return name[:dot], name[dot + 1 :]


def shard_urls(src: str) -> tuple[list[str], tuple[str, ...]]:
    """Shard URLs of a shard source (index, folder of .tar, brace pattern or one .tar), and class names."""
    import braceexpand  # a webdataset dependency; imported here so listing folders does not need it

    fs, path = _fs_and_path(src)
    if src.endswith(INDEX_NAME) or (fs.isdir(path) and fs.exists(posixpath.join(path, INDEX_NAME))):
        index_url = src if src.endswith(INDEX_NAME) else src.rstrip("/") + "/" + INDEX_NAME
        index = read_index(index_url)
        return [index.shard_url(i) for i in range(len(index.shards))], index.class_names
    if "{" in src:
        return list(braceexpand.braceexpand(src)), ()
    if fs.isdir(path):
        tars = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".tar"))
        if not tars:
            raise ConvertError(f"{redact_url(src)}: no .tar shards")
        return [full_url(fs, p) for p in tars], ()
    return [src], ()


def list_shards(src: str) -> Source:
    """Samples of existing WebDataset shards (for re-sharding), keys kept, members located by offset."""
    urls, class_names = shard_urls(src)
    samples: list[SampleRef] = []
    for url in urls:
        try:
            with fsspec.open(url, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                members = [(m.name, m.offset_data, m.size) for m in tar if m.isreg()]
        except FileNotFoundError:
            raise ConvertError(f"{redact_url(url)}: shard not found") from None
        except tarfile.TarError as exc:
            raise ConvertError(f"{redact_url(url)}: not a readable tar: {exc}") from None
        current: str | None = None
        group: list[tuple[str, int, int]] = []
        for name, offset, size in [*members, (None, 0, 0)]:
            key, ext = _split_member_name(name) if name is not None else (None, "")
            if name is not None and key is None:
                continue
            if key != current or name is None:
                if current is not None and group:
                    if unsafe_key(current.removeprefix("./")):
                        raise ConvertError(
                            f"{redact_url(url)}: key {current!r} has a '..', '.' or empty part "
                            "or is absolute: its members would lie outside the folder"
                        )
                    samples.append(
                        SampleRef(
                            key=current.removeprefix("./"),
                            url=url,
                            size=sum(s + 512 for _, _, s in group),
                            members=tuple(group),
                        )
                    )
                current, group = key, []
            if name is not None:
                group.append((ext.lower(), offset, size))
    if not samples:
        raise ConvertError(f"{redact_url(src)}: no samples in the shards")
    return Source("shards", tuple(samples), class_names)


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
            raise SampleError(url, f"truncated member at offset {offset}")
        return bytes(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._url = None
