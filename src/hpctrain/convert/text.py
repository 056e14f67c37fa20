"""Text -> token shards for language models (`hpctrain convert SRC DEST --tokenizer bytes|PATH`).

Sources (SRC), and what a document is: `sources/text.py`.

Sample layout: documents, in order, are appended to a sample while it holds at most
`--sample-tokens` ids (default 8192, EODs included); the document that would push it past is
the first of the next sample, and a document longer than that is a sample of its own. So
short lines share one tar member instead of costing a 512-byte header and padding each, and a
sample holds whole documents only. Each sample has one member, `tokens.u16` (vocabularies of
at most 65536 ids) or `tokens.u32` (`hpctrain.data.tokens`). Shards are cut from the samples by
`--samples-per-shard` or `--shard-size` (bytes, default 256MB), as in every conversion.

Steps: (1) the source is cut into chunks of documents that worker processes tokenize
(`--workers`) into a temporary spool, in any order (`tokenize.py`); (2) here, the main process
then splits the documents (`--val-fraction`: a seeded choice of round(F*n) documents), orders them
(`--shuffle`), packs samples and shards and writes them. Only step 1 depends on the workers,
and its results are put back in source order, so the output is byte-identical for any
`--workers`. Text that is not valid UTF-8 (and a missing or non-text field) is a document
error naming the file and line (or row): `--on-error fail` stops, `skip` lists it in
`skipped.txt` and leaves the document out.
"""

from __future__ import annotations

import hashlib
import posixpath
import random
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from hpctrain.convert import destination, instructions
from hpctrain.convert.destination import Layout
from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.layout import DEFAULT_SHARD_SIZE, plan_fingerprint
from hpctrain.convert.options import ConvertOptions, ConvertResult, command_line, given, settings
from hpctrain.convert.sources.base import sample_key
from hpctrain.convert.sources.text import TEXT_SUFFIXES, source_index
from hpctrain.convert.tar import ShardTarWriter, member_num_bytes
from hpctrain.convert.tokenize import Documents, TokenizeJob, tokenize_source
from hpctrain.convert.writer import ShardOutput, ShardResult
from hpctrain.data.index import (
    ShardIndex,
    ShardInfo,
)
from hpctrain.data.index import redact_url as _redact
from hpctrain.data.tokenizer import check_tokenizer, load_tokenizer
from hpctrain.data.tokens import (
    LOSS_MASK_FIELD,
    TOKEN_FIELDS,
    encode_loss_mask,
    encode_tokens,
    token_field,
)


def is_text_conversion(options: ConvertOptions) -> bool:
    """Text mode: `--tokenizer` given, or SRC is a token index (resharding keeps its ids)."""
    if options.tokenizer:
        return True
    index = source_index(options.src)
    return index is not None and index.tokenizer is not None


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
class ShardPlan:
    url: str
    samples: tuple[tuple[str, np.ndarray], ...]  # (key, document numbers)
    num_tokens: int
    num_targets: int | None = None  # instruction data: tokens the loss mask marks


def _shards(
    order: np.ndarray,
    docs: Documents,
    options: ConvertOptions,
    field: str,
    layout: Layout,
    split: str,
) -> list[ShardPlan]:
    itemsize = TOKEN_FIELDS[field].itemsize
    packed = _pack(docs.length[order], options.sample_tokens)
    target = options.shard_size or DEFAULT_SHARD_SIZE
    shards: list[ShardPlan] = []
    current: list[tuple[str, np.ndarray]] = []
    size = tokens = 0

    def close() -> None:
        url = destination.shard_url(layout, split, len(shards))
        targets = None
        if docs.targets is not None:
            targets = sum(int(docs.targets[members].sum()) for _, members in current)
        shards.append(ShardPlan(url, tuple(current), tokens, targets))

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


class SpoolReader:
    def __init__(self, docs: Documents, dtype: str) -> None:
        self.docs = docs
        self.maps = [np.memmap(s, dtype=dtype, mode="r") if s else None for s in docs.spools]
        self.masks: list[np.memmap | None] = []
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


def _write(plan: ShardPlan, reader: SpoolReader, field: str) -> ShardResult:
    output = ShardOutput(plan.url)
    try:
        writer = ShardTarWriter(output.file)
        for key, members in plan.samples:
            if reader.masks:  # before the ids: a reader knows the mask when they come
                writer.add(f"{key}.{LOSS_MASK_FIELD}", encode_loss_mask(reader.mask(members)))
            writer.add(f"{key}.{field}", encode_tokens(reader.ids(members), field))
        sha256 = writer.finish()
        output.commit()
    except OSError as exc:
        output.discard()
        raise output.failed(exc) from None
    except BaseException:
        output.discard()
        raise
    return ShardResult(plan.url, len(plan.samples), writer.num_bytes, sha256, ())


def _scan(plan: ShardPlan) -> ShardResult:
    """A shard an interrupted run committed (`--resume`): its bytes are the plan's."""
    with fsspec.open(plan.url, "rb") as f:
        data = f.read()
    return ShardResult(plan.url, len(plan.samples), len(data), hashlib.sha256(data).hexdigest(), ())


def _validate(options: ConvertOptions, index: ShardIndex | None) -> None:
    """Refuse options out of range, and options that do nothing for this text source."""
    if options.sample_tokens < 1:
        raise ConvertOptionError("--sample-tokens must be >= 1")
    ignored = given(
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
    for flag in given(options, unused):
        raise ConvertOptionError(f"{flag}: does nothing for a {kind} ({_redact(options.src)})")


@dataclass(frozen=True)
class TextSetup:
    """What a text conversion reads with, checked before any document is read."""

    index: ShardIndex | None  # SRC as a token index (re-packing), or None for text
    info: dict[str, Any]  # the tokenizer's `info()`
    records: instructions.RecordFormat | None  # instruction data
    field: str  # the token member: tokens.u16 or tokens.u32


def text_setup(options: ConvertOptions) -> TextSetup:
    """Refuse what cannot be converted; the tokenizer and the token member (see the module doc)."""
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
    return TextSetup(index, info, records, token_field(info["vocab_size"]))


def token_job(options: ConvertOptions, setup: TextSetup, spool_dir: str) -> TokenizeJob:
    return TokenizeJob(
        options.tokenizer,
        options.eod_token,
        options.text_field,
        options.text_per_line,
        spool_dir,
        TOKEN_FIELDS[setup.field].str,
        setup.info["vocab_size"],
        setup.info["eod_id"],
        setup.records,
    )


@dataclass(frozen=True)
class TextPlan:
    """Every split's shards, decided over all documents (split, order, packing)."""

    plans: dict[str, list[ShardPlan]]
    settings: dict[str, Any]  # what decides the output bytes (the index's extra)
    fingerprint: str
    # split -> its documents (packed into fewer samples); not known to a merge of parts
    num_documents: dict[str, int] = field(default_factory=dict)


def text_plan(
    options: ConvertOptions,
    setup: TextSetup,
    docs: Documents,
    digests: list[str],
    layout: Layout,
) -> TextPlan:
    """Step 2's plan: split, order and pack the documents into shards (pure arithmetic)."""
    orders = _split_and_order(options, len(docs.length))
    plans = {
        split: _shards(order, docs, options, setup.field, layout, split)
        for split, order in orders.items()
    }
    kind = "tokens" if setup.index is not None else "text"
    output_settings = {
        **settings(options, kind),
        "tokenizer": setup.info,
        "sample_tokens": options.sample_tokens,
        "text_field": options.text_field,
        "text_glob": options.text_glob,
        "text_per_line": options.text_per_line,
        **(setup.records.settings() if setup.records is not None else {}),
    }
    fingerprint = plan_fingerprint({}, {**output_settings, "chunks": digests})
    documents = {split: len(order) for split, order in orders.items()}
    return TextPlan(plans, output_settings, fingerprint, documents)


def write_or_keep(
    plan: ShardPlan, reader: SpoolReader, field: str, keep: bool
) -> tuple[ShardResult, bool]:
    """Shard `plan` written, or (`keep`: resuming) kept when complete; True when kept."""
    if keep and destination.exists(plan.url):
        return _scan(plan), True
    return _write(plan, reader, field), False


def convert_text(options: ConvertOptions, spool_dir: str, layout: Layout) -> ConvertResult:
    """Convert a text source or token index into token shards (see the module doc)."""
    setup = text_setup(options)
    job = token_job(options, setup, spool_dir)
    docs, skipped, digests = tokenize_source(options, setup.index, job)
    tp = text_plan(options, setup, docs, digests, layout)
    shard_urls = {split: [p.url for p in shard_plans] for split, shard_plans in tp.plans.items()}
    destination.prepare(options, layout, shard_urls, tp.fingerprint)
    reader = SpoolReader(docs, job.dtype)
    results: dict[str, ShardResult] = {}
    num_resumed = 0
    for split_plans in tp.plans.values():
        for plan in split_plans:
            results[plan.url], kept = write_or_keep(plan, reader, setup.field, options.resume)
            num_resumed += kept
    indexes = text_indexes(options, tp, results, layout, setup.info, len(skipped))
    destination.commit(options, layout, indexes, skipped)
    return ConvertResult(
        indexes, destination.index_urls_of(layout), skipped, num_resumed, tp.num_documents
    )


def _split_and_order(options: ConvertOptions, num_docs: int) -> dict[str, np.ndarray]:
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


def index_entry(plan: ShardPlan, result: ShardResult) -> ShardInfo:
    """Shard `plan`'s entry in its index (token counts from the plan)."""
    return ShardInfo(
        url=posixpath.basename(plan.url),
        num_samples=result.num_samples,
        num_bytes=result.num_bytes,
        sha256=result.sha256,
        num_tokens=plan.num_tokens,
        num_targets=plan.num_targets,
    )


def text_indexes(
    options: ConvertOptions,
    tp: TextPlan,
    results: dict[str, ShardResult],
    layout: Layout,
    info: dict[str, Any],
    num_skipped: int,
) -> dict[str, ShardIndex]:
    """Each split's index: token counts per shard, the tokenizer."""
    indexes = {}
    for split, split_plans in tp.plans.items():
        shards = tuple(index_entry(p, results[p.url]) for p in split_plans)
        extra = {**tp.settings, "split": split or None, "num_skipped_documents": num_skipped}
        extra.pop("tokenizer")  # the index's own key
        indexes[split] = ShardIndex(
            shards=shards,
            base_url=layout[split][0],
            command=command_line(options),
            extra=extra,
            tokenizer=dict(info),
        )
    return indexes
