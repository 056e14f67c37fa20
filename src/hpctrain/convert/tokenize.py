"""Step 1 of the token pipeline (`text.py`): chunks of documents (`sources/text.py`) tokenized
in worker processes (`--workers`) into a temporary spool, in any order; the results are put back
in source order, so what follows does not depend on the workers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from hpctrain.convert import instructions
from hpctrain.convert.errors import ConvertError
from hpctrain.convert.options import ConvertOptions
from hpctrain.convert.processes import process_pool
from hpctrain.convert.progress import Progress
from hpctrain.convert.sources.text import (
    TEXT_SUFFIXES,
    Chunk,
    document_chunks,
    file_documents,
    record_text,
    shard_documents,
)
from hpctrain.data.index import ShardIndex
from hpctrain.data.index import redact_url as _redact
from hpctrain.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class TokenizeJob:
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
class ChunkResult:
    number: int
    spool: str  # file of the chunk's ids (all documents, EODs included), "" when empty
    lengths: np.ndarray  # ids of each document, its EOD included
    errors: tuple[tuple[str, str], ...]  # (where, reason) of each bad document, in order
    digest: str  # sha256 of the ids and lengths: the plan fingerprint of `--resume`
    targets: np.ndarray | None = None  # instruction data: each document's target tokens


_TOKENIZERS: dict[tuple[str, str], Tokenizer] = {}


def _tokenizer(job: TokenizeJob) -> Tokenizer:
    key = (job.tokenizer, job.eod_token)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(job.tokenizer, job.eod_token)
    return _TOKENIZERS[key]


def tokenize_chunk(chunk: Chunk, job: TokenizeJob) -> ChunkResult:
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
        for where, ids, error in shard_documents(chunk.shard, job.vocab_size, job.eod_id):
            if ids is None:
                errors.append((where, error))
            else:
                pieces.append(ids)
    for url in chunk.files:
        for where, text, error in file_documents(url, job.per_line):
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
        text, error = record_text(where, value, job.text_field, chunk.jsonl)
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
    return ChunkResult(chunk.number, spool, lengths, tuple(errors), digest.hexdigest(), targets)


def tokenize_chunks(
    chunks: Iterable[Chunk], job: TokenizeJob, workers: int
) -> Iterator[ChunkResult]:
    """Every chunk tokenized (`workers` processes), results in chunk order."""
    return _ordered_map(tokenize_chunk, chunks, job, workers)


def _ordered_map(
    func: Callable[..., ChunkResult], items: Iterable[Chunk], job: TokenizeJob, workers: int
) -> Iterator[ChunkResult]:
    """`func(item, job)` for every item, results in item order; at most 2 x workers in flight
    (a table read in the main process is not held in memory all at once)."""
    if workers == 1:
        for item in items:
            yield func(item, job)
        return
    with process_pool(workers) as pool:
        pending: list[Future[ChunkResult]] = []
        for item in items:
            pending.append(pool.submit(func, item, job))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


@dataclass(frozen=True)
class Documents:
    """Every good document's place in the spool, in source order."""

    spools: list[str]  # chunk -> spool file
    chunk: np.ndarray  # document -> chunk
    start: np.ndarray  # document -> first id in its chunk's spool
    length: np.ndarray  # document -> ids, its EOD included
    targets: np.ndarray | None = None  # instruction data: document -> target tokens


def source_chunks(options: ConvertOptions, index: ShardIndex | None) -> Iterable[Chunk]:
    """The source's tokenize tasks, in source order (numbers 0, 1, ...: the same for any
    `--workers` or `--parts`)."""
    chunks: Iterable[Chunk] = document_chunks(
        options.src,
        index,
        text_field=options.text_field,
        text_glob=options.text_glob,
        per_line=options.text_per_line,
    )
    if index is not None or not options.src.lower().endswith(TEXT_SUFFIXES):
        chunks = list(chunks)  # file names or shard URLs only: cheap
    return chunks


def tokenize_source(
    options: ConvertOptions, index: ShardIndex | None, job: TokenizeJob
) -> tuple[Documents, list[tuple[str, str]], list[str]]:
    """Step 1: every chunk tokenized; under `--on-error fail` the first bad document stops."""
    chunks = source_chunks(options, index)
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
        results = _ordered_map(tokenize_chunk, chunks, job, options.workers)
        return assemble(options, job.records is not None, results, progress)
    finally:
        progress.close()


def assemble(
    options: ConvertOptions,
    with_targets: bool,
    results: Iterable[ChunkResult],
    progress: Progress | None = None,
) -> tuple[Documents, list[tuple[str, str]], list[str]]:
    """The documents of chunk results in source order (the skipped ones, the chunks'
    digests); under `--on-error fail` the first bad document stops."""
    spools: list[str] = []
    chunk_of, starts, lengths, targets = [], [], [], []
    skipped: list[tuple[str, str]] = []
    digests = []
    for result in results:
        if result.errors and options.on_error == "fail":
            where, reason = result.errors[0]
            if reason.startswith(instructions.NO_FIELD):  # a flag naming another field
                raise ConvertError(f"{where}: {reason}")
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
        if progress is not None:
            progress.update(result.lengths.size + len(result.errors), int(result.lengths.sum()))
    if not lengths or not sum(x.size for x in lengths):
        raise ConvertError(f"{_redact(options.src)}: no documents")
    docs = Documents(
        spools,
        np.concatenate(chunk_of),
        np.concatenate(starts),
        np.concatenate(lengths),
        np.concatenate(targets) if with_targets else None,
    )
    return docs, skipped, digests
