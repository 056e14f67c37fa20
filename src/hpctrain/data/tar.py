"""A lean tar reader: the members and samples of a shard's byte stream (`ShardStream`).

Tar format handled: USTAR, GNU long names (`L`), PAX headers (`x`; `g` ignored). Samples are
consecutive members sharing a key (the member path up to the first dot of its base name),
the WebDataset convention. Every way a header can be malformed (bad numbers, PAX records of
impossible lengths, sizes past the end of the shard) is a `CorruptShardError`: the parser
never loops, reads more than the shard holds, or raises anything else on hostile bytes.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hpctrain.data.stream import BLOCK, CorruptShardError, ShardStream

ZERO_BLOCK = bytes(BLOCK)
MAX_META_BYTES = 1 << 20  # a PAX header or GNU long name beyond this is not a real one


@dataclass
class Member:
    name: str
    size: int


_DECIMAL = re.compile(r"[0-9]+", re.ASCII)
# a numeric header field as tar writers write it: octal digits (spaces before), then NULs or
# spaces; anything else takes `_parse_number`'s slower path, whose result is the same
_OCTAL = re.compile(rb" *([0-7]+)[ \0]*")
# the fields of a tar header that are read: name, size, checksum, type, magic, USTAR prefix
_HEADER = struct.Struct("100s24x12s12x8sc100x6s82x155s12x")
_META_KINDS = (b"x", b"L", b"g")  # PAX header, GNU long name, PAX global header
_FILE_KINDS = (b"0", b"\0", b"7")  # regular files (7: contiguous)


def header_checksum(header: bytes) -> int:
    """The tar checksum of a 512-byte header: the sum of its bytes, the checksum field
    counted as 8 spaces.

    zlib's Adler-32 sums the bytes in C (its low half is 1 + the sum mod 65521); a half
    header sums to at most 256 x 255 = 65,280, below the modulus, so it is exact. Python's
    `sum()` over the bytes cost 5x as much (two headers per sample; BENCHMARKS.md).
    """
    # each low half is 1 + the sum of its bytes (the checksum field's 8 too: < 65521)
    adler = zlib.adler32
    low = (adler(header[:256]) & 0xFFFF) + (adler(header[256:]) & 0xFFFF) - 2
    return low - ((adler(header[148:156]) & 0xFFFF) - 1) + 8 * 32


def _parse_number(field_: bytes, what: str, at: int) -> int:
    """A header's numeric field: octal text, or GNU base-256 for sizes >= 8 GiB."""
    usual = _OCTAL.fullmatch(field_)  # one C call for the usual form
    if usual is not None:
        return int(usual[1], 8)
    if field_ and field_[0] & 0x80:
        if field_[0] != 0x80:  # 0xff: a negative base-256 number
            raise CorruptShardError(f"negative tar {what} in the header at byte {at}")
        return int.from_bytes(field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.translate(None, b"01234567"):  # int(text, 8) would take "+1", "0o1", "1_0"
        raise CorruptShardError(f"tar {what} {text[:20]!r} is not a number at byte {at}")
    return int(text, 8)


def _parse_pax(data: bytes, at: int) -> dict[str, str]:
    """PAX records, `"<length> <key>=<value>\n"` each; any other shape is corrupt (a length
    of 0 or less once made this loop for ever)."""
    out = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 20)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise CorruptShardError(f"malformed PAX record at byte {at + pos}")
        end = pos + int(digits)
        if end <= space + 1 or end > len(data) or data[end - 1 : end] != b"\n":
            raise CorruptShardError(
                f"PAX record of impossible length {int(digits)} at byte {at + pos}"
            )
        key, sep, value = data[space + 1 : end - 1].partition(b"=")
        if not sep:
            raise CorruptShardError(f"PAX record without '=' at byte {at + pos}")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos = end
    return out


def _check_size(stream: ShardStream, size: int, at: int) -> None:
    """A member that cannot fit in what is left of the shard, known before reading it."""
    left = stream.available()
    if left is not None and size > left:
        raise CorruptShardError(
            f"truncated tar member: header at byte {at} gives {size} bytes, {left} are left"
        )


def tar_entries(stream: ShardStream) -> Iterator[tuple[str, int, int]]:
    """Regular-file members of a tar stream as (name, size, padded size), the stream left at
    each member's data. The caller consumes exactly `padded` bytes of it (`read_member` or
    `skip`) before asking for the next one.

    Raises:
        CorruptShardError: anything malformed, named with its byte offset.
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    # per member: the usual forms' checks inline (a function call each cost more than them)
    octal = _OCTAL.fullmatch
    unpack = _HEADER.unpack
    adler = zlib.adler32
    read = stream.read_view  # bytes, or a memoryview: both are parsed alike
    while True:
        at = stream.pos
        header = read(BLOCK)
        if len(header) < BLOCK:
            if not header:
                return  # archive without end blocks: accepted, as tar does
            raise CorruptShardError("truncated tar header")
        if header == ZERO_BLOCK:
            return
        raw_name, raw_size, raw_sum, kind, magic, raw_prefix = unpack(header)
        usual = octal(raw_sum)
        checksum = int(usual[1], 8) if usual else _parse_number(raw_sum, "checksum", at)
        # header_checksum(header), inline
        low = (adler(header[:256]) & 0xFFFF) + (adler(header[256:]) & 0xFFFF)
        if checksum != low - (adler(header[148:156]) & 0xFFFF) + 255:
            raise CorruptShardError(f"bad tar header checksum at byte {at}")
        usual = octal(raw_size)
        size = int(usual[1], 8) if usual else _parse_number(raw_size, "size", at)
        if kind in _META_KINDS:
            if size > MAX_META_BYTES:
                raise CorruptShardError(f"tar metadata member of {size} bytes at byte {at}")
            _check_size(stream, size, at)
            data = stream.read_member(size, -(-size // BLOCK) * BLOCK)
            if kind == b"x":
                pax = _parse_pax(bytes(data), at + BLOCK)
            elif kind == b"L":
                long_name = bytes(data).rstrip(b"\0").decode("utf-8", "replace")
            continue
        if long_name is not None:
            name = long_name
            long_name = None
        elif pax and "path" in pax:
            name = pax["path"]
        else:
            name = raw_name.split(b"\0", 1)[0].decode("utf-8", "replace")
            if raw_prefix[0] and magic.startswith(b"ustar"):
                prefix = raw_prefix.split(b"\0", 1)[0].decode("utf-8", "replace")
                name = f"{prefix}/{name}"
        if pax:
            if "size" in pax:
                if not _DECIMAL.fullmatch(pax["size"]):
                    raise CorruptShardError(f"PAX size {pax['size'][:20]!r} at byte {at}")
                size = int(pax["size"])
            pax = {}
        padded = -(-size // BLOCK) * BLOCK
        length = stream.length
        if length is not None and size > length - at - BLOCK:  # past the end (or nearly)
            _check_size(stream, size, at)
        if kind not in _FILE_KINDS:
            stream.skip_member(size, padded)
            continue
        yield name, size, padded


def iter_members(
    stream: ShardStream, *, views: bool = False
) -> Iterator[tuple[Member, Callable[[], bytes]]]:
    """Regular-file members of a tar stream, each with a reader of its data.

    The reader must be called before advancing, or not at all (then the data is skipped
    without being read where the stream can seek). `views=True`: data may come as a
    memoryview instead of bytes, where that saves a copy.

    Raises:
        CorruptShardError: anything malformed, named with its byte offset.
    """
    for name, size, padded in tar_entries(stream):
        state = {"done": False}

        def read_data(size: int = size, padded: int = padded, state: dict = state) -> bytes:
            state["done"] = True
            return stream.read_member(size, padded, views)  # type: ignore[return-value]

        yield Member(name, size), read_data
        if not state["done"]:
            stream.skip_member(size, padded)


def split_key(name: str) -> tuple[str, str]:
    """`dir/abc.seg.jpg` -> (`dir/abc`, `seg.jpg`): the WebDataset key/extension split."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def iter_samples(
    stream: ShardStream,
    *,
    want: Callable[[int], bool] | None = None,
    stop: int | None = None,
    views: bool = False,
) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """Samples of a tar stream as (index in shard, key, {extension: bytes}).

    Args:
        stream: the shard.
        want: called with a sample's index; False skips the sample's bytes without reading
            them where possible (and never decodes them). Skipped samples are not yielded.
        stop: stop after sample index `stop - 1` (no need to read further).
        views: the caller takes memoryviews as well as bytes (see `iter_members`).
    """
    index = -1
    key: str | None = None
    members: dict[str, Any] = {}
    wanted = True
    read_member = stream.read_member
    for name, size, padded in tar_entries(stream):
        # split_key, inline (once per member)
        dot = name.find(".", name.rfind("/") + 1)
        k, ext = (name, "") if dot < 0 else (name[:dot], name[dot + 1 :].lower())
        if k != key:
            if key is not None and wanted:
                yield index, key, members
            index += 1
            if stop is not None and index >= stop:
                return
            key, members = k, {}
            wanted = want is None or want(index)
        if not wanted:
            stream.skip_member(size, padded)
            continue
        if ext in members:
            # webdataset#205: a duplicate member would silently replace the first one
            raise CorruptShardError(f"duplicate member {name!r}")
        members[ext] = read_member(size, padded, views)
    if key is not None and wanted:
        yield index, key, members
