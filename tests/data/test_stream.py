"""The tar reader: formats, skipping without reading, corrupt input, short bodies."""

from __future__ import annotations

import io
import pickle
import tarfile

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.data.stream import (
    CorruptShardError,
    PipeRefusedError,
    ReadStats,
    ShardReadError,
    ShardStream,
    ShardUnavailableError,
    open_shard,
)
from hpctrain.data.tar import iter_samples, split_key


def write_tar(path, members, fmt=tarfile.USTAR_FORMAT):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def samples(path, **kw):
    with open_shard(str(path)) as f:
        return [(i, k, {e: bytes(v) for e, v in m.items()}) for i, k, m in iter_samples(f, **kw)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_in_every_tar_format(tmp_path, fmt):
    deep = "d" * 90 + "/" + "e" * 80  # needs the USTAR prefix, a GNU long name or PAX
    members = [(f"{deep}/k1.jpg", b"a"), (f"{deep}/k1.cls", b"1"), (f"{deep}/k2.jpg", b"b")]
    got = samples(write_tar(tmp_path / "x.tar", members, fmt))
    assert got == [(0, f"{deep}/k1", {"jpg": b"a", "cls": b"1"}), (1, f"{deep}/k2", {"jpg": b"b"})]


@pytest.mark.parametrize("views", [False, True])
def test_skipped_samples_are_not_read(tmp_path, views):
    members = [(f"{i:03d}.bin", bytes([i]) * 100_000) for i in range(10)]
    path = write_tar(tmp_path / "x.tar", members)
    stats = ReadStats()
    with open_shard(str(path), stats=stats) as f:
        got = [
            (i, bytes(m["bin"][:1]))
            for i, _k, m in iter_samples(f, want=lambda i: i in (3, 7), stop=8, views=views)
        ]
    assert got == [(3, b"\x03"), (7, b"\x07")]
    assert stats.bytes_skipped >= 6 * 100_000  # seeks, not reads, on a local file
    assert stats.bytes_read < 5 * 100_000


@pytest.mark.parametrize("views", [False, True])
def test_members_read_ahead_whole_or_in_part_are_read_exactly(tmp_path, views):
    """A member's read takes a few blocks after it (a small member, the next header): members
    that fit there, that fit in part (read again from their start) and skipped samples."""
    sizes = [0, 1, 511, 512, 513, 1024, 1500, 2048, 5000]
    members = []
    for i, n in enumerate(sizes):
        members += [(f"{i:03d}.jpg", bytes([i]) * (3000 + i)), (f"{i:03d}.txt", b"t%d" % i * n)]
    path = write_tar(tmp_path / "x.tar", members)
    expected = [
        (i, f"{i:03d}", {"jpg": bytes([i]) * (3000 + i), "txt": b"t%d" % i * n})
        for i, n in enumerate(sizes)
    ]
    stats = ReadStats()
    with open_shard(str(path), stats=stats) as f:
        got = [
            (i, k, {e: bytes(v) for e, v in m.items()}) for i, k, m in iter_samples(f, views=views)
        ]
    assert got == expected
    assert stats.bytes_read <= path.stat().st_size  # bytes read again are counted once
    with open_shard(str(path)) as f:
        some = [
            (i, k, {e: bytes(v) for e, v in m.items()})
            for i, k, m in iter_samples(f, want=lambda i: i % 3 == 1, views=views)
        ]
    assert some == [s for s in expected if s[0] % 3 == 1]


def test_split_key_follows_webdataset():
    assert split_key("a/b.c/key.seg.JPG") == ("a/b.c/key", "seg.jpg")
    assert split_key("noext") == ("noext", "")


@pytest.mark.parametrize("views", [False, True])
def test_corrupt_and_duplicate_members(tmp_path, views):
    dup = write_tar(tmp_path / "dup.tar", [("k.jpg", b"a"), ("k.jpg", b"b")])
    with pytest.raises(CorruptShardError, match="duplicate member 'k.jpg'"):
        samples(dup, views=views)
    good = write_tar(tmp_path / "good.tar", [("k.jpg", b"x" * 2000), ("k.cls", b"1")])
    data = good.read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:1000])  # inside the first member's data
    with pytest.raises(CorruptShardError, match="truncated tar member"):
        samples(tmp_path / "cut.tar", views=views)
    (tmp_path / "noend.tar").write_bytes(data[:3584])  # both members, no end-of-archive blocks
    assert [k for _i, k, _m in samples(tmp_path / "noend.tar", views=views)] == ["k"]
    (tmp_path / "empty.tar").write_bytes(b"")  # cannot be mapped: read as a file
    assert samples(tmp_path / "empty.tar", views=views) == []


def test_local_members_are_read_once_and_outlive_the_stream(tmp_path):
    members = [(f"{i}.jpg", bytes([i]) * (700 + i)) for i in range(3)]
    path = write_tar(tmp_path / "x.tar", members)
    expected = samples(path)
    for url in (str(path), f"file://{path}"):
        with open_shard(url) as f:
            got = list(iter_samples(f, views=True))
        # read, not mapped: bytes, or a view of bytes without the member's tar padding
        assert all(isinstance(getattr(m["jpg"], "obj", m["jpg"]), bytes) for _i, _k, m in got)
        assert got == expected
    with open_shard(f"pipe:cat {path}", allow_pipe=True) as f:  # a stream: the same bytes
        assert [(i, k, m) for i, k, m in iter_samples(f, views=True)] == expected


def test_short_body_of_a_remote_shard_is_retried_then_reported(tmp_path):
    path = write_tar(tmp_path / "x.tar", [("k.jpg", b"x" * 5000)])
    size = path.stat().st_size
    url = "memory://short/x.tar"  # a filesystem that is not local: a short body may pass
    fsspec.filesystem("memory").pipe_file(url, path.read_bytes())
    stream = ShardStream(url, size=size + 512, max_retries=2, sleep=lambda _s: None)
    with pytest.raises(ShardReadError, match="still failing after 2 retries: TransientReadError"):
        stream.read(size + 512)
    assert stream.stats.retries == 2


def test_a_shard_failing_past_its_retries_is_transient_and_a_missing_one_the_users(
    tmp_path, monkeypatch
):
    """Exit 8 (retried by the job script) for an outage, exit 3 (never retried) for a shard
    that is not there; the kind survives the trip from a loader worker."""
    path = write_tar(tmp_path / "x.tar", [("k.jpg", b"x" * 5000)])
    url = "memory://outage/x.tar"
    fsspec.filesystem("memory").pipe_file(url, path.read_bytes())
    stream = ShardStream(url, size=path.stat().st_size + 512, max_retries=1, sleep=lambda _s: None)
    with pytest.raises(ShardUnavailableError, match="still failing after 1 retries") as read:
        stream.read(path.stat().st_size + 512)
    back = pickle.loads(pickle.dumps(read.value))
    assert (type(back), back.exit_code, str(back)) == (
        ShardUnavailableError, 8, str(read.value),
    )  # fmt: skip
    with pytest.raises(ShardReadError) as missing:
        open_shard(str(tmp_path / "nowhere.tar"), max_retries=3, backoff_s=0)
    assert missing.value.exit_code == 3 and not isinstance(missing.value, ShardUnavailableError)

    def reset(*_a, **_k):
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr("hpctrain.data.stream.ShardStream.__init__", reset)
    with pytest.raises(ShardUnavailableError, match="still failing after 2 retries") as opening:
        open_shard(url, max_retries=2, backoff_s=0)
    assert opening.value.exit_code == 8


def test_a_truncated_local_shard_is_corrupt_at_once_naming_the_sizes(tmp_path):
    path = write_tar(tmp_path / "x.tar", [("k.jpg", b"x" * 5000), ("k.cls", b"1")])
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:5632])  # cut after the first member (512 + 5120)
    sleeps: list[float] = []
    stream = ShardStream(str(path), size=size, max_retries=5, sleep=sleeps.append)
    with pytest.raises(
        CorruptShardError, match=f"truncated: the file holds 5632 bytes, the index says {size} "
    ):
        list(iter_samples(stream))
    assert stream.stats.retries == 0 and sleeps == []  # was 5 retries of "body ended"


def test_empty_member_of_a_shard_of_known_size(tmp_path):
    path = write_tar(tmp_path / "x.tar", [("a.txt", b""), ("b.txt", b"x")])
    with open_shard(str(path), size=path.stat().st_size) as f:
        got = [(k, {e: bytes(v) for e, v in m.items()}) for _i, k, m in iter_samples(f)]
    assert got == [("a", {"txt": b""}), ("b", {"txt": b"x"})]


def test_pipe_failure_is_an_error(tmp_path):
    with pytest.raises(ShardReadError, match="pipe command exited with status 3"):
        samples_of = open_shard("pipe:exit 3", max_retries=1, backoff_s=0, allow_pipe=True)
        samples_of.read(10)


def test_pipe_commands_run_only_when_allowed(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(PipeRefusedError, match=r"pipe:touch \.\.\.: pipe: shards run a shell"):
        open_shard(f"pipe:touch {marker}")
    with pytest.raises(PipeRefusedError):
        ShardStream(f"pipe:touch {marker}")
    assert not marker.exists()
    # raised in a loader worker, it arrives in the training process as it was, command hidden
    error = pickle.loads(pickle.dumps(PipeRefusedError("pipe:curl -H 'token: x' https://h/a.tar")))
    assert isinstance(error, PipeRefusedError) and "token" not in str(error)
    assert str(error).startswith("pipe:curl ...: ")


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 511, 512, 513, 1024, 5000, 70_000]), max_size=12),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    wanted=st.sets(st.integers(0, 5)),
    reader=st.sampled_from(["file", "memory", "pipe"]),
    views=st.booleans(),
)
def test_any_valid_shard_reads_as_tarfile_sees_it(
    tmp_path_factory, sizes, fmt, wanted, reader, views
):
    """Every member size against the reader's paths (the data and the next header in one
    read on a local file, a stream's read-ahead, seeks past unwanted samples): each wanted
    sample exactly as tarfile reads it, in every tar format and reader."""
    where = tmp_path_factory.mktemp("valid")
    members = [
        (f"k{i // 2}.{'jpg' if i % 2 == 0 else 'cls'}", bytes([i]) * n) for i, n in enumerate(sizes)
    ]
    path = write_tar(where / "x.tar", members, fmt)
    with tarfile.open(path) as tar:
        expected: dict[str, dict[str, bytes]] = {}
        for info in tar.getmembers():
            key, ext = split_key(info.name)
            expected.setdefault(key, {})[ext] = tar.extractfile(info).read()  # type: ignore[union-attr]
    if reader == "memory":
        url = f"memory://valid/{where.name}.tar"
        fsspec.filesystem("memory").pipe_file(url, path.read_bytes())
    else:
        url = str(path) if reader == "file" else f"pipe:cat {path}"
    with open_shard(url, allow_pipe=True) as f:
        got = [
            (i, k, {e: bytes(v) for e, v in m.items()})
            for i, k, m in iter_samples(f, want=wanted.__contains__, views=views)
        ]
    keys = list(expected)
    assert got == [(i, keys[i], expected[keys[i]]) for i in sorted(wanted) if i < len(keys)]
