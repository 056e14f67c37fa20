"""Text sources of the token pipeline (`text.py`): their documents, in source order, cut into
chunks that worker processes tokenize (`tokenize.py`).

Sources (SRC):

- a folder of text files: every file under it (recursively, hidden names left out) whose name
  matches `--text-glob` (default `*.txt`), in sorted path order; one text file;
- a `.jsonl`, `.csv` or `.parquet` file: the column `--text-field` (default `text`) of each row;
- an existing token index (`index.json`, or a folder holding one): its documents (the ids
  between end-of-document ids) are re-packed with their ids kept; `--tokenizer` may be left
  out, and a different one is refused.

A document is a whole file, a row, or with `--text-per-line` each non-blank line of a text
file. Its ids are followed by the tokenizer's end-of-document (EOD) id.
"""

from __future__ import annotations

import codecs
import csv
import fnmatch
import io
import json
import posixpath
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.sources.arrow import import_pyarrow
from hpctrain.convert.sources.base import find_files
from hpctrain.data.index import INDEX_NAME, ShardIndex, ShardIndexError, read_index
from hpctrain.data.index import redact_url as _redact
from hpctrain.data.stream import ShardStream
from hpctrain.data.tar import iter_samples
from hpctrain.data.tokens import TOKEN_FIELDS, decode_tokens

# Work per tokenize task: large enough that a task's overhead is small, small enough that
# several tasks keep every worker busy and a task's spool stays modest.
CHUNK_BYTES = 4 << 20
CHUNK_FILES = 1024
TEXT_SUFFIXES = (".jsonl", ".csv", ".parquet")


def source_index(src: str) -> ShardIndex | None:
    """The index SRC names (`*.json`, or a folder holding `index.json`), or None."""
    url = src
    if not src.endswith(".json"):
        try:
            fs, path = fsspec.core.url_to_fs(src)
            if not fs.isdir(path) or not fs.exists(posixpath.join(path, INDEX_NAME)):
                return None
        except (OSError, ValueError, ImportError):  # the ordinary source kinds report these
            return None
        url = posixpath.join(src.rstrip("/"), INDEX_NAME)
    try:
        return read_index(url)
    except ShardIndexError:
        return None  # not an index: the source kinds report what it is


@dataclass(frozen=True)
class Chunk:
    """Documents for one worker task: text files, records of a table, or one token shard."""

    number: int
    files: tuple[str, ...] = ()  # text files
    records: tuple[tuple[str, Any], ...] = ()  # (where, str | bytes | None) from a table
    jsonl: bool = False  # records are raw JSONL lines, parsed in the worker
    shard: str = ""  # a token shard's URL (resharding)


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def file_documents(url: str, per_line: bool) -> Iterator[tuple[str, str | None, str]]:
    """(where, text or None, error) of each document of a text file."""
    shown = _redact(url)
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except OSError as exc:
        yield shown, None, f"cannot read: {exc.strerror or exc}"
        return
    data = data.removeprefix(codecs.BOM_UTF8)  # a byte-order mark is not text
    if not per_line:
        try:
            yield shown, data.decode("utf-8"), ""
        except UnicodeDecodeError as exc:
            yield f"{shown}:{_line_of(data, exc.start)}", None, "not valid UTF-8"
        return
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{shown}:{number}", line.removesuffix(b"\r").decode("utf-8"), ""
        except UnicodeDecodeError:
            yield f"{shown}:{number}", None, "not valid UTF-8"


def record_text(where: str, value: Any, text_field: str, jsonl: bool) -> tuple[str | None, str]:
    """(text or None, error) of one table record (`text_field`: the JSONL field of the text)."""
    if jsonl:
        try:
            row = json.loads(value.decode("utf-8"))
        except UnicodeDecodeError:
            return None, "not valid UTF-8"
        except ValueError as exc:
            return None, f"not valid JSON: {exc}"
        if not isinstance(row, dict) or text_field not in row:
            return None, f"no field {text_field!r} (--text-field)"
        value = row[text_field]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not valid UTF-8"
    if not isinstance(value, str):
        return None, f"field {text_field!r} is {type(value).__name__}, not text"
    return value, ""


def shard_documents(
    url: str, vocab_size: int, eod_id: int
) -> Iterator[tuple[str, np.ndarray | None, str]]:
    """(where, ids with EOD or None, error) of each document of a token shard."""
    stream = ShardStream(url)
    try:
        for _, key, members in iter_samples(stream):
            where = f"{_redact(url)}#{key}"
            fields = [name for name in members if name in TOKEN_FIELDS]
            if len(fields) != 1 or len(members) != 1:
                yield where, None, f"not a token sample (members {', '.join(sorted(members))})"
                continue
            try:
                ids = decode_tokens(members[fields[0]], fields[0]).astype(np.int64)
            except ValueError as exc:
                yield where, None, str(exc)
                continue
            if ids.size and int(ids.max()) >= vocab_size:
                yield where, None, f"id {int(ids.max())} >= vocab_size {vocab_size}"
                continue
            if not ids.size or ids[-1] != eod_id:
                yield where, None, f"does not end with the end-of-document id {eod_id}"
                continue
            ends = np.flatnonzero(ids == eod_id) + 1
            for start, end in zip(np.concatenate(([0], ends[:-1])), ends, strict=True):
                yield where, ids[start:end], ""
    finally:
        stream.close()


def text_files(src: str, pattern: str) -> list[tuple[str, int]]:
    """(URL, size) of the text files of SRC (a folder: recursive, sorted; or one file)."""
    fs, path = fsspec.core.url_to_fs(src)
    shown = _redact(src)
    if not fs.exists(path):
        raise ConvertError(f"{shown}: source not found")
    if not fs.isdir(path):
        return [(src, int(fs.size(path) or 0))]
    base = path.rstrip("/")
    found = []
    for name, size in sorted(find_files(src).items()):
        relative = name[len(base) :].lstrip("/")
        if any(part.startswith(".") for part in relative.split("/")):
            continue
        if fnmatch.fnmatchcase(posixpath.basename(name), pattern):
            found.append((posixpath.join(src.rstrip("/"), relative), size))
    if not found:
        raise ConvertError(f"{shown}: no files named like {pattern!r} (--text-glob)")
    return found


def _file_chunks(files: list[tuple[str, int]]) -> Iterator[Chunk]:
    batch: list[str] = []
    size = 0
    number = 0
    for url, n in files:
        if batch and (size + n > CHUNK_BYTES or len(batch) >= CHUNK_FILES):
            yield Chunk(number, files=tuple(batch))
            number, batch, size = number + 1, [], 0
        batch.append(url)
        size += n
    if batch:
        yield Chunk(number, files=tuple(batch))


def _record_chunks(records: Iterable[tuple[str, Any]], jsonl: bool = False) -> Iterator[Chunk]:
    batch: list[tuple[str, Any]] = []
    size = 0
    number = 0
    for where, value in records:
        batch.append((where, value))
        size += len(value) if isinstance(value, (str, bytes)) else 8
        if size >= CHUNK_BYTES:
            yield Chunk(number, records=tuple(batch), jsonl=jsonl)
            number, batch, size = number + 1, [], 0
    if batch:
        yield Chunk(number, records=tuple(batch), jsonl=jsonl)


def _jsonl_records(src: str) -> Iterator[tuple[str, bytes]]:
    shown = _redact(src)
    with fsspec.open(src, "rb") as f:
        for number, line in enumerate(f, 1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield f"{shown}:{number}", line


def _csv_records(src: str, field: str) -> Iterator[tuple[str, str]]:
    shown = _redact(src)
    # A document is one cell: lift the csv module's 128 KiB cell limit.
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with fsspec.open(src, "rb") as f:
        # surrogateescape keeps undecodable bytes as lone surrogates: the worker reports them
        # per row instead of the whole file failing to decode.
        text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.DictReader(text)
        if reader.fieldnames is None or field not in reader.fieldnames:
            raise ConvertOptionError(
                f"{shown}: no column {field!r} (--text-field); columns: "
                f"{', '.join(reader.fieldnames or [])}"
            )
        for row in reader:
            yield f"{shown}:{reader.line_num}", row[field]


def _parquet_records(src: str, field: str) -> Iterator[tuple[str, Any]]:
    pa = import_pyarrow()
    shown = _redact(src)
    with fsspec.open(src, "rb") as f:
        try:
            parquet = pa.parquet.ParquetFile(f)
            if field not in parquet.schema_arrow.names:
                raise ConvertOptionError(
                    f"{shown}: no column {field!r} (--text-field); columns: "
                    f"{', '.join(parquet.schema_arrow.names)}"
                )
            row = 0
            for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    yield f"{shown} row {row}", value
        except pa.ArrowException as exc:
            raise ConvertError(f"{shown}: not readable as parquet: {exc}") from None


def document_chunks(
    src: str, index: ShardIndex | None, *, text_field: str, text_glob: str, per_line: bool
) -> Iterator[Chunk]:
    """The documents of `src` (`index`: the token index it names) in source order, cut into
    tokenize tasks (`--text-field`, `--text-glob`, `--text-per-line`)."""
    if index is not None:
        for i in range(len(index.shards)):
            yield Chunk(i, shard=index.shard_url(i))
        return
    lowered = src.split("?", 1)[0].lower()
    if lowered.endswith(TEXT_SUFFIXES) and per_line:
        raise ConvertOptionError(
            "--text-per-line applies to text files; a .jsonl/.csv/.parquet row is a document"
        )
    if lowered.endswith(".jsonl"):
        yield from _record_chunks(_jsonl_records(src), jsonl=True)
    elif lowered.endswith(".csv"):
        yield from _record_chunks(_csv_records(src, text_field))
    elif lowered.endswith(".parquet"):
        yield from _record_chunks(_parquet_records(src, text_field))
    else:
        yield from _file_chunks(text_files(src, text_glob))
