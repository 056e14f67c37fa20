"""Reading shards: a shard as a fsspec/`pipe:` byte stream with retries (`ShardStream`).

Why not webdataset's readers: webdataset 1.0.2 does not open URLs through fsspec, its tar
iteration (`tarfile` based) cannot skip members without reading them, and one `ReadError`
ends the loader (webdataset#142). Here a shard is a byte stream that

- reopens after a transient fault (connection reset, 5xx, short body) with exponential
  backoff, at the byte offset already read: a `Range` request for HTTP, `seek` for seekable
  filesystems (file, s3, gs), re-reading and discarding for `pipe:` commands;
- fails at once on 404/403 (`FileNotFoundError`/`PermissionError`): retrying cannot help;
- skips samples by seeking past their members without reading (local disk, s3), or by
  discarding bytes without decoding them (HTTP streams, pipes);
- runs `pipe:` commands only when its caller says that the command came from the user's own
  config or command line (`allow_pipe`, from `data.allow_pipe`): never from an index entry.

The tar members and samples inside a shard are parsed by `hpctrain.data.tar`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hpctrain.data.index import redact_url
from hpctrain.errors import DataError, TransientDataError

BLOCK = 512
READ_CHUNK = 1 << 20  # what a non-seekable stream reads ahead of what it was asked for
# what a member's read of a seekable file takes beyond its data and the next header: a small
# member that follows (a label, a caption) and the header after it (see `read_member`)
MEMBER_AHEAD = 2 * BLOCK
MAX_RAW_READ = 64 << 20  # one read's most: a huge size field must not allocate it at once


class ShardReadError(DataError, ValueError):
    """A shard that cannot be read: missing, forbidden, corrupt, or still failing after retries.

    The message names the shard URL (credentials stripped).
    """

    def __init__(self, url: str, reason: str | None = None) -> None:
        # one-argument form: a whole message (how exceptions are rebuilt by default)
        super().__init__(url if reason is None else f"{redact_url(url)}: {reason}")
        self.url = redact_url(url) if reason is not None else ""
        self.reason = reason or ""

    def __reduce__(self) -> tuple[Any, ...]:
        # from a loader worker to the training process with its url and reason intact
        if self.url:
            return (type(self), (self.url, self.reason))
        return (type(self), self.args)


class ShardUnavailableError(ShardReadError, TransientDataError):
    """A shard whose reads failed with faults a retry could cure (a reset connection, a 5xx,
    a timeout) until its retries ran out: an outage of the store, not the shard's fault.
    Exit 8, retried by the job script (a missing, forbidden or damaged shard is not)."""


class TransientReadError(OSError):
    """A read failure worth retrying (short body, reset connection, 5xx)."""


def is_transient(exc: BaseException) -> bool:
    """True for faults that a retry can cure; 404/403 and corrupt data are not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    # aiohttp.ClientPayloadError / ServerDisconnectedError... derive from aiohttp.ClientError,
    # botocore's from BotoCoreError; import-free check keeps aiohttp/botocore optional.
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"ClientError", "BotoCoreError", "IncompleteReadError", "ReadTimeoutError"})


@dataclass
class ReadStats:
    """Counters of one worker's shard reads (summed over workers by the loader)."""

    retries: int = 0
    shards_failed: int = 0
    samples_lost: int = 0
    samples_skipped: int = 0  # unusable samples (`SampleError`) under on_error=skip
    bytes_read: int = 0
    bytes_skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "retries": self.retries,
            "shards_failed": self.shards_failed,
            "samples_lost": self.samples_lost,
            "samples_skipped": self.samples_skipped,
            "bytes_read": self.bytes_read,
            "bytes_skipped": self.bytes_skipped,
        }


class ShardStream:
    """A shard's bytes, read sequentially, that survives transient faults.

    Args:
        url: local path, fsspec URL (`http(s)://`, `s3://`, `file://`...) or `pipe:COMMAND`.
        size: the shard's size in bytes when known (from the index; 0: unknown). Reaching EOF
            before it counts as a short body and is retried.
        max_retries: reopen attempts after transient faults, per shard.
        backoff_s: first wait before a retry; doubles each time (capped at 5 s).
        stats: counters to update.
        storage_options: passed to fsspec (credentials, endpoint_url...).
        allow_pipe: run a `pipe:` URL's command. Only for URLs from the user's own config or
            command line (`data.allow_pipe`), never for URLs read from an index or a file.
    """

    def __init__(
        self,
        url: str,
        *,
        size: int = 0,
        max_retries: int = 5,
        backoff_s: float = 0.05,
        stats: ReadStats | None = None,
        storage_options: dict[str, Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        allow_pipe: bool = False,
    ) -> None:
        if url.startswith("pipe:") and not allow_pipe:
            raise PipeRefusedError(url)
        self.url = url
        self.size = size
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.stats = stats if stats is not None else ReadStats()
        self.storage_options = storage_options or {}
        self.raw_pos = 0  # bytes received from the file
        self._buf = b""  # read ahead of the caller; `_buf_pos` is the first unread byte
        self._buf_pos = 0
        self.retries_left = max_retries
        self._sleep = sleep
        self._file: Any = None
        self.length: int | None = None  # the file's size where the filesystem tells it
        self._proc: subprocess.Popen[bytes] | None = None
        self._seekable = False
        self._local = False  # a local file: a short read is a truncated file, not a fault
        self._open_at(0)

    # -- opening -------------------------------------------------------------------------

    def _open_at(self, offset: int) -> None:
        """(Re)open the shard positioned at `offset`; errors propagate to the retry loop."""
        self._close_file()
        url = self.url
        if url.startswith("pipe:"):
            self._proc = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE)
            assert self._proc.stdout is not None
            self._file = self._proc.stdout
            self._seekable = False
            self._discard(offset)
        elif url.startswith(("http://", "https://")):
            fs = fsspec.filesystem(url.split("://", 1)[0], **self.storage_options)
            headers = {"Range": f"bytes={offset}-"} if offset else {}
            # block_size=0: stream (fsspec's default needs range support, fails without it);
            # a size stops fsspec from sending a HEAD request first (one more round trip).
            f = fs.open(url, "rb", block_size=0, size=self.size or 1, headers=headers)
            self._file = f
            self._seekable = False
            status = getattr(getattr(f, "r", None), "status", 200)
            if offset and status != 206:  # the server ignored the range: skip what we have
                self._discard(offset)
        else:
            fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
            self._seekable = True
            self._local = isinstance(fs, LocalFileSystem)
            if self._local:
                # Read, never memory-mapped: a mapped shard truncated while it is read (a
                # copy in progress, rsync --inplace, a quota) raises SIGBUS in whatever
                # touches the lost pages (the decoder), which kills the process without a
                # traceback, and no Python handler can resume after it. A read of a shrunk
                # file returns short instead: a `CorruptShardError`/`ShardReadError` that
                # `data.on_error` handles. Unbuffered: each member is read straight into a
                # bytes object of its own, with the next header (`read_member`): one copy
                # from the page cache, where a buffered reader would copy once more.
                self._file = open(path, "rb", buffering=0)  # noqa: SIM115  (_close_file)
                self.length = os.fstat(self._file.fileno()).st_size
            else:
                self._file = fs.open(path, "rb")
                size = getattr(self._file, "size", None)
                self.length = size if isinstance(size, int) else None
            if offset:
                self._file.seek(offset)
        self.raw_pos = offset
        self._buf, self._buf_pos = b"", 0

    def _discard(self, n: int) -> None:
        while n > 0:
            chunk = self._file.read(min(n, 1 << 20))
            if not chunk:
                raise TransientReadError(f"stream ended while skipping {n} bytes")
            n -= len(chunk)

    def _close_file(self) -> None:
        if self._file is not None:
            # closing a broken connection may fail again; there is nothing left to save
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        self._close_file()

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------

    def _retry(self, exc: BaseException) -> None:
        """Reopen at the current offset after a transient fault, or raise `ShardReadError`."""
        if not is_transient(exc):
            raise ShardReadError(self.url, _describe(exc)) from exc
        if self.retries_left <= 0:
            raise ShardUnavailableError(
                self.url, f"still failing after {self.max_retries} retries: {_describe(exc)}"
            ) from exc
        attempt = self.max_retries - self.retries_left
        self.retries_left -= 1
        self.stats.retries += 1
        self._sleep(min(self.backoff_s * (2**attempt), 5.0))
        try:
            self._open_at(self.raw_pos)
        except Exception as again:
            self._retry(again)

    @property
    def pos(self) -> int:
        """Bytes of the shard consumed by the caller (the buffer's unread part excluded)."""
        return self.raw_pos - (len(self._buf) - self._buf_pos)

    def _read_raw(self, n: int) -> bytes:
        """Up to `n` bytes from the file (b"" at the real end), retrying transient faults."""
        while True:
            try:
                chunk = self._file.read(min(n, MAX_RAW_READ))
                if not chunk:
                    self._check_eof()
            except CorruptShardError:
                raise  # a local file cut short: no retry makes it longer
            except Exception as exc:
                self._retry(exc)
                continue
            self.raw_pos += len(chunk)
            self.stats.bytes_read += len(chunk)
            return chunk

    def read(self, n: int) -> bytes:
        """Exactly `n` bytes, or fewer only at the real end of the shard."""
        data = self.read_view(n)
        return data if isinstance(data, bytes) else bytes(data)

    def read_view(self, n: int) -> bytes | memoryview:
        """As `read`; a subclass may return a memoryview where that saves a copy.

        A seekable file is read exactly as asked: reading ahead would read what `skip` is
        meant to seek past, and a local file's reads are cheap system calls (an unbuffered
        read of a member's bytes: one copy from the page cache, none after it). A stream
        (HTTP, `pipe:`) reads at least `READ_CHUNK` at a time and serves small reads (tar
        headers) from that buffer: each read of an fsspec HTTP stream is a round trip to
        its event-loop thread.
        """
        if n <= 0:
            # an empty member: reading 0 bytes from the file would look like its end, which
            # is a short body when the index gives the shard's size
            return b""
        if self._seekable and self._buf_pos >= len(self._buf):  # nothing buffered
            chunk = self._read_raw(n)
            return chunk if len(chunk) == n or not chunk else self._read_more(n, chunk)
        pos = self._buf_pos
        end = pos + n
        if end <= len(self._buf):
            self._buf_pos = end
            return self._buf[pos:end]
        return self._read_more(n)

    def _read_more(self, n: int, first: bytes = b"") -> bytes:
        """`read_view` when the buffer does not hold all `n` bytes (`first`: what a read of
        a seekable file gave, short)."""
        rest = first or self._buf[self._buf_pos :]
        parts = [rest] if rest else []
        want = n - len(rest)
        self._buf, self._buf_pos = b"", 0
        while want > 0:
            if self._seekable or want >= READ_CHUNK:
                chunk = self._read_raw(want)
            else:
                chunk = self._read_raw(READ_CHUNK)
                if len(chunk) > want:
                    self._buf, self._buf_pos = chunk, want
                    chunk = chunk[:want]
            if not chunk:
                break
            parts.append(chunk)
            want -= len(chunk)
        if not parts:
            return b""
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_member(self, size: int, padded: int, views: bool = False) -> bytes | memoryview:
        """A tar member's `size` data bytes, consuming its `padded` bytes (data + padding).

        From a seekable file, one read takes the data, the next header and `MEMBER_AHEAD`
        bytes more: a sample of an image and a small label (or caption) costs one system
        call instead of two, and what is read beyond the member is at most a few blocks, so
        skipped samples are still seeked past, not read. `views=True`: the data may be a
        memoryview of that read (no copy).

        Raises:
            CorruptShardError: the shard ends before the data does.
        """
        pos = self._buf_pos
        buf = self._buf
        if pos + padded <= len(buf):  # in what was read ahead
            self._buf_pos = pos + padded
            return memoryview(buf)[pos : pos + size] if views else buf[pos : pos + size]
        if self._seekable:
            if pos < len(buf):  # partly read ahead: read it whole, from where it starts
                self._unread()
            # The bytes object is the member's own but for the few blocks after it (the
            # header is copied out of it), so holding it keeps little else alive.
            data = self._read_raw(padded + BLOCK + MEMBER_AHEAD)
            if len(data) > padded:
                self._buf, self._buf_pos = data, padded
            elif data and len(data) < padded:  # a short read: read the rest as asked
                data += self.read(padded - len(data))
        else:
            data = self.read(padded)
        if len(data) < size:
            raise CorruptShardError("truncated tar member")
        if len(data) == size:
            return data
        return memoryview(data)[:size] if views else data[:size]

    def _unread(self) -> None:
        """Forget what a seekable file has read ahead: the file is positioned at `pos`."""
        target = self.pos
        self.stats.bytes_read -= self.raw_pos - target
        self._buf, self._buf_pos = b"", 0
        try:
            self._file.seek(target)
        except Exception as exc:
            self.raw_pos = target
            self._retry(exc)  # reopened at raw_pos
            return
        self.raw_pos = target

    def skip_member(self, size: int, padded: int) -> None:
        """Skip a tar member's `padded` bytes unread (`CorruptShardError`: the shard ends
        before its data does)."""
        if self.skip(padded) > padded - size:
            raise CorruptShardError("truncated tar member")

    def _check_eof(self) -> None:
        """At EOF: a short body (before the index's size, or a failed pipe) is a fault."""
        if self._proc is not None:
            code = self._proc.wait()
            if code != 0:
                raise TransientReadError(f"pipe command exited with status {code}")
        if self.size and self.raw_pos < self.size:
            if self._local:  # a file, not a connection: its end is where it was cut
                length = os.fstat(self._file.fileno()).st_size  # now, not when opened
                raise CorruptShardError(
                    f"truncated: the file holds {length} bytes, the index says "
                    f"{self.size} (cut short by a copy or a write that did not finish?)"
                )
            raise TransientReadError(f"body ended at byte {self.raw_pos} of {self.size}")

    def available(self) -> int | None:
        """Bytes left after `pos` where the file's size is known, else None."""
        return None if self.length is None else max(0, self.length - self.pos)

    def skip(self, n: int) -> int:
        """Advance `n` bytes without returning them (a seek where the file allows).

        Returns how many of them were not there (the shard ended first): 0 normally.
        """
        if n <= 0:
            return 0
        self.stats.bytes_skipped += n
        buffered = len(self._buf) - self._buf_pos
        if n <= buffered:
            self._buf_pos += n
            return 0
        n -= buffered
        self._buf, self._buf_pos = b"", 0
        if self._seekable:
            target = self.raw_pos + n
            try:
                self._file.seek(target)
            except Exception as exc:
                self._retry(exc)  # reopened at raw_pos; seek again there
                self._file.seek(target)
            self.raw_pos = target
            return 0 if self.length is None else max(0, target - self.length)
        while n > 0:
            chunk = self._read_raw(min(n, 1 << 20))
            if not chunk:
                return n
            self.stats.bytes_read -= len(chunk)
            n -= len(chunk)
        return 0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, PermissionError):
        return "permission denied"
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return f"HTTP {status}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CorruptShardError(DataError, ValueError):
    """Bytes that are not a tar archive (bad checksum, truncated member, malformed header)."""


class PipeRefusedError(ShardReadError):
    """A `pipe:` shard where no command may run: from an index, or without `data.allow_pipe`.

    Names the command's program only (the rest may hold a token).
    """

    def __init__(self, url: str, reason: str | None = None) -> None:
        if reason is None:  # rebuilt from its message after crossing a process boundary
            if not url.startswith("pipe:"):
                super().__init__(url)
                return
            reason = PIPE_RULE
        super().__init__(pipe_label(url), reason)


PIPE_RULE = (
    "pipe: shards run a shell command; they are read only with data.allow_pipe: true and a "
    "shard pattern given in data.train/data.val (never from an index)"
)


def pipe_label(url: str) -> str:
    """`pipe:curl -s https://...` -> `pipe:curl ...`: a command named without its arguments."""
    words = url[5:].split()
    return f"pipe:{words[0]} ..." if words else "pipe:"


def open_shard(
    url: str,
    *,
    size: int = 0,
    max_retries: int = 5,
    stats: ReadStats | None = None,
    storage_options: dict[str, Any] | None = None,
    backoff_s: float = 0.05,
    allow_pipe: bool = False,
) -> ShardStream:
    """Open a shard for sequential reading (`ShardReadError` when it cannot be opened).

    `allow_pipe`: see `ShardStream`; a `pipe:` URL without it raises `PipeRefusedError`.
    """
    if url.startswith("pipe:") and not allow_pipe:
        raise PipeRefusedError(url)
    try:
        return _open_with_retries(
            url, size, max_retries, stats, storage_options, backoff_s, allow_pipe
        )
    except ShardReadError:
        raise
    except Exception as exc:
        raise ShardReadError(url, _describe(exc)) from exc


def _open_with_retries(
    url: str,
    size: int,
    max_retries: int,
    stats: ReadStats | None,
    storage_options: dict[str, Any] | None,
    backoff_s: float,
    allow_pipe: bool,
) -> ShardStream:
    attempt = 0
    while True:
        try:
            return ShardStream(
                url,
                size=size,
                max_retries=max_retries,
                stats=stats,
                storage_options=storage_options,
                backoff_s=backoff_s,
                allow_pipe=allow_pipe,
            )
        except Exception as exc:
            if not is_transient(exc):
                raise ShardReadError(url, _describe(exc)) from exc
            if attempt >= max_retries:
                reason = f"still failing after {attempt} retries: {_describe(exc)}"
                raise ShardUnavailableError(url, reason) from exc
            if stats is not None:
                stats.retries += 1
            time.sleep(min(backoff_s * (2**attempt), 5.0))
            attempt += 1
