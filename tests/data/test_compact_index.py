"""The compact index (`index.compact`): the JSON's content as columns, checked like the JSON,
never used when it no longer matches its JSON, copied once per node and mapped by the rest."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest

from hpctrain.bench.index import CountingFileSystem, run_processes
from hpctrain.cli.main import main
from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, ShardIndexError, open_index
from hpctrain.data.compact import (
    CompactShards,
    JsonStamp,
    compact_bytes,
    parse_compact,
    read_header,
    url_runs,
)
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes, parse_index
from hpctrain.data.node_index import FORM_ENV, NODE_LOCAL_ENV, write_companion
from tests.support.loader_kit import make_shards
from tests.support.storage_servers import serve_http

SHA = "ab" * 32


@pytest.fixture(autouse=True)
def node_dir(tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.mktemp("node")
    monkeypatch.setenv(NODE_LOCAL_ENV, str(folder))
    monkeypatch.delenv(FORM_ENV, raising=False)
    return folder


def varied_index() -> ShardIndex:
    """Every kind of entry a JSON index may hold: numbered runs, an unpadded 9 -> 10, names
    without digits, absolute URLs, digests or none, token counts some shards lack."""
    shards = [
        ShardInfo(f"train-{i:06d}.tar", 3, 4096, SHA if i % 2 else "", num_tokens=90 + i)
        for i in range(12)
    ]
    shards += [ShardInfo("x-9.tar", 1, 1024), ShardInfo("x-10.tar", 2, 0, num_targets=None)]
    shards += [ShardInfo("plain.tar", 1, 512), ShardInfo("/abs/olé 7.tar", 4, 0, SHA)]
    return ShardIndex(
        shards=tuple(shards),
        base_url="/data",
        class_names=("cat", "dog"),
        command="hpctrain convert a b",
        extra={"split": "train", "nested": {"k": [1, 2]}},
        tokenizer={"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""},
    )


def test_the_compact_form_holds_exactly_what_the_json_holds():
    index = varied_index()
    compact = parse_compact(compact_bytes(index, JsonStamp(SHA, 1)), "/data/index.json")
    assert isinstance(compact.shards, CompactShards)
    assert index_to_bytes(compact) == index_to_bytes(index)  # every key, shard by shard
    assert [compact.shard_url(i) for i in range(16)] == [index.shard_url(i) for i in range(16)]
    assert list(compact.shard_urls()) == list(index.shard_urls())
    assert compact.num_tokens is None and compact.holds("num_tokens")  # as the JSON's
    assert (compact.counts("num_samples") == index.counts("num_samples")).all()
    assert compact.url_protocols() == index.url_protocols() == {"file"}


def test_urls_are_stored_as_a_pattern_plus_exceptions():
    urls = [f"train-{i:06d}.tar" for i in range(1000)] + ["odd.tar", "x-9", "x-10"]
    runs = url_runs(urls)
    assert [(r.first, r.width) for r in runs] == [(0, 6), (1000, 0), (1001, 1), (1002, 2)]
    shards = tuple(ShardInfo(u, 1, 0) for u in urls)
    raw = compact_bytes(ShardIndex(shards=shards), JsonStamp(SHA, 1))
    assert read_header(raw, "x")["num_runs"] == 4
    compact = parse_compact(raw, "s3://bucket/d/index.json")
    assert compact.shard_url(999) == "s3://bucket/d/train-000999.tar"
    assert compact.shard_urls()[-1] == "s3://bucket/d/x-10"


def test_a_pickled_compact_index_maps_the_same_file_again(tmp_path):
    make_shards(tmp_path, [3, 4, 5])
    write_companion(str(tmp_path / "index.json"))
    index = open_index(str(tmp_path))
    assert isinstance(index.shards, CompactShards) and index.shards.path
    again = pickle.loads(pickle.dumps(index))
    assert again.shards.path == index.shards.path and list(again.shards) == list(index.shards)


def hostile(index: ShardIndex, **changes) -> bytes:
    """`index`'s compact bytes with column bytes (by column name) or header fields replaced."""
    raw = bytearray(compact_bytes(index, JsonStamp(SHA, 1)))
    header = read_header(raw, "x")
    fields = {}
    for name, value in changes.items():
        if name in header["columns"]:
            offset = header["columns"][name]["offset"]
            raw[offset : offset + len(value)] = value
        else:
            fields[name] = value
    text = json.dumps({**header, **fields}).encode()
    room = min(c["offset"] for c in header["columns"].values()) - 16
    assert len(text) <= room, "no room for the change"
    raw[8:16] = len(text).to_bytes(8, "little")
    raw[16 : room + 16] = text.ljust(room, b" ")
    return bytes(raw)


@pytest.mark.parametrize(
    ("index", "changes", "error"),
    [
        (ShardIndex((ShardInfo("pipe:curl x", 1, 0),)), {}, r"shards\[0\]\.url is a pipe"),
        (
            ShardIndex((ShardInfo("a-1.tar", 1, 0), ShardInfo("/etc/x.tar", 1, 0))),
            {},
            r"shards\[1\]\.url = '/etc/x.tar' leaves the index's filesystem",
        ),
        (ShardIndex((ShardInfo("a.tar", 1, 0),)), {"num_samples": (-5).to_bytes(8, "little", signed=True)}, "negative"),
        (ShardIndex((ShardInfo("a.tar", 3, 4096),)), {"num_samples": (9).to_bytes(8, "little")}, "total does not match"),
        (ShardIndex((ShardInfo("a.tar", 1, 4096),)), {"totals": {"num_samples": 9, "num_bytes": 4096}}, "num_samples total"),
        (ShardIndex((ShardInfo("a.tar", 1, 0),)), {"num_shards": 7}, "column .* malformed"),
        (ShardIndex((ShardInfo("a.tar", 1, 0),)), {"url_kinds": ["s3"]}, "misstates its URL kinds"),
        (ShardIndex((ShardInfo("a.tar", 1, 0),)), {"version": 9}, "version 9"),
    ],
)  # fmt: skip
def test_a_hostile_compact_index_is_refused_naming_it(index, changes, error):
    raw = hostile(index, **changes)
    with pytest.raises(ShardIndexError, match=error):
        parse_compact(raw, "http://host/d/index.json")
    with pytest.raises(ShardIndexError, match="truncated|column"):
        parse_compact(raw[: len(raw) // 2 + 40], "http://host/d/index.json")


def test_a_compact_index_with_more_samples_than_its_bytes_hold_is_refused():
    nine = (9).to_bytes(8, "little")
    raw = hostile(
        ShardIndex((ShardInfo("a.tar", 8, 4096),)),
        num_samples=nine,
        totals={"num_samples": 9, "num_bytes": 4096},
    )
    with pytest.raises(ShardIndexError, match=r"shards\[0\]\.num_samples = 9 cannot fit"):
        parse_compact(raw, "/d/index.json")


def plan_of(index, rank=1):
    loader = ShardedLoader(
        index, DataConfig(batch_size=2, workers_per_rank=2), rank=rank, world_size=3, seed=4
    )
    return [(s.shard, s.start, s.end) for s in loader.plan().stream_segments(rank, 1)]


def test_a_stale_companion_is_derived_again_and_replaced(tmp_path, monkeypatch, caplog):
    make_shards(tmp_path, [3, 4, 5, 6])
    write_companion(str(tmp_path / "index.json"))
    old = (tmp_path / "index.compact").read_bytes()
    data = json.loads((tmp_path / "index.json").read_text())
    data["shards"] = data["shards"][:3]  # the JSON changes; the companion does not
    data.pop("num_samples"), data.pop("num_bytes")
    (tmp_path / "index.json").write_text(json.dumps(data))
    index = open_index(str(tmp_path))
    assert isinstance(index.shards, CompactShards) and index.num_shards == 3
    assert "did not match its JSON: derived again" in caplog.text
    assert (tmp_path / "index.compact").read_bytes() != old
    monkeypatch.setenv(FORM_ENV, "json")
    assert plan_of(open_index(str(tmp_path))) == plan_of(index)


def test_a_large_index_says_when_its_read_starts(tmp_path, monkeypatch, caplog):
    import hpctrain.data.node_index as node_index

    make_shards(tmp_path, [3, 4])
    caplog.set_level("INFO", logger="hpctrain")
    open_index(str(tmp_path))
    assert "reading the index" not in caplog.text  # a small one: nothing to wait for
    monkeypatch.setattr(node_index, "SAY_READ_BYTES", 0)  # as if it were 16 MB or more
    open_index(str(tmp_path))
    assert f"reading the index {tmp_path}/index.json (0 MB)" in caplog.text
    write_companion(str(tmp_path / "index.json"))
    caplog.clear()
    open_index(str(tmp_path))
    assert "(0 MB, its compact form once per node)" in caplog.text


def test_a_touched_json_with_the_same_bytes_keeps_its_companion(tmp_path):
    make_shards(tmp_path, [3, 4])
    write_companion(str(tmp_path / "index.json"))
    before = (tmp_path / "index.compact").read_bytes()
    later = (tmp_path / "index.compact").stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "index.json", ns=(later, later))  # copied: newer, the same content
    index = open_index(str(tmp_path))
    assert isinstance(index.shards, CompactShards)
    assert (tmp_path / "index.compact").read_bytes() == before


@pytest.mark.network
def test_a_stale_companion_where_it_cannot_be_replaced_is_refused_in_one_line(tmp_path):
    make_shards(tmp_path, [3, 4])
    write_companion(str(tmp_path / "index.json"))
    make_shards(tmp_path, [3, 5])  # a new index.json over HTTP: read-only
    with serve_http(tmp_path) as (url, _log), pytest.raises(ShardIndexError) as err:
        open_index(f"{url}/index.json")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{url}/index.compact does not match index.json")
    assert "hpctrain index compact" in message


@pytest.mark.network
def test_over_http_the_companion_gives_the_jsons_plan(tmp_path, monkeypatch):
    make_shards(tmp_path, [5, 3, 4, 6, 2])
    write_companion(str(tmp_path / "index.json"))
    with serve_http(tmp_path) as (url, log):
        index = open_index(f"{url}/index.json")
        assert isinstance(index.shards, CompactShards)
        assert index.shard_url(4) == f"{url}/train-000004.tar"
        assert any(p.endswith("index.compact") for p, _r, _a in log.requests)
        monkeypatch.setenv(FORM_ENV, "json")
        assert plan_of(open_index(f"{url}/index.json")) == plan_of(index)


def test_forced_compact_form_derives_a_missing_companion(tmp_path, monkeypatch):
    make_shards(tmp_path, [2, 2])
    monkeypatch.setenv(FORM_ENV, "compact")
    index = open_index(str(tmp_path / "index.json"))
    assert isinstance(index.shards, CompactShards) and (tmp_path / "index.compact").exists()
    monkeypatch.setenv(FORM_ENV, "json")
    assert not isinstance(open_index(str(tmp_path)).shards, CompactShards)
    assert isinstance(open_index(str(tmp_path / "index.compact")).shards, CompactShards)
    monkeypatch.setenv(FORM_ENV, "fast")
    with pytest.raises(ShardIndexError, match="HPCTRAIN_INDEX_FORM='fast'"):
        open_index(str(tmp_path))


def test_a_node_local_folder_others_may_write_is_refused(tmp_path, node_dir):
    make_shards(tmp_path / "d", [2])
    write_companion(str(tmp_path / "d" / "index.json"))
    folder = node_dir / f"hpctrain-index-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ShardIndexError, match="not a folder of this user's alone"):
        open_index(str(tmp_path / "d"))


def test_a_full_node_local_folder_is_one_line_naming_it(tmp_path, node_dir, monkeypatch):
    import errno
    import tempfile

    make_shards(tmp_path / "d", [2])
    write_companion(str(tmp_path / "d" / "index.json"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(ShardIndexError, match="No space left on device; set HPCTRAIN_NODE_LOCAL"):
        open_index(str(tmp_path / "d"))


def test_sixteen_local_processes_read_the_compact_index_once(tmp_path, node_dir):
    """The node case of `hpctrain bench index`, small: every process gets the same plan,
    one copy lands in the node-local folder, and the shared filesystem hands out one
    compact index in all (the JSON form: one JSON per process)."""
    path = tmp_path / "index.json"
    path.write_bytes(
        index_to_bytes(ShardIndex(tuple(ShardInfo(f"t-{i:05d}.tar", 10, 0) for i in range(3000))))
    )
    write_companion(str(path))
    args = {"rank": 5, "world_size": 64, "workers": 2}
    spec = f"countfs://{path}"
    # forked: torch is imported here already (16 spawned imports take minutes on a busy host)
    compact = run_processes(spec, "compact", str(node_dir), args, 16, 16, method="fork")
    assert all(r["compact"] for r in compact)
    assert sum(r["bytes_read"] for r in compact) == (tmp_path / "index.compact").stat().st_size
    assert len({r["first_shard"] for r in compact}) == 1
    copies = list((node_dir / f"hpctrain-index-{os.getuid()}").glob("*.compact"))
    assert len(copies) == 1 and stat.S_IMODE(copies[0].parent.stat().st_mode) == 0o700
    plain = run_processes(spec, "json", str(node_dir), args, 2, 2, method="fork")
    assert [r["bytes_read"] for r in plain] == [path.stat().st_size] * 2
    assert plain[0]["first_shard"] == compact[0]["first_shard"]


def test_index_compact_verb_writes_the_companion(tmp_path, capsys):
    make_shards(tmp_path / "a", [2, 3])
    assert main(["index", "compact", str(tmp_path / "a")]) == 0
    assert "1 URL run(s)" in capsys.readouterr().out
    raw = (tmp_path / "a" / "index.compact").read_bytes()
    data = json.loads((tmp_path / "a" / "index.json").read_text())
    assert index_to_bytes(parse_compact(raw, "x/index.json")) == index_to_bytes(
        parse_index(data, "x/index.json")
    )
    assert main(["index", "compact", str(tmp_path / "missing")]) == 3
    assert "missing/index.json: index not found" in capsys.readouterr().err


def test_counting_filesystem_counts_what_it_hands_out(tmp_path):
    import fsspec

    (tmp_path / "f").write_bytes(b"x" * 1000)
    CountingFileSystem.bytes_read = 0
    with fsspec.open(f"countfs://{tmp_path}/f", "rb") as f:
        f.read(300)
    assert fsspec.filesystem("countfs").cat_file(f"{tmp_path}/f", 100, 150) == b"x" * 50
    assert CountingFileSystem.bytes_read == 350


def test_inspect_reads_either_form_alike_and_flags_a_stale_companion(tmp_path, capsys):
    make_shards(tmp_path, [3, 4])
    write_companion(str(tmp_path / "index.json"))
    reports = {}
    for name in ("index.json", "index.compact"):
        assert main(["inspect", str(tmp_path / name), "--json", "--verify"]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
        reports[name].pop("source"), reports[name].pop("index")
    assert reports["index.json"] == reports["index.compact"]
    assert reports["index.json"]["num_samples"] == 7 and reports["index.json"]["ok"]
    make_shards(tmp_path, [3, 4], prefix="other")  # a new index.json, the old companion
    assert main(["inspect", str(tmp_path)]) == 3
    assert "index.compact does not match index.json" in capsys.readouterr().out


def test_shard_names_whose_number_overflows_int64_stay_literal_names(tmp_path, capsys, monkeypatch):
    """A 20-digit id or timestamp as the last group of digits (past int64): `hpctrain index
    compact` and a loader on the forced compact form read them as the JSON names them
    (before: an OverflowError traceback)."""
    from tests.support.loader_kit import write_shard

    root = tmp_path / "d"
    root.mkdir()
    names = [f"shard-{20240101120000000000 + i}.tar" for i in range(3)]  # consecutive, 20 digits
    names += ["x-9223372036854775807.tar", "x-9223372036854775808.tar"]  # int64's edge
    infos = []
    for shard, name in enumerate(names):
        write_shard(root / name, shard, 2)
        infos.append(ShardInfo(name, 2, (root / name).stat().st_size))
    (root / "index.json").write_bytes(index_to_bytes(ShardIndex(shards=tuple(infos))))
    assert main(["index", "compact", str(root)]) == 0
    capsys.readouterr()
    raw = (root / "index.compact").read_bytes()
    data = json.loads((root / "index.json").read_text())
    assert index_to_bytes(parse_compact(raw, "x/index.json")) == index_to_bytes(
        parse_index(data, "x/index.json")
    )
    monkeypatch.setenv(FORM_ENV, "compact")
    index = open_index(str(root))
    assert isinstance(index.shards, CompactShards)
    assert [index.shard_url(i) for i in range(5)] == [str(root / n) for n in names]
    config = DataConfig(batch_size=2, workers_per_rank=0, shuffle_buffer=0)
    loader = ShardedLoader(index, config, rank=0, world_size=1, seed=0)
    keys = sorted(k for batch in loader for k in batch["key"])
    assert keys == sorted(f"s{s:04d}-{i:05d}" for s in range(5) for i in range(2))
