"""The tar reader against hostile bytes: real shards mutated at random (hypothesis).

Whatever is done to a shard, reading it ends, within a bounded CPU time, in samples or a
`CorruptShardError`: never a hang, never another exception type. The bound is CPU time
(`ITIMER_PROF`), so a parser spinning at 100 % CPU is caught without disturbing
pytest-timeout's wall-clock alarm; each example takes milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpctrain.data.stream import CorruptShardError, open_shard
from hpctrain.data.tar import iter_samples

CPU_LIMIT_S = 5.0  # per example; a real read of these shards takes ~1 ms


def _shard(fmt: int, long: bool) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for i in range(4):
            base = ("d" * 120 + "/") if long else ""
            for ext, data in (("jpg", bytes([i]) * (300 + 200 * i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{base}k{i}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000.5  # fractional: PAX writes a record for it
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


SHARDS = [
    _shard(tarfile.PAX_FORMAT, False),
    _shard(tarfile.PAX_FORMAT, True),
    _shard(tarfile.GNU_FORMAT, True),
    _shard(tarfile.USTAR_FORMAT, False),
]
BAD_NUMBERS = [b"0", b"-1", b"-99", b"1", b"3", b"99999999999999", b"abc", b"", b" 5", b"0x10"]


def _headers(data: bytes) -> list[int]:
    """Offsets of the tar headers of `data` (before mutation)."""
    offsets, pos = [], 0
    while pos + 512 <= len(data) and data[pos : pos + 512] != b"\0" * 512:
        offsets.append(pos)
        size = int(data[pos + 124 : pos + 136].split(b"\0")[0].strip() or b"0", 8)
        pos += 512 + -(-size // 512) * 512
    return offsets


def _fix_checksum(data: bytearray, at: int) -> None:
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(data[at : at + 512])


@st.composite
def hostile_shards(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SHARDS)))
    headers = _headers(bytes(data))
    kind = draw(st.sampled_from(["flip", "truncate", "pax_length", "pax_size", "size_field"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.sampled_from(headers)) + draw(st.integers(0, 511))
            data[at] = draw(st.integers(0, 255))
            if draw(st.booleans()):
                _fix_checksum(data, at - at % 512)  # gets past the checksum to the parser
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data))) :]
    elif kind in ("pax_length", "pax_size"):
        pax = [h for h in headers if data[h + 156 : h + 157] == b"x"]
        if not pax:
            return bytes(data)
        at = draw(st.sampled_from(pax)) + 512
        bad = draw(st.sampled_from(BAD_NUMBERS))
        end = data.index(b"\n", at) + 1
        if kind == "pax_length":  # the first record's length field
            record = data[at:end]
            data[at:end] = bad + record[record.index(b" ") :]
        else:  # a size record's value, the record's length kept consistent
            body = b" size=" + bad + b"\n"
            data[at:end] = b"%d%s" % (len(body) + len(str(len(body))), body)
    else:  # garbage in a size field, with a checksum that matches it
        at = draw(st.sampled_from(headers))
        data[at + 124 : at + 136] = draw(
            st.one_of(
                st.binary(min_size=12, max_size=12),
                st.sampled_from([b"\xff" * 12, b"\x80" + b"\xff" * 11, b"-0000000001\0"]),
            )
        )
        _fix_checksum(data, at)
    return bytes(data)


class CpuLimitExceeded(Exception):
    pass


@contextlib.contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    def expired(_signum: int, _frame: object) -> None:
        raise CpuLimitExceeded(f"more than {seconds} s of CPU: the reader hangs")

    previous = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def read_all(url: str, views: bool) -> list[tuple[int, str, dict[str, bytes]]]:
    with open_shard(url, max_retries=0, allow_pipe=True) as f:
        return [
            (i, k, {e: bytes(v) for e, v in m.items()}) for i, k, m in iter_samples(f, views=views)
        ]


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=hostile_shards(), reader=st.sampled_from(["file", "memory", "pipe"]), views=st.booleans()
)
def test_hostile_shards_end_in_samples_or_a_corrupt_shard_error(where, data, reader, views):
    path = where / "shard.tar"
    path.write_bytes(data)
    if reader == "file":
        url = str(path)  # a local file: sizes are checked against its length
    elif reader == "memory":
        url = "memory://fuzz/shard.tar"  # a seekable fsspec file
        fsspec.filesystem("memory").pipe_file(url, data)
    else:
        url = f"pipe:cat {path}"  # a stream: no length, no seeking
    with cpu_limit(CPU_LIMIT_S):
        try:
            got = read_all(url, views)
        except CorruptShardError:
            return
    assert all(isinstance(key, str) for _i, key, _m in got)


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_every_bad_pax_length_is_a_corrupt_shard(tmp_path, bad):
    """The hang of issue #14: a PAX record of length <= 0 looped for ever."""
    data = bytearray(SHARDS[0])
    at = next(h for h in _headers(bytes(data)) if data[h + 156 : h + 157] == b"x") + 512
    end = data.index(b"\n", at) + 1
    data[at:end] = bad + data[at:end][data[at:end].index(b" ") :]
    (tmp_path / "x.tar").write_bytes(bytes(data))
    with cpu_limit(CPU_LIMIT_S), pytest.raises(CorruptShardError, match="PAX record"):
        read_all(str(tmp_path / "x.tar"), views=True)
