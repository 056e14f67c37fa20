"""Writing one shard: read its planned samples, write the tar, commit it under its final name.

`write_shard` is what a worker process runs. It depends only on its `ShardTask`, so any number
of workers, in any order, produce the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.convert.errors import ConvertError
from hpctrain.convert.fields import IMAGE_EXTENSIONS, is_target_field, last_extension
from hpctrain.convert.sources.base import (
    FieldRef,
    SampleRef,
    ShardReader,
    SourceRecordError,
    image_extension,
    read_url,
)
from hpctrain.convert.tar import ShardTarWriter
from hpctrain.data.fieldnames import SOURCE_FIELD
from hpctrain.data.index import redact_url
from hpctrain.files import TEMP_MARKER


@dataclass(frozen=True)
class EncodeOptions:
    """Optional re-encoding.

    `max_side` alone: images whose longer side exceeds it are downscaled and re-encoded as
    JPEG (quality 90); smaller ones keep their original bytes. `quality` (with or without
    `max_side`): every image is re-encoded as JPEG at that quality.
    """

    max_side: int | None = None
    quality: int | None = None

    @property
    def active(self) -> bool:
        return self.max_side is not None or self.quality is not None


@dataclass(frozen=True)
class ShardTask:
    url: str  # final URL or path of the shard
    samples: tuple[SampleRef, ...]
    encode: EncodeOptions
    on_error: str  # "fail" | "skip"


@dataclass(frozen=True)
class ShardResult:
    url: str
    num_samples: int
    num_bytes: int
    sha256: str
    skipped: tuple[tuple[str, str], ...]  # (source URL, reason)


def reencode(data: bytes, encode: EncodeOptions, url: str) -> tuple[bytes, str] | None:
    """JPEG bytes of the resized image, or None when the original bytes should be kept."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            too_big = encode.max_side is not None and max(image.size) > encode.max_side
            if not too_big and encode.quality is None:
                return None
            if too_big and encode.max_side is not None:
                # draft() lets libjpeg decode at 1/2, 1/4 or 1/8 scale: most of the resize for free.
                image.draft("RGB", (encode.max_side, encode.max_side))
            converted = image.convert("RGB") if image.mode not in ("RGB", "L") else image
            if too_big and encode.max_side is not None:
                scale = encode.max_side / max(converted.size)
                size = (
                    max(1, round(converted.width * scale)),
                    max(1, round(converted.height * scale)),
                )
                converted = converted.resize(size, Image.Resampling.BICUBIC, reducing_gap=None)
            out = io.BytesIO()
            converted.save(out, format="JPEG", quality=encode.quality or 90)
    except Exception as exc:  # PIL raises many types for bad data
        raise SourceRecordError(url, f"cannot decode image: {exc}") from None
    return out.getvalue(), "jpg"


def _reencoded(data: bytes, field: str, encode: EncodeOptions, where: str) -> tuple[bytes, str]:
    """`--max-side/--quality` on one image member: (bytes, field name), maybe unchanged.

    Target fields (`mask`, `seg`, `label`, `depth` in the name) are never re-encoded: JPEG
    would change their values (class ids, depths).
    """
    if not encode.active or is_target_field(field):
        return data, field
    new = reencode(data, encode, where)
    if new is None:
        return data, field
    stem = field.rsplit(".", 1)[0] if "." in field else ""
    return new[0], f"{stem}.jpg" if stem else "jpg"


def _copied_members(
    sample: SampleRef, reader: ShardReader, encode: EncodeOptions
) -> list[tuple[str, bytes]]:
    """Members of a sample stored in a tar (re-sharding, generated sources), in their order."""
    members = []
    for field, offset, size in sample.members:
        data = reader.read(sample.url, offset, size)
        if last_extension(field) in IMAGE_EXTENSIONS:
            where = sample.origin or f"{sample.url}#{sample.key}.{field}"
            if image_extension(data) is None:
                raise SourceRecordError(where, f"{field}: not an image")
            data, field = _reencoded(data, field, encode, where)
        members.append((f"{sample.key}.{field}", data))
    return members


def _read_field(sample: SampleRef, field: FieldRef) -> bytes:
    try:
        return read_url(field.url)
    except OSError as exc:
        raise SourceRecordError(
            field.url,
            f"{sample.origin}, column {field.column!r}: cannot read: {exc.strerror or exc}",
        ) from None


def sample_members(
    sample: SampleRef, reader: ShardReader, encode: EncodeOptions
) -> list[tuple[str, bytes]]:
    """The (member name, bytes) of one sample, in the order they are written.

    Order: the image of `url`, `cls`, the other fields in column order, `json`, the source
    path (`__source__`).
    """
    if sample.error:
        raise SourceRecordError(sample.origin or sample.url, sample.error)
    if sample.members:
        return _copied_members(sample, reader, encode)
    members = []
    if sample.url:
        where = f"{sample.origin}, column 'path': " if sample.origin else ""
        try:
            data = read_url(sample.url)
        except OSError as exc:
            raise SourceRecordError(
                sample.url, f"{where}cannot read: {exc.strerror or exc}"
            ) from None
        detected = image_extension(data)
        if detected is None:
            raise SourceRecordError(sample.url, f"{where}not an image")
        data, ext = _reencoded(data, detected, encode, sample.url)
        members.append((f"{sample.key}.{ext}", data))
    if sample.label is not None:
        members.append((f"{sample.key}.cls", str(sample.label).encode()))
    for field in sample.fields:
        if not field.url:
            members.append((f"{sample.key}.{field.name}", field.data))
            continue
        data = _read_field(sample, field)
        name = field.name
        if last_extension(name) in IMAGE_EXTENSIONS:
            if image_extension(data) is None:
                raise SourceRecordError(
                    field.url, f"{sample.origin}, column {field.column!r}: not an image"
                )
            data, name = _reencoded(data, name, encode, field.url)
        members.append((f"{sample.key}.{name}", data))
    if sample.meta is not None:
        members.append((f"{sample.key}.json", sample.meta.encode()))
    if sample.source:
        members.append((f"{sample.key}.{SOURCE_FIELD}", sample.source.encode()))
    return members


def is_local(url: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(url)
    return isinstance(fs, LocalFileSystem)


class ShardOutput:
    """A shard's output file that only shows up under its final name once committed.

    Local files: written to a hidden temporary name in the same folder, fsynced, renamed.
    Other filesystems: spooled to a local temporary file, then uploaded in one `put_file`
    (a single PUT or a completed multipart upload on object stores). Streaming through
    `fs.open(..., "wb")` is not safe everywhere: memory:// publishes the file when it is
    opened, and a discarded s3fs file still tries to flush when garbage-collected.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.path = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.file: Any
        if self.local:
            folder, name = os.path.split(self.path)
            os.makedirs(folder, exist_ok=True)
            self.temp = os.path.join(folder, f".{name}{TEMP_MARKER}{os.getpid()}")
            self.file = open(self.temp, "wb", buffering=1 << 20)  # noqa: SIM115 (committed below)
        else:
            self.temp = ""
            self.file = tempfile.NamedTemporaryFile(prefix="hpctrain-shard-", suffix=".tar")  # noqa: SIM115

    def commit(self) -> None:
        if self.local:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temp, self.path)
        else:
            self.file.flush()
            self.fs.put_file(self.file.name, self.path)
            self.file.close()  # deletes the spool file

    def discard(self) -> None:
        # Closing flushes what is buffered, which fails again on a full disk: the temporary
        # file goes all the same (left, it would keep the disk full).
        with contextlib.suppress(OSError):
            self.file.close()
        if self.local:
            with contextlib.suppress(OSError):
                os.unlink(self.temp)

    def failed(self, exc: OSError) -> ConvertError:
        """The one-line error of a write to this shard that failed (a full disk, a quota)."""
        return ConvertError(
            f"{redact_url(self.url)}: cannot write the shard: {exc.strerror or exc}"
        )


def write_shard(task: ShardTask, on_sample: Callable[[], Any] | None = None) -> ShardResult:
    """Write one shard (see module doc). Raises `ConvertError` on a bad sample under `fail`."""
    output = ShardOutput(task.url)
    reader = ShardReader()
    skipped: list[tuple[str, str]] = []
    num_samples = 0
    try:
        writer = ShardTarWriter(output.file)
        for sample in task.samples:
            try:
                members = sample_members(sample, reader, task.encode)
            except SourceRecordError as exc:
                if task.on_error == "fail":
                    raise ConvertError(
                        f"{exc} (use --on-error skip to skip and list such samples)"
                    ) from None
                skipped.append((exc.url, exc.reason))
                members = []
            for name, data in members:
                writer.add(name, data)
            num_samples += bool(members)
            if on_sample is not None:
                on_sample()
        sha256 = writer.finish()
        if num_samples == 0:  # every sample skipped: no empty shard in the index
            output.discard()
        else:
            output.commit()
    except OSError as exc:
        output.discard()
        raise output.failed(exc) from None
    except BaseException:
        output.discard()
        raise
    finally:
        reader.close()
    return ShardResult(task.url, num_samples, writer.num_bytes, sha256, tuple(skipped))


def scan_committed_shard(task: ShardTask) -> ShardResult:
    """Describe a shard an interrupted run already committed (for `--resume`)."""
    import hashlib

    try:
        with fsspec.open(task.url, "rb") as f:
            data = f.read()
        keys = set()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                name = posixpath.basename(member.name)
                if member.isreg() and "." in name:
                    keys.add(member.name[: len(member.name) - len(name) + name.index(".")])
    except (OSError, tarfile.TarError) as exc:
        raise ConvertError(
            f"{redact_url(task.url)}: cannot read a committed shard to resume: {exc}"
        ) from None
    skipped = tuple(
        (s.url, "skipped by the interrupted run") for s in task.samples if s.key not in keys
    )
    if len(keys) + len(skipped) != len(task.samples):
        raise ConvertError(
            f"{redact_url(task.url)}: holds samples this plan does not put there; rerun without --resume"
        )
    return ShardResult(task.url, len(keys), len(data), hashlib.sha256(data).hexdigest(), skipped)
