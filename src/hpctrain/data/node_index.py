"""Opening an index in the form a rank should read: the compact companion, once per node.

`load_index(json_url)` is what `open_index` calls for an `index.json`. With its compact
companion there (`index.compact`, `hpctrain.data.compact`), the first rank of a node to arrive
copies it into node-local memory (`$HPCTRAIN_NODE_LOCAL_DIR`, which job scripts set from the
cluster profile's `node_local_dir`; default `/dev/shm`, else `$TMPDIR`), under a lock file
there; every rank of the node then maps that copy read-only. So a node reads one compact index
from the shared filesystem whatever its ranks, and a rank reads of it only the pages its plan
touches: the count column and the URLs of its own shards.

Before copying, the companion is checked against its JSON. A `stat` of both files (size and
modification time) keys the node-local copy; the JSON must have the size the companion records
and be no newer than the companion. Otherwise (a JSON edited or copied since, or a filesystem
without times) the JSON is read once, on that node, and its sha256 decides. A companion that
does not match is re-derived from the JSON and written back, or, where that folder cannot be
written, refused in one line: never used silently. (Not caught: an older JSON of the same size
put back with its old time, `cp -p` of a previous version over it; `hpctrain index compact`
after such a change.)

`HPCTRAIN_INDEX_FORM` chooses the form: `auto` (default: the companion when there is one),
`json` (never the companion), `compact` (the companion, derived from the JSON when missing).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.data.compact import (
    COMPACT_SUFFIX,
    CompactShards,
    JsonStamp,
    compact_bytes,
    companion_url,
    header_stamp,
    json_sha256,
    map_file,
    parse_compact,
    read_header,
)
from hpctrain.data.index import (
    ShardIndex,
    ShardIndexError,
    index_to_bytes,
    parse_index,
    redact_url,
)
from hpctrain.files import write_atomic

log = logging.getLogger("hpctrain.data")

FORM_ENV = "HPCTRAIN_INDEX_FORM"
NODE_LOCAL_ENV = "HPCTRAIN_NODE_LOCAL_DIR"
INDEX_FORMS = ("auto", "json", "compact")
PRUNE_AFTER_S = 86400.0  # node-local copies unused this long are removed (by the next copier)
HINT_BYTES = 16 << 20  # an index.json this large without a companion gets a hint
# An index.json this large says when its read starts: parsing it takes seconds (~50 MB/s of
# JSON on one core here), the copy to a node's memory as long again.
SAY_READ_BYTES = 16 << 20


def index_form(form: str | None = None) -> str:
    chosen = form or os.environ.get(FORM_ENV) or "auto"
    if chosen not in INDEX_FORMS:
        raise ShardIndexError(f"{FORM_ENV}={chosen!r}: expected one of {', '.join(INDEX_FORMS)}")
    return chosen


def json_of(compact_url: str) -> str:
    """The JSON a companion stands for: `.../index.compact` -> `.../index.json`."""
    return compact_url[: -len(COMPACT_SUFFIX)] + ".json"


@dataclass(frozen=True)
class _Stat:
    size: int
    mtime: float | None  # seconds; None: the filesystem gives no time to compare


def _stat(fs: Any, path: str) -> _Stat:
    if isinstance(fs, LocalFileSystem):
        st = os.stat(path)
        return _Stat(st.st_size, st.st_mtime_ns / 1e9)
    info = fs.info(path)
    mark = next((info[k] for k in ("LastModified", "last_modified", "mtime") if info.get(k)), None)
    if isinstance(mark, datetime.datetime):
        mark = mark.timestamp()
    return _Stat(int(info.get("size") or 0), float(mark) if isinstance(mark, int | float) else None)


def _trusted(stamp: JsonStamp, json_stat: _Stat, compact_stat: _Stat) -> bool:
    """The companion stands for the JSON as it is, by `stat` alone: the JSON has the size it
    was derived from and has not changed since the companion was written."""
    if json_stat.mtime is None or compact_stat.mtime is None:
        return False
    return json_stat.size == stamp.size and json_stat.mtime <= compact_stat.mtime


def load_index(
    json_url: str, storage_options: dict[str, Any] | None = None, *, form: str | None = None
) -> ShardIndex:
    """The index `json_url` names, read in the chosen form (the module doc)."""
    chosen = index_form(form)
    if chosen == "json":
        return _read_json(json_url, storage_options)
    fs, path = fsspec.core.url_to_fs(json_url, **(storage_options or {}))
    compact_path = companion_url(path)
    try:
        json_stat = _stat(fs, path)
        compact_stat = _stat(fs, compact_path) if fs.exists(compact_path) else None
    except FileNotFoundError:
        raise ShardIndexError(f"{redact_url(json_url)}: index not found") from None
    except OSError as exc:
        raise ShardIndexError(f"{redact_url(json_url)}: cannot read index: {exc}") from None
    if json_stat.size >= SAY_READ_BYTES:
        log.info(
            "reading the index %s (%d MB%s)", redact_url(json_url), json_stat.size >> 20,
            ", its compact form once per node" if compact_stat is not None else "",
        )  # fmt: skip
    if compact_stat is None and chosen == "auto":
        if json_stat.size >= HINT_BYTES:
            log.warning(
                "%s: %d MB and no %s beside it: every rank reads and parses it; "
                "`hpctrain index compact %s` writes the compact form, read once per node",
                redact_url(json_url), json_stat.size >> 20, os.path.basename(compact_path),
                redact_url(json_url),
            )  # fmt: skip
        return _read_json(json_url, storage_options)
    source = _Source(json_url, fs, path, compact_path, json_stat, compact_stat)
    key = hashlib.sha256(
        f"{json_url}\n{json_stat}\n{compact_stat}\n{os.getuid()}".encode()
    ).hexdigest()[:40]
    folder = node_local_folder()
    local = os.path.join(folder, f"index-{key}{COMPACT_SUFFIX}")
    with _locked(local + ".lock"):
        if not _usable(local):
            _copy_to_node(source, local)
            _prune(folder, keep=local)
        with contextlib.suppress(OSError):
            os.utime(local)  # in use: not pruned
        buffer = map_file(local)
    return parse_compact(buffer, json_url, check=False, path=local)  # checked when copied


def _read_json(json_url: str, storage_options: dict[str, Any] | None) -> ShardIndex:
    raw = _read(json_url, storage_options)
    return _parse_json(raw, json_url)


def _read(
    url: str, storage_options: dict[str, Any] | None = None, fs: Any = None, path: str = ""
) -> bytes:
    """The bytes at `url` (or at `path` of `fs`; errors name `url`)."""
    try:
        if fs is not None:
            return bytes(fs.cat_file(path))
        with fsspec.open(url, "rb", **(storage_options or {})) as f:
            return bytes(f.read())
    except FileNotFoundError:
        raise ShardIndexError(f"{redact_url(url)}: index not found") from None
    except OSError as exc:
        raise ShardIndexError(f"{redact_url(url)}: cannot read index: {exc}") from None


def _parse_json(raw: bytes, json_url: str) -> ShardIndex:
    try:
        data = json.loads(raw)
    except ValueError:
        raise ShardIndexError(f"{redact_url(json_url)}: not valid JSON") from None
    return parse_index(data, json_url)


@dataclass(frozen=True)
class _Source:
    json_url: str
    fs: Any
    json_path: str
    compact_path: str
    json_stat: _Stat
    compact_stat: _Stat | None


def _copy_to_node(source: _Source, local: str) -> None:
    """Read the companion from the shared filesystem (derive it when stale or missing), check
    it, and leave it at `local` (written under a temporary name, then renamed)."""
    where = redact_url(companion_url(source.json_url))
    raw = b""
    if source.compact_stat is not None:
        raw = _read(where, fs=source.fs, path=source.compact_path)
        stamp = header_stamp(read_header(raw, where), where)
        if not _trusted(stamp, source.json_stat, source.compact_stat):
            json_raw = _read(source.json_url, fs=source.fs, path=source.json_path)
            if json_sha256(json_raw) != stamp.sha256:
                raw = _derive(source, json_raw, stale=True)
            else:  # the same JSON under another mark (a copy): the companion holds
                log.info("%s matches its JSON by digest (the JSON was copied or touched)", where)
    else:
        json_raw = _read(source.json_url, fs=source.fs, path=source.json_path)
        raw = _derive(source, json_raw, stale=False)
    parse_compact(raw, source.json_url, check=True)
    folder, name = os.path.split(local)
    temp = ""
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(temp, local)
    except OSError as exc:  # a full /dev/shm: say where, and what to set
        raise ShardIndexError(
            f"{folder}: cannot hold a copy of {where} ({len(raw) >> 20} MB): {_reason(exc)}; "
            f"set {NODE_LOCAL_ENV} to a node-local folder with room (the profile's "
            "node_local_dir)"
        ) from None
    finally:
        if temp and os.path.lexists(temp):
            os.unlink(temp)


def _derive(source: _Source, json_raw: bytes, *, stale: bool) -> bytes:
    """The companion made from the JSON, written beside it where possible; a stale one that
    cannot be replaced is refused (its folder is read-only)."""
    index = _parse_json(json_raw, source.json_url)
    stamp = JsonStamp(json_sha256(json_raw), len(json_raw))
    raw = compact_bytes(index, stamp)
    where = redact_url(companion_url(source.json_url))
    try:
        _write(source.fs, source.compact_path, raw)
    # each filesystem refuses a write its own way (OSError, NotImplementedError, aiohttp's
    # ClientResponseError for an HTTP server without PUT, botocore's errors): all say the same
    except Exception as exc:
        if stale:
            raise ShardIndexError(
                f"{where} does not match {os.path.basename(source.json_path)} (it was derived "
                f"from another version) and cannot be replaced here ({_reason(exc)}): run "
                f"`hpctrain index compact` where it is writable, or remove it"
            ) from None
        log.info("%s: derived on this node (not written beside the JSON: %s)", where, _reason(exc))
        return raw
    if stale:
        log.warning("%s did not match its JSON: derived again and replaced", where)
    else:
        log.debug("%s derived from its JSON", where)
    return raw


def _write(fs: Any, path: str, raw: bytes) -> None:
    if isinstance(fs, LocalFileSystem):
        write_atomic(path, raw, durable=True)
    else:  # one PUT (atomic on object stores), with the index's own storage options
        fs.pipe_file(path, raw)


@dataclass(frozen=True)
class Companion:
    """What `write_companion` wrote."""

    url: str  # the compact index
    num_shards: int
    num_runs: int  # URL runs (1: every shard name follows one pattern)
    num_bytes: int  # of the compact index
    json_bytes: int  # of the JSON it stands for


def companion_problem(json_url: str) -> str | None:
    """What is wrong with the companion of `json_url` (None: it matches, or there is none):
    `hpctrain inspect` compares the two forms whole, entry by entry."""
    fs, path = fsspec.core.url_to_fs(json_url)
    where = redact_url(companion_url(json_url))
    if not fs.exists(companion_url(path)):
        return None
    json_raw = _read(json_url, fs=fs, path=path)
    try:
        compact = parse_compact(_read(where, fs=fs, path=companion_url(path)), json_url)
    except ShardIndexError as exc:
        return str(exc)
    assert isinstance(compact.shards, CompactShards)
    if header_stamp(compact.shards.header, where).sha256 != json_sha256(json_raw):
        return (
            f"{where} does not match {os.path.basename(path)} (derived from another version); "
            "run `hpctrain index compact` to derive it again"
        )
    if index_to_bytes(compact) != index_to_bytes(_parse_json(json_raw, json_url)):
        return f"{where} holds other shards than {os.path.basename(path)} (its digest matches)"
    return None


def write_companion_of(index: ShardIndex, json_url: str, json_raw: bytes) -> None:
    """Write the companion of an index just written as `json_raw` at `json_url` (what
    `hpctrain convert` commits: no second read of the JSON)."""
    fs, path = fsspec.core.url_to_fs(json_url)
    stamp = JsonStamp(json_sha256(json_raw), len(json_raw))
    _write(fs, companion_url(path), compact_bytes(index, stamp))


def write_companion(json_url: str, storage_options: dict[str, Any] | None = None) -> Companion:
    """Derive `index.compact` from `json_url` and write it beside it (`hpctrain index compact`,
    and `hpctrain convert` after each index it commits)."""
    fs, path = fsspec.core.url_to_fs(json_url, **(storage_options or {}))
    json_raw = _read(json_url, fs=fs, path=path)
    index = _parse_json(json_raw, json_url)
    raw = compact_bytes(index, JsonStamp(json_sha256(json_raw), len(json_raw)))
    url = companion_url(json_url)
    try:
        _write(fs, companion_url(path), raw)
    except (OSError, NotImplementedError) as exc:
        raise ShardIndexError(f"{redact_url(url)}: cannot write: {_reason(exc)}") from None
    runs = int(read_header(raw, url)["num_runs"])
    return Companion(url, index.num_shards, runs, len(raw), len(json_raw))


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def node_local_folder() -> str:
    """This user's folder for node-local index copies (created 0700; refused when another
    user owns it or others may write it: a planted copy would be trusted)."""
    configured = os.environ.get(NODE_LOCAL_ENV, "")
    root = os.path.expandvars(configured)  # '$TMPDIR': this node's, expanded here
    if "$" in root:
        log.warning(
            "%s=%s: a variable is not set here; using the default", NODE_LOCAL_ENV, configured
        )
        root = ""
    if not root:
        shm = "/dev/shm"
        root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    folder = os.path.join(root, f"hpctrain-index-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        raise ShardIndexError(
            f"{folder}: cannot hold node-local index copies ({_reason(exc)}); set "
            f"{NODE_LOCAL_ENV} to a writable node-local folder"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ShardIndexError(
            f"{folder}: not a folder of this user's alone (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}); node-local index copies are not trusted there"
        )
    return folder


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path` (created): the ranks of a node take turns, the first copies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _usable(local: str) -> bool:
    try:
        st = os.lstat(local)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _prune(folder: str, keep: str) -> None:
    """Remove node-local copies unused for `PRUNE_AFTER_S` (each under its own lock, taken
    without waiting: a copy being opened is left alone)."""
    now = time.time()
    for entry in os.scandir(folder):
        path = entry.path
        if not entry.name.endswith(COMPACT_SUFFIX) or path == keep:
            continue
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime < PRUNE_AFTER_S:
                continue
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if now - os.stat(path).st_mtime >= PRUNE_AFTER_S:
                    os.unlink(path)
                    os.unlink(path + ".lock")
            finally:
                os.close(fd)
