"""The shard tar writer: headers identical to tarfile's USTAR, archives tarfile and GNU tar read."""

from __future__ import annotations

import hashlib
import io
import tarfile

from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.convert.tar import (
    BLOCK_SIZE,
    RECORD_SIZE,
    ShardTarWriter,
    member_header,
    member_num_bytes,
)

ascii_names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=100
)


def reference_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


@settings(max_examples=300, deadline=None)
@given(name=ascii_names, size=st.integers(min_value=0, max_value=8**11 - 1))
def test_fast_header_equals_tarfile_ustar(name: str, size: int) -> None:
    assert member_header(name, size) == reference_header(name, size)


@settings(max_examples=30, deadline=None)
@given(
    members=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=130).filter(
                lambda s: "\0" not in s and not s.endswith("/")
            ),
            st.binary(max_size=1500),
        ),
        max_size=6,
    )
)
def test_archives_round_trip_through_tarfile(members: list[tuple[str, bytes]]) -> None:
    stream = io.BytesIO()
    writer = ShardTarWriter(stream)
    for name, data in members:
        writer.add(name, data)
    digest = writer.finish()
    raw = stream.getvalue()
    assert len(raw) == writer.num_bytes and len(raw) % RECORD_SIZE == 0
    assert digest == hashlib.sha256(raw).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        read = [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]
    assert read == members


def test_member_num_bytes() -> None:
    assert member_num_bytes("a.jpg", 0) == BLOCK_SIZE
    assert member_num_bytes("a.jpg", 1) == 2 * BLOCK_SIZE
    assert member_num_bytes("a.jpg", 512) == 2 * BLOCK_SIZE
    assert member_num_bytes("k" * 150 + ".jpg", 1) > 2 * BLOCK_SIZE  # PAX header blocks
