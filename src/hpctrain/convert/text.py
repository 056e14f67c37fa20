"""Text -> token shards for language models (`hpctrain convert SRC DEST --tokenizer bytes|PATH`).

Sources (SRC):

- a folder of text files: every file under it (recursively, hidden names left out) whose name
  matches `--text-glob` (default `*.txt`), in sorted path order; one text file;
- a `.jsonl`, `.csv` or `.parquet` file: the column `--text-field` (default `text`) of each row;
- an existing token index (`index.json`, or a folder holding one): its documents (the ids
  between end-of-document ids) are re-packed with their ids kept; `--tokenizer` may be left
  out, and a different one is refused.

A document is a whole file, a row, or with `--text-per-line` each non-blank line of a text
file. Its ids are followed by the tokenizer's end-of-document (EOD) id.

Sample layout: documents, in order, are appended to a sample while it holds at most
`--sample-tokens` ids (default 8192, EODs included); the document that would push it past is
the first of the next sample, and a document longer than that is a sample of its own. So
short lines share one tar member instead of costing a 512-byte header and padding each, and a
sample holds whole documents only. Each sample has one member, `tokens.u16` (vocabularies of
at most 65536 ids) or `tokens.u32` (`hpctrain.data.tokens`). Shards are cut from the samples by
`--samples-per-shard` or `--shard-size` (bytes, default 256MB), as in every conversion.

Steps: (1) the source is cut into chunks of documents that worker processes tokenize
(`--workers`) into a temporary spool, in any order; (2) the main process then splits the
documents (`--val-fraction`: a seeded choice of round(F*n) documents), orders them
(`--shuffle`), packs samples and shards and writes them. Only step 1 depends on the workers,
and its results are put back in source order, so the output is byte-identical for any
`--workers`. Text that is not valid UTF-8 (and a missing or non-text field) is a document
error naming the file and line (or row): `--on-error fail` stops, `skip` lists it in
`skipped.txt` and leaves the document out.
"""

from __future__ import annotations

import codecs
import csv
import fnmatch
import hashlib
import io
import json
import os
import posixpath
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from hpctrain.convert import instructions, run
from hpctrain.convert.layout import DEFAULT_SHARD_SIZE, plan_fingerprint
from hpctrain.convert.processes import process_pool
from hpctrain.convert.progress import Progress
from hpctrain.convert.sources import ConvertError, ConvertOptionError, find_files, sample_key
from hpctrain.convert.tar import ShardTarWriter, member_num_bytes
from hpctrain.convert.writer import EncodeOptions, ShardOutput, ShardResult, ShardTask
from hpctrain.data.index import (
    INDEX_NAME,
    ShardIndex,
    ShardIndexError,
    ShardInfo,
    index_to_bytes,
    read_index,
)
from hpctrain.data.index import redact_url as _redact
from hpctrain.data.stream import ShardStream, iter_samples
from hpctrain.data.tokenizer import Tokenizer, check_tokenizer, load_tokenizer
from hpctrain.data.tokens import (
    LOSS_MASK_FIELD,
    TOKEN_FIELDS,
    decode_tokens,
    encode_loss_mask,
    encode_tokens,
    token_field,
)

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


def is_text_conversion(options: run.ConvertOptions) -> bool:
    """Text mode: `--tokenizer` given, or SRC is a token index (resharding keeps its ids)."""
    if options.tokenizer:
        return True
    index = source_index(options.src)
    return index is not None and index.tokenizer is not None


# --- step 1: chunks of documents, tokenized in workers ------------------------------------


@dataclass(frozen=True)
class _Chunk:
    """Documents for one worker task: text files, records of a table, or one token shard."""

    number: int
    files: tuple[str, ...] = ()  # text files
    records: tuple[tuple[str, Any], ...] = ()  # (where, str | bytes | None) from a table
    jsonl: bool = False  # records are raw JSONL lines, parsed in the worker
    shard: str = ""  # a token shard's URL (resharding)


@dataclass(frozen=True)
class _Job:
    """What a worker needs besides the chunk (picklable; the tokenizer is loaded once per process)."""

    tokenizer: str
    eod_token: str
    text_field: str
    per_line: bool
    spool_dir: str
    dtype: str  # numpy dtype of the spool (the field's)
    vocab_size: int
    eod_id: int
    records: instructions.RecordFormat | None = None  # instruction data: ids with a loss mask


@dataclass(frozen=True)
class _ChunkResult:
    number: int
    spool: str  # file of the chunk's ids (all documents, EODs included), "" when empty
    lengths: np.ndarray  # ids of each document, its EOD included
    errors: tuple[tuple[str, str], ...]  # (where, reason) of each bad document, in order
    digest: str  # sha256 of the ids and lengths: the plan fingerprint of `--resume`
    targets: np.ndarray | None = None  # instruction data: each document's target tokens


_TOKENIZERS: dict[tuple[str, str], Tokenizer] = {}


def _tokenizer(job: _Job) -> Tokenizer:
    key = (job.tokenizer, job.eod_token)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(job.tokenizer, job.eod_token)
    return _TOKENIZERS[key]


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _file_documents(url: str, per_line: bool) -> Iterator[tuple[str, str | None, str]]:
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


def _record_text(where: str, value: Any, job: _Job, jsonl: bool) -> tuple[str | None, str]:
    """(text or None, error) of one table record."""
    if jsonl:
        try:
            row = json.loads(value.decode("utf-8"))
        except UnicodeDecodeError:
            return None, "not valid UTF-8"
        except ValueError as exc:
            return None, f"not valid JSON: {exc}"
        if not isinstance(row, dict) or job.text_field not in row:
            return None, f"no field {job.text_field!r} (--text-field)"
        value = row[job.text_field]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not valid UTF-8"
    if not isinstance(value, str):
        return None, f"field {job.text_field!r} is {type(value).__name__}, not text"
    return value, ""


def _shard_documents(url: str, job: _Job) -> Iterator[tuple[str, np.ndarray | None, str]]:
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
            if ids.size and int(ids.max()) >= job.vocab_size:
                yield where, None, f"id {int(ids.max())} >= vocab_size {job.vocab_size}"
                continue
            if not ids.size or ids[-1] != job.eod_id:
                yield where, None, f"does not end with the end-of-document id {job.eod_id}"
                continue
            ends = np.flatnonzero(ids == job.eod_id) + 1
            for start, end in zip(np.concatenate(([0], ends[:-1])), ends, strict=True):
                yield where, ids[start:end], ""
    finally:
        stream.close()


def tokenize_chunk(chunk: _Chunk, job: _Job) -> _ChunkResult:
    """Tokenize one chunk into the spool (what a worker runs; depends only on its arguments)."""
    pieces: list[np.ndarray] = []
    masks: list[np.ndarray] = []  # instruction data: each piece's loss mask
    errors: list[tuple[str, str]] = []

    def add_text(where: str, text: str | None, error: str) -> None:
        if text is None:
            errors.append((where, error))
            return
        try:
            ids = _tokenizer(job).encode_array(text)
        except UnicodeEncodeError:  # lone surrogates: CSV bytes that were not UTF-8
            errors.append((where, "not valid UTF-8"))
            return
        if np.any(ids == job.eod_id):  # a model whose ordinary vocabulary holds the EOD's id
            errors.append((where, f"encodes to the end-of-document id {job.eod_id} inside it"))
            return
        pieces.append(np.append(ids, job.eod_id))

    if chunk.shard:
        for where, ids, error in _shard_documents(chunk.shard, job):
            if ids is None:
                errors.append((where, error))
            else:
                pieces.append(ids)
    for url in chunk.files:
        for where, text, error in _file_documents(url, job.per_line):
            add_text(where, text, error)
    for where, value in chunk.records:
        if job.records is not None:
            try:
                ids, mask = instructions.jsonl_document(value, job.records, _tokenizer(job))
            except instructions.RecordError as exc:
                errors.append((where, str(exc)))
                continue
            pieces.append(ids)
            masks.append(mask)
            continue
        text, error = _record_text(where, value, job, chunk.jsonl)
        add_text(where, text, error)
    lengths = np.array([p.size for p in pieces], dtype=np.int64)
    ids = np.concatenate(pieces).astype(job.dtype) if pieces else np.zeros(0, job.dtype)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    digest = hashlib.sha256(ids.tobytes())
    digest.update(lengths.tobytes())
    digest.update(json.dumps(errors).encode())
    if job.records is not None:
        digest.update(np.packbits(mask).tobytes())
    spool = ""
    if ids.size:
        spool = os.path.join(job.spool_dir, f"chunk-{chunk.number:08d}.bin")
        ids.tofile(spool)
        if job.records is not None:
            mask.astype(np.uint8).tofile(spool + ".mask")  # the same layout, a byte per id
    targets = np.array([m.sum() for m in masks], dtype=np.int64) if job.records else None
    return _ChunkResult(chunk.number, spool, lengths, tuple(errors), digest.hexdigest(), targets)


def _text_files(src: str, pattern: str) -> list[tuple[str, int]]:
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


def _file_chunks(files: list[tuple[str, int]]) -> Iterator[_Chunk]:
    batch: list[str] = []
    size = 0
    number = 0
    for url, n in files:
        if batch and (size + n > CHUNK_BYTES or len(batch) >= CHUNK_FILES):
            yield _Chunk(number, files=tuple(batch))
            number, batch, size = number + 1, [], 0
        batch.append(url)
        size += n
    if batch:
        yield _Chunk(number, files=tuple(batch))


def _record_chunks(records: Iterable[tuple[str, Any]], jsonl: bool = False) -> Iterator[_Chunk]:
    batch: list[tuple[str, Any]] = []
    size = 0
    number = 0
    for where, value in records:
        batch.append((where, value))
        size += len(value) if isinstance(value, (str, bytes)) else 8
        if size >= CHUNK_BYTES:
            yield _Chunk(number, records=tuple(batch), jsonl=jsonl)
            number, batch, size = number + 1, [], 0
    if batch:
        yield _Chunk(number, records=tuple(batch), jsonl=jsonl)


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
    from hpctrain.convert.arrow import _pyarrow

    pa = _pyarrow()
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


def _chunks(options: run.ConvertOptions, index: ShardIndex | None) -> Iterator[_Chunk]:
    """The source's documents in source order, cut into tokenize tasks."""
    src = options.src
    if index is not None:
        for i in range(len(index.shards)):
            yield _Chunk(i, shard=index.shard_url(i))
        return
    lowered = src.split("?", 1)[0].lower()
    if lowered.endswith(TEXT_SUFFIXES) and options.text_per_line:
        raise ConvertOptionError(
            "--text-per-line applies to text files; a .jsonl/.csv/.parquet row is a document"
        )
    if lowered.endswith(".jsonl"):
        yield from _record_chunks(_jsonl_records(src), jsonl=True)
    elif lowered.endswith(".csv"):
        yield from _record_chunks(_csv_records(src, options.text_field))
    elif lowered.endswith(".parquet"):
        yield from _record_chunks(_parquet_records(src, options.text_field))
    else:
        yield from _file_chunks(_text_files(src, options.text_glob))


def _ordered_map(
    func: Callable[..., _ChunkResult], items: Iterable[_Chunk], job: _Job, workers: int
) -> Iterator[_ChunkResult]:
    """`func(item, job)` for every item, results in item order; at most 2 x workers in flight
    (a table read in the main process is not held in memory all at once)."""
    if workers == 1:
        for item in items:
            yield func(item, job)
        return
    with process_pool(workers) as pool:
        pending: list[Future[_ChunkResult]] = []
        for item in items:
            pending.append(pool.submit(func, item, job))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


# --- step 2: split, order, pack, write -----------------------------------------------------


@dataclass(frozen=True)
class _Documents:
    """Every good document's place in the spool, in source order."""

    spools: list[str]  # chunk -> spool file
    chunk: np.ndarray  # document -> chunk
    start: np.ndarray  # document -> first id in its chunk's spool
    length: np.ndarray  # document -> ids, its EOD included
    targets: np.ndarray | None = None  # instruction data: document -> target tokens


def _pack(lengths: np.ndarray, sample_tokens: int) -> list[tuple[int, int]]:
    """(first, end) document positions of each sample (see the module doc)."""
    samples = []
    first, held = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if i > first and held + n > sample_tokens:
            samples.append((first, i))
            first, held = i, 0
        held += n
    if len(lengths):
        samples.append((first, len(lengths)))
    return samples


@dataclass(frozen=True)
class _ShardPlan:
    url: str
    samples: tuple[tuple[str, np.ndarray], ...]  # (key, document numbers)
    num_tokens: int
    num_targets: int | None = None  # instruction data: tokens the loss mask marks


def _shards(
    order: np.ndarray,
    docs: _Documents,
    options: run.ConvertOptions,
    field: str,
    folder: str,
    prefix: str,
) -> list[_ShardPlan]:
    itemsize = TOKEN_FIELDS[field].itemsize
    packed = _pack(docs.length[order], options.sample_tokens)
    target = options.shard_size or DEFAULT_SHARD_SIZE
    shards: list[_ShardPlan] = []
    current: list[tuple[str, np.ndarray]] = []
    size = tokens = 0

    def close() -> None:
        url = run._join(folder, f"{prefix}-{len(shards):06d}.tar")
        targets = None
        if docs.targets is not None:
            targets = sum(int(docs.targets[members].sum()) for _, members in current)
        shards.append(_ShardPlan(url, tuple(current), tokens, targets))

    for position, (first, end) in enumerate(packed):
        key = sample_key(position)
        members = order[first:end]
        n = int(docs.length[members].sum())
        nbytes = member_num_bytes(f"{key}.{field}", n * itemsize)
        if docs.targets is not None:
            nbytes += member_num_bytes(f"{key}.{LOSS_MASK_FIELD}", (n + 7) // 8)
        full = (
            len(current) >= options.samples_per_shard
            if options.samples_per_shard is not None
            else size + nbytes > target
        )
        if current and full:
            close()
            current, size, tokens = [], 0, 0
        current.append((key, members))
        size += nbytes
        tokens += n
    if current:
        close()
    return shards


class _SpoolReader:
    def __init__(self, docs: _Documents, dtype: str) -> None:
        self.docs = docs
        self.maps = [np.memmap(s, dtype=dtype, mode="r") if s else None for s in docs.spools]
        self.masks = []
        if docs.targets is not None:
            self.masks = [
                np.memmap(s + ".mask", np.uint8, mode="r") if s else None for s in docs.spools
            ]

    def ids(self, members: np.ndarray, maps: list[np.memmap | None] | None = None) -> np.ndarray:
        parts = []
        for d in members.tolist():
            spool = (self.maps if maps is None else maps)[self.docs.chunk[d]]
            assert spool is not None  # a chunk with documents has a spool
            start = int(self.docs.start[d])
            parts.append(spool[start : start + int(self.docs.length[d])])
        return np.concatenate(parts)

    def mask(self, members: np.ndarray) -> np.ndarray:
        """The documents' loss mask (instruction data), aligned with `ids`."""
        return self.ids(members, self.masks).astype(bool)


def _write(plan: _ShardPlan, reader: _SpoolReader, field: str) -> ShardResult:
    output = ShardOutput(plan.url)
    try:
        writer = ShardTarWriter(output.file)
        for key, members in plan.samples:
            if reader.masks:  # before the ids: a reader knows the mask when they come
                writer.add(f"{key}.{LOSS_MASK_FIELD}", encode_loss_mask(reader.mask(members)))
            writer.add(f"{key}.{field}", encode_tokens(reader.ids(members), field))
        sha256 = writer.finish()
        output.commit()
    except BaseException:
        output.discard()
        raise
    return ShardResult(plan.url, len(plan.samples), writer.num_bytes, sha256, ())


def _scan(plan: _ShardPlan) -> ShardResult:
    """A shard an interrupted run committed (`--resume`): its bytes are the plan's."""
    with fsspec.open(plan.url, "rb") as f:
        data = f.read()
    return ShardResult(plan.url, len(plan.samples), len(data), hashlib.sha256(data).hexdigest(), ())


def _validate(options: run.ConvertOptions, index: ShardIndex | None) -> None:
    """Refuse options out of range, and options that do nothing for this text source."""
    if options.sample_tokens < 1:
        raise ConvertOptionError("--sample-tokens must be >= 1")
    ignored = run.given(
        options,
        ("max_side", "quality", "source_kind", "columns", "args", "path_column", "label_column"),
    )
    if ignored:
        raise ConvertOptionError(f"{', '.join(ignored)}: not for text sources (--tokenizer)")
    table = options.src.split("?", 1)[0].lower().endswith(TEXT_SUFFIXES)
    unused: tuple[str, ...]
    if index is not None:
        kind, unused = "token index", ("eod_token", "text_field", "text_glob", "text_per_line")
    elif table:
        kind, unused = "table (.jsonl/.csv/.parquet)", ("text_glob",)
    else:
        fs, path = fsspec.core.url_to_fs(options.src)
        if not fs.exists(path):
            return  # reading it says so
        is_folder = fs.isdir(path)
        kind = "folder of text files" if is_folder else "text file"
        unused = ("text_field",) if is_folder else ("text_field", "text_glob")
    for flag in run.given(options, unused):
        raise ConvertOptionError(f"{flag}: does nothing for a {kind} ({_redact(options.src)})")


def convert_text(
    options: run.ConvertOptions, spool_dir: str, state_url: str, index_urls: dict[str, str]
) -> run.ConvertResult:
    """Convert a text source or token index into token shards (see the module doc)."""
    index = source_index(options.src)
    _validate(options, index)
    if index is not None and index.tokenizer is None:
        raise ConvertOptionError(
            f"{_redact(options.src)}: an index of shards that hold no tokens; --tokenizer "
            "converts text files, .jsonl/.csv/.parquet tables or token indexes"
        )
    if index is not None:
        info = check_tokenizer(index, options.tokenizer, _redact(options.src), "--tokenizer")
    else:
        info = load_tokenizer(options.tokenizer, options.eod_token).info()
    if index is not None and index.num_targets is not None:
        raise ConvertOptionError(
            f"{_redact(options.src)}: re-packing token shards with a loss mask is not "
            "supported; convert the instruction data again"
        )
    try:
        records = instructions.record_format(
            options.prompt_field, options.response_field, options.messages_field, options.tokenizer
        )
    except ValueError as exc:
        raise ConvertOptionError(str(exc)) from None
    if records is not None and not options.src.split("?", 1)[0].lower().endswith(".jsonl"):
        raise ConvertOptionError(
            f"{_redact(options.src)}: --prompt-field, --response-field and --messages-field "
            "read .jsonl records"
        )
    field = token_field(info["vocab_size"])
    job = _Job(
        options.tokenizer,
        options.eod_token,
        options.text_field,
        options.text_per_line,
        spool_dir,
        TOKEN_FIELDS[field].str,
        info["vocab_size"],
        info["eod_id"],
        records,
    )
    docs, skipped, digests = _tokenize(options, index, job)
    splits = ["train", "val"] if options.val_fraction > 0 else [""]
    layout = run._split_layout(options, splits)
    orders = _split_and_order(options, len(docs.length))
    plans = {
        split: _shards(order, docs, options, field, *layout[split])
        for split, order in orders.items()
    }
    kind = "tokens" if index is not None else "text"
    settings = {
        **run._settings(options, kind),
        "tokenizer": info,
        "sample_tokens": options.sample_tokens,
        "text_field": options.text_field,
        "text_glob": options.text_glob,
        "text_per_line": options.text_per_line,
        **(records.settings() if records is not None else {}),
    }
    fingerprint = plan_fingerprint({}, {**settings, "chunks": digests})
    tasks = {
        split: [ShardTask(p.url, (), EncodeOptions(), options.on_error) for p in shard_plans]
        for split, shard_plans in plans.items()
    }  # only their URLs are read: which shards exist
    run._prepare_destination(options, state_url, index_urls, tasks, fingerprint, layout)
    reader = _SpoolReader(docs, job.dtype)
    results: dict[str, ShardResult] = {}
    num_resumed = 0
    for split_plans in plans.values():
        for plan in split_plans:
            if options.resume and run._exists(plan.url):
                results[plan.url] = _scan(plan)
                num_resumed += 1
            else:
                results[plan.url] = _write(plan, reader, field)
    return _commit(
        options, plans, results, layout, settings, info, skipped, index_urls, state_url, num_resumed
    )


def _tokenize(
    options: run.ConvertOptions, index: ShardIndex | None, job: _Job
) -> tuple[_Documents, list[tuple[str, str]], list[str]]:
    """Step 1: every chunk tokenized; under `--on-error fail` the first bad document stops."""
    spools: list[str] = []
    chunk_of, starts, lengths, targets = [], [], [], []
    skipped: list[tuple[str, str]] = []
    digests = []
    chunks: Iterable[_Chunk] = _chunks(options, index)
    if index is not None or not options.src.lower().endswith(TEXT_SUFFIXES):
        chunks = list(chunks)  # file names or shard URLs only: cheap
    # A file is a document unless --text-per-line: then, and for tables (read as they go) and
    # token indexes, the number of documents is known only at the end.
    total = 0
    if isinstance(chunks, list) and index is None and not options.text_per_line:
        total = sum(len(chunk.files) for chunk in chunks)
    progress = Progress(
        total,
        options.progress,
        label="tokenize",
        unit="documents",
        rate_unit="docs/s",
        count_tokens=True,
    )
    try:
        for result in _ordered_map(tokenize_chunk, chunks, job, options.workers):
            if result.errors and options.on_error == "fail":
                where, reason = result.errors[0]
                raise ConvertError(
                    f"{where}: {reason} (use --on-error skip to skip and list such documents)"
                )
            skipped.extend(result.errors)
            digests.append(result.digest)
            chunk_of.append(np.full(result.lengths.size, len(spools), dtype=np.int64))
            starts.append(np.concatenate(([0], np.cumsum(result.lengths)[:-1])).astype(np.int64))
            lengths.append(result.lengths)
            if result.targets is not None:
                targets.append(result.targets)
            spools.append(result.spool)
            progress.update(result.lengths.size + len(result.errors), int(result.lengths.sum()))
    finally:
        progress.close()
    if not lengths or not sum(x.size for x in lengths):
        raise ConvertError(f"{_redact(options.src)}: no documents")
    docs = _Documents(
        spools,
        np.concatenate(chunk_of),
        np.concatenate(starts),
        np.concatenate(lengths),
        np.concatenate(targets) if job.records is not None else None,
    )
    return docs, skipped, digests


def _split_and_order(options: run.ConvertOptions, num_docs: int) -> dict[str, np.ndarray]:
    """Document numbers of each split, in write order (val: a seeded choice by document)."""
    everything = np.arange(num_docs)
    if options.val_fraction > 0:
        num_val = round(options.val_fraction * num_docs)
        if num_val == 0 or num_val == num_docs:
            raise ConvertError(
                f"--val-fraction {options.val_fraction}: leaves an empty split for "
                f"{num_docs} documents"
            )
        chosen = random.Random(f"hpctrain-split:{options.seed}:documents").sample(
            range(num_docs), num_val
        )
        is_val = np.zeros(num_docs, dtype=bool)
        is_val[chosen] = True
        by_split = {"train": everything[~is_val], "val": everything[is_val]}
    else:
        by_split = {"": everything}
    if options.shuffle:
        for split, order in by_split.items():
            shuffled = order.tolist()
            random.Random(f"hpctrain-shuffle:{options.seed}:{split or 'all'}").shuffle(shuffled)
            by_split[split] = np.array(shuffled, dtype=np.int64)
    return by_split


def _commit(
    options: run.ConvertOptions,
    plans: dict[str, list[_ShardPlan]],
    results: dict[str, ShardResult],
    layout: dict[str, tuple[str, str]],
    settings: dict[str, Any],
    info: dict[str, Any],
    skipped: list[tuple[str, str]],
    index_urls: dict[str, str],
    state_url: str,
    num_resumed: int,
) -> run.ConvertResult:
    """`skipped.txt`, then each split's index (token counts, tokenizer), then the state file."""
    skipped_url = run._join(options.dest, run.SKIPPED_NAME)
    if skipped:
        text = "".join(f"{where}\t{reason}\n" for where, reason in skipped)
        run._write_bytes(skipped_url, text.encode())
    else:
        run._remove(skipped_url)
    indexes = {}
    for split, split_plans in plans.items():
        shards = tuple(
            ShardInfo(
                url=posixpath.basename(p.url),
                num_samples=results[p.url].num_samples,
                num_bytes=results[p.url].num_bytes,
                sha256=results[p.url].sha256,
                num_tokens=p.num_tokens,
                num_targets=p.num_targets,
            )
            for p in split_plans
        )
        extra = {**settings, "split": split or None, "num_skipped_documents": len(skipped)}
        extra.pop("tokenizer")  # the index's own key
        indexes[split] = index = ShardIndex(
            shards=shards,
            base_url=layout[split][0],
            command=run.command_line(options),
            extra=extra,
            tokenizer=dict(info),
        )
        run._write_bytes(index_urls[split], index_to_bytes(index))
    run._remove(state_url)
    return run.ConvertResult(indexes, index_urls, skipped, num_resumed)
