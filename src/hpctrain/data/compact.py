"""The compact index: `index.compact` beside `index.json`, the same shards as fixed-width columns.

`index.json` stays the interchange format (readable, verifiable, what every tool writes); the
compact form is derived from it (`hpctrain convert` writes both; `hpctrain index compact INDEX`
derives it for an existing index) so that a rank of a job over a million shards maps a file
instead of parsing 150 MB of JSON into a million objects. Layout (version 1, little-endian)::

    bytes 0-7    magic b"HPCIDX01"
    bytes 8-15   header length H (uint64)
    bytes 16-    header: UTF-8 JSON (below), then zero padding to a multiple of 64
    columns      each at the offset the header gives (a multiple of 64)

The header holds what `index.json` holds besides its shards (class_names, tokenizer, command,
extra), the totals, the stamp of the JSON it was derived from (`JsonStamp`: its sha256 and
size, so a companion that no longer matches is never used silently), and
where each column lies: `num_samples`, `num_bytes` and, for token shards, `num_tokens` and
`num_targets` as int64 (the dtype the plan computes in: a column is read with no copy);
`sha256` as 32 raw bytes per shard (all zero: none recorded). URLs are stored once as *runs*:
`train-000000.tar` ... `train-999999.tar` is one run (a prefix, a first number, a width and a
suffix); a URL that continues no run is a run of one, its text stored whole, and so is a URL
whose number does not fit the int64 column (a 20-digit id or timestamp). Shard `i`'s URL is
found by a binary search over the runs' first shards.

A compact index is data from whoever wrote the dataset, like the JSON: `parse_compact` checks
the header, every column's place and values, and every run's URL with the JSON's own rule
(`check_shard_url`: the digits a run varies cannot turn an allowed URL into a refused one,
so checking a run's first URL checks them all).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from hpctrain.data.index import (
    COUNT_COLUMNS,
    TAR_BLOCK,
    ShardIndex,
    ShardIndexError,
    ShardInfo,
    ShardTable,
    base_url_of,
    check_shard_url,
    described,
    join_url,
    redact_url,
    url_protocol,
)

COMPACT_FORMAT = "hpctrain-compact-index"
COMPACT_VERSION = 1
COMPACT_SUFFIX = ".compact"
MAGIC = b"HPCIDX01"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")
_NUMBERED = re.compile(r"(.*?)(\d+)(\D*)", re.S)  # the last group of digits of a URL
_MAX_NUMBER = 2**63 - 1  # a run's first number is stored as int64
RELATIVE = "relative"  # a URL kind: resolved against the index folder, its protocol


def url_kind(url: str) -> str:
    """`RELATIVE`, or the protocol of an absolute URL (`url_protocol`)."""
    relative = ":" not in url and url[:1] != "/"
    return RELATIVE if relative else url_protocol(url)


def companion_url(json_url: str) -> str:
    """`.../index.json` -> `.../index.compact` (any `NAME.json` -> `NAME.compact`)."""
    stem = json_url[: -len(".json")] if json_url.endswith(".json") else json_url
    return stem + COMPACT_SUFFIX


@dataclass(frozen=True)
class JsonStamp:
    """The `index.json` a compact index was derived from: its sha256 and size.

    The sha256 decides. A node trusts the companion after a `stat` of both files when the
    JSON has the recorded size and is not newer than its companion (`node_index`); otherwise
    it reads the JSON once and compares digests. Nothing about the files' times is stored,
    so the same index always gives the same bytes.
    """

    sha256: str
    size: int


# -- writing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    first: int  # the first shard of the run
    number: int  # that shard's number (-1: a literal URL)
    width: int  # digits, zero-padded (0: a literal URL)
    prefix: str
    suffix: str


def url_runs(urls: Sequence[str]) -> list[_Run]:
    """The URLs as runs of consecutive numbers (see the module doc)."""
    runs: list[_Run] = []
    last: tuple[str, int, int, str] | None = None  # prefix, number, width, suffix of shard i-1
    for i, url in enumerate(urls):
        match = _NUMBERED.fullmatch(url)
        # digits past int64 (a 20-digit id or timestamp): the URL is stored as its text, as
        # one without digits (the length test first: int() refuses over 4,300 digits)
        if match is None or len(match[2]) > 19 or int(match[2]) > _MAX_NUMBER:
            runs.append(_Run(i, -1, 0, url, ""))
            last = None
            continue
        prefix, digits, suffix = match.groups()
        here = (prefix, int(digits), len(digits), suffix)
        if (
            last is not None
            and (prefix, len(digits), suffix) == (last[0], last[2], last[3])
            and here[1] == last[1] + 1
        ):
            last = here
            continue
        runs.append(_Run(i, here[1], here[2], prefix, suffix))
        last = here
    return runs


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def compact_bytes(index: ShardIndex, stamp: JsonStamp) -> bytes:
    """The compact form of `index` (read from the JSON `stamp` describes)."""
    n = index.num_shards
    columns: dict[str, np.ndarray] = {}
    partial = []  # token counts some shards lack: -1 there (parse_index lets them)
    for name in COUNT_COLUMNS:
        values = [getattr(s, name) for s in index.shards]
        if name in ("num_samples", "num_bytes") or any(v is not None for v in values):
            if any(v is None for v in values):
                partial.append(name)
            columns[name] = np.array([-1 if v is None else v for v in values], dtype="<i8")
    hex_digits = "".join(s.sha256 or "0" * 64 for s in index.shards)
    columns["sha256"] = np.frombuffer(bytes.fromhex(hex_digits), dtype=np.uint8).reshape(n, 32)
    urls = [s.url for s in index.shards]
    runs = url_runs(urls)
    texts = [t.encode() for r in runs for t in (r.prefix, r.suffix)]
    columns["run_first"] = np.array([r.first for r in runs], dtype="<i8")
    columns["run_number"] = np.array([r.number for r in runs], dtype="<i8")
    columns["run_width"] = np.array([r.width for r in runs], dtype="<i8")
    columns["run_text"] = np.concatenate(([0], np.cumsum([len(t) for t in texts]))).astype("<i8")
    columns["text"] = np.frombuffer(b"".join(texts), dtype=np.uint8)
    header: dict[str, Any] = {
        "format": COMPACT_FORMAT,
        "version": COMPACT_VERSION,
        "json": {"sha256": stamp.sha256, "size": stamp.size},
        "num_shards": n,
        "num_runs": len(runs),
        "url_kinds": sorted({url_kind(urls[r.first]) for r in runs}),
        "partial": partial,
        "totals": {
            name: int(col[col >= 0].sum()) for name, col in columns.items() if name in COUNT_COLUMNS
        },
        "class_names": list(index.class_names),
        "command": index.command,
        "extra": index.extra,
        **({"tokenizer": dict(index.tokenizer)} if index.tokenizer is not None else {}),
    }
    # the offsets are in the header, whose length moves them: place the columns after a
    # header of the size the previous try gave, until the header fits before them
    start = 0
    while True:
        placed: dict[str, dict[str, Any]] = {}
        offset = start
        for name, col in columns.items():
            placed[name] = {"dtype": col.dtype.str, "shape": list(col.shape), "offset": offset}
            offset = _aligned(offset + col.nbytes)
        header["columns"] = placed
        text = json.dumps(header).encode()
        if _aligned(_PREFIX.size + len(text)) <= start:
            break
        start = _aligned(_PREFIX.size + len(text))
    out = bytearray(offset)
    _PREFIX.pack_into(out, 0, MAGIC, len(text))
    out[_PREFIX.size : _PREFIX.size + len(text)] = text
    for name, col in columns.items():
        start = placed[name]["offset"]
        out[start : start + col.nbytes] = col.tobytes()
    return bytes(out)


def json_sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# -- reading ----------------------------------------------------------------------------------


def read_header(buffer: Any, where: str) -> dict[str, Any]:
    """The header of a compact index in `buffer` (bytes or a memory map)."""
    if len(buffer) < _PREFIX.size:
        raise ShardIndexError(f"{where}: not a compact hpctrain index (too short)")
    magic, length = _PREFIX.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise ShardIndexError(f"{where}: not a compact hpctrain index (magic {magic!r})")
    if _PREFIX.size + length > len(buffer):
        raise ShardIndexError(f"{where}: truncated compact index (header past the end)")
    try:
        header = json.loads(bytes(buffer[_PREFIX.size : _PREFIX.size + length]))
    except ValueError:
        raise ShardIndexError(f"{where}: compact index header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != COMPACT_FORMAT:
        raise ShardIndexError(f"{where}: not a compact hpctrain index (format)")
    if header.get("version") != COMPACT_VERSION:
        raise ShardIndexError(
            f"{where}: compact index version {header.get('version')!r} (this hpctrain reads "
            f"{COMPACT_VERSION}); derive it again: hpctrain index compact"
        )
    return header


def header_stamp(header: dict[str, Any], where: str) -> JsonStamp:
    raw = header.get("json")
    try:
        assert isinstance(raw, dict)
        return JsonStamp(str(raw["sha256"]), int(raw["size"]))
    except (AssertionError, KeyError, ValueError):
        raise ShardIndexError(f"{where}: compact index header lacks its JSON's stamp") from None


_DTYPES = {"num_samples": "<i8", "num_bytes": "<i8", "num_tokens": "<i8", "num_targets": "<i8",
           "sha256": "|u1", "run_first": "<i8", "run_number": "<i8", "run_width": "<i8",
           "run_text": "<i8", "text": "|u1"}  # fmt: skip


def _is_length(shape: Any) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) == 1
        and isinstance(shape[0], int)
        and not isinstance(shape[0], bool)
        and shape[0] >= 0
    )


def _columns(buffer: Any, header: dict[str, Any], where: str) -> dict[str, np.ndarray]:
    """Read-only views of every column, each checked to lie inside the buffer."""
    placed = header.get("columns")
    n, runs = header.get("num_shards"), header.get("num_runs")
    if not isinstance(placed, dict) or not _is_length([n]) or not _is_length([runs]):
        raise ShardIndexError(f"{where}: compact index header lacks its columns")
    assert isinstance(n, int) and isinstance(runs, int)
    shapes = {"sha256": [n, 32], "run_first": [runs], "run_number": [runs], "run_width": [runs],
              "run_text": [2 * runs + 1]}  # fmt: skip
    out = {}
    for name, dtype in _DTYPES.items():
        spec = placed.get(name)
        if spec is None:
            if name in ("num_samples", "num_bytes") or name in shapes or name == "text":
                raise ShardIndexError(f"{where}: compact index lacks the {name} column")
            continue
        shape = spec.get("shape") if isinstance(spec, dict) else None
        offset = spec.get("offset") if isinstance(spec, dict) else None
        expected: Any = shapes.get(name, [n])
        if name == "text":  # any length: the URL texts
            expected = shape if _is_length(shape) else None
        if (
            not isinstance(spec, dict)
            or spec.get("dtype") != dtype
            or shape is None
            or shape != expected
            or not isinstance(offset, int)
            or offset % ALIGN
            or offset < _PREFIX.size
        ):
            raise ShardIndexError(f"{where}: compact index column {name} is malformed")
        count = int(np.prod(shape))
        if offset + count * np.dtype(dtype).itemsize > len(buffer):
            raise ShardIndexError(f"{where}: truncated compact index (column {name})")
        out[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    return out


class CompactShards(ShardTable):
    """The shards of a compact index, read from its (mapped) bytes; see the module doc.

    Nothing here is per shard: a URL is made from its run when asked (a binary search over
    the mapped runs), a count is read from its mapped column.
    """

    def __init__(
        self, buffer: Any, header: dict[str, Any], columns: dict[str, np.ndarray], path: str = ""
    ):
        self._buffer = buffer  # keeps the map alive as long as the views
        self.path = path  # the mapped file (a node-local copy); "": bytes in memory
        self.header = header
        self._columns = columns
        self._n = int(header["num_shards"])
        self._first = columns["run_first"]
        self._bounds = columns["run_text"]
        self._text = columns["text"]

    def __len__(self) -> int:
        return self._n

    def column(self, name: str) -> np.ndarray | None:
        if name in self.header.get("partial", ()):
            return None  # as `ShardIndex.counts`: some shard lacks it
        return self._columns.get(name)

    def holds(self, name: str) -> bool:
        return name in self._columns

    def _piece(self, k: int) -> str:
        a, b = int(self._bounds[k]), int(self._bounds[k + 1])
        return self._text[a:b].tobytes().decode()

    def _run_url(self, r: int, i: int) -> str:
        prefix = self._piece(2 * r)
        width = int(self._columns["run_width"][r])
        if not width:
            return prefix
        number = int(self._columns["run_number"][r]) + i - int(self._first[r])
        return f"{prefix}{str(number).zfill(width)}{self._piece(2 * r + 1)}"

    def url(self, i: int) -> str:
        if not 0 <= i < self._n:
            raise IndexError(f"shard {i} of {self._n}")
        return self._run_url(int(np.searchsorted(self._first, i, side="right")) - 1, i)

    def run_urls(self) -> list[str]:
        """The first URL of every run (what the URL checks look at)."""
        return [self._run_url(r, int(first)) for r, first in enumerate(self._first)]

    def resolved_urls(self, base: str) -> Sequence[str]:
        return ResolvedUrls(self, base)

    def protocols(self, base: str) -> set[str]:
        # the kinds recorded at writing and checked against the runs once per node
        # (`_check`): per rank, a look at the header instead of a pass over the runs
        kinds = self.header.get("url_kinds", [])
        return {url_protocol(join_url(base, "x")) if k == RELATIVE else k for k in kinds}

    def sha256(self, i: int) -> str:
        digest = self._columns["sha256"][i]
        return digest.tobytes().hex() if digest.any() else ""

    def column_sha256(self) -> np.ndarray:
        return self._columns["sha256"]

    def info(self, i: int) -> ShardInfo:
        tokens, targets = self._columns.get("num_tokens"), self._columns.get("num_targets")
        return ShardInfo(
            url=self.url(i),
            num_samples=int(self._columns["num_samples"][i]),
            num_bytes=int(self._columns["num_bytes"][i]),
            sha256=self.sha256(i),
            num_tokens=None if tokens is None or tokens[i] < 0 else int(tokens[i]),
            num_targets=None if targets is None or targets[i] < 0 else int(targets[i]),
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a worker started by forkserver maps the same node-local file (a map is no pickle)
        return _shards_from, (self.path or bytes(self._buffer),)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CompactShards):  # the header holds the JSON's digest and totals
            return self.header == other.header
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class ResolvedUrls(Sequence[str]):
    """Every shard's URL resolved against the index folder, made one at a time when asked."""

    def __init__(self, shards: CompactShards, base: str) -> None:
        self.shards, self.base = shards, base

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.shards)
        if not -n <= i < n:
            raise IndexError(f"shard {i} of {n}")
        return join_url(self.base, self.shards.url(i % n))


def _shards_from(source: str | bytes) -> CompactShards:
    """The shards of a compact index checked before: a mapped file, or its bytes."""
    buffer = map_file(source) if isinstance(source, str) else source
    header = read_header(buffer, str(source) if isinstance(source, str) else "compact index")
    columns = _columns(buffer, header, "compact index")
    return CompactShards(buffer, header, columns, source if isinstance(source, str) else "")


def parse_compact(buffer: Any, index_url: str, *, check: bool = True, path: str = "") -> ShardIndex:
    """The index held by the compact bytes in `buffer` (bytes or a read-only memory map).

    `index_url`: the JSON it stands for (its folder resolves the shard URLs; its protocol
    decides which absolute URLs are allowed). `check`: validate every column and URL (done
    once per node, when the bytes come from the shared filesystem; a node-local copy was
    checked when it was made). `path`: the local file `buffer` maps, if any.
    """
    where = redact_url(companion_url(index_url))
    header = read_header(buffer, where)
    columns = _columns(buffer, header, where)
    shards = CompactShards(buffer, header, columns, path)
    if check:
        _check(shards, header, columns, where, url_protocol(index_url))
    fields = described(header, where)
    return ShardIndex(shards=shards, base_url=base_url_of(index_url), **fields)


def _check(
    shards: CompactShards,
    header: dict[str, Any],
    columns: dict[str, np.ndarray],
    where: str,
    protocol: str,
) -> None:
    """The JSON's checks, over columns (see `parse_index`)."""
    n = len(shards)
    first = columns["run_first"]
    if n and (len(first) == 0 or first[0] != 0 or np.any(np.diff(first) <= 0) or first[-1] >= n):
        raise ShardIndexError(f"{where}: compact index URL runs do not cover the shards")
    bounds = columns["run_text"]
    if np.any(np.diff(bounds) < 0) or bounds[0] != 0 or bounds[-1] != len(columns["text"]):
        raise ShardIndexError(f"{where}: compact index URL texts are malformed")
    if np.any(columns["run_width"] < 0) or np.any(columns["run_number"] < -1):
        raise ShardIndexError(f"{where}: compact index URL runs are malformed")
    try:
        urls = shards.run_urls()
    except UnicodeDecodeError:
        raise ShardIndexError(f"{where}: compact index URL text is not UTF-8") from None
    for r, url in enumerate(urls):
        check_shard_url(url, f"shards[{int(first[r])}].url", where, protocol)
    if header.get("url_kinds") != sorted({url_kind(url) for url in urls}):
        raise ShardIndexError(f"{where}: compact index header misstates its URL kinds")
    totals = header.get("totals")
    if not isinstance(totals, dict):
        raise ShardIndexError(f"{where}: compact index header lacks its totals")
    partial = header.get("partial", [])
    if not isinstance(partial, list) or not set(partial) <= {"num_tokens", "num_targets"}:
        raise ShardIndexError(f"{where}: compact index header is malformed (partial)")
    for name in COUNT_COLUMNS:
        col = columns.get(name)
        if col is None:
            continue
        if n and int(col.min()) < (-1 if name in partial else 0):
            raise ShardIndexError(f"{where}: {name} of a shard is negative")
        if totals.get(name) != int(col[col >= 0].sum()):
            raise ShardIndexError(f"{where}: {name} total does not match its shards")
    samples, sizes = columns["num_samples"], columns["num_bytes"]
    crowded = np.flatnonzero((sizes > 0) & (samples * TAR_BLOCK > sizes))
    if crowded.size:
        i = int(crowded[0])
        raise ShardIndexError(
            f"{where}: shards[{i}].num_samples = {int(samples[i])} cannot fit in its num_bytes "
            f"= {int(sizes[i])} (a sample takes at least {TAR_BLOCK} bytes)"
        )
    tokens, targets = columns.get("num_tokens"), columns.get("num_targets")
    if targets is not None and (tokens is None or np.any((targets >= 0) & (targets > tokens))):
        raise ShardIndexError(f"{where}: num_targets of a shard exceeds its num_tokens")


def map_file(path: str) -> mmap.mmap:
    """A read-only map of a local file (pages shared by every process mapping it)."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
