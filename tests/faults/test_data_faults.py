"""The data rows of the fault matrix (issue #14): hostile indexes, malformed tar headers,
stalled and orphaned workers, shards truncated while read.

Each test injects one fault for real (a served index, bytes written into a shard, a SIGKILL,
a truncate) and checks the documented behaviour. `pytest.mark.timeout` values are hang
detectors, not speed checks. The older data rows are proven elsewhere: HTTP 503/reset
mid-shard by tests/data/test_remote.py::test_http_faults_are_survived_without_losing_samples,
a dead worker by tests/data/test_workers.py::test_a_killed_worker_fails_the_pass_at_once_and_
the_loader_starts_new_ones.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.config.schema import DataConfig
from hpctrain.convert.errors import ConvertError
from hpctrain.convert.sources.shards import list_shards
from hpctrain.convert.verify import inspect_dataset
from hpctrain.data import ShardedLoader, ShardIndexError, ShardReadError, open_index
from hpctrain.data.index import ShardIndex, ShardInfo, parse_index
from hpctrain.data.transport import WorkerTimeoutError
from hpctrain.launch.preflight import check_data
from tests.data.test_tar_fuzz import BAD_NUMBERS, SHARDS, _headers
from tests.support.loader_kit import all_keys, make_shards
from tests.support.storage_servers import serve_http

REPO = Path(__file__).resolve().parents[2]
SIZES = [12, 12]


def data_cfg(**kw: Any) -> DataConfig:
    base: dict[str, Any] = dict(batch_size=2, workers_per_rank=1, shuffle_buffer=0)
    base.update(kw)
    return DataConfig(**base)


def read_all(index: ShardIndex, cfg: DataConfig, **kw: Any) -> tuple[list[dict], dict[str, int]]:
    loader = ShardedLoader(index, cfg, rank=0, world_size=1, seed=0, **kw)
    loader.backoff_s = 0.01
    try:
        return list(loader), loader.stats()
    finally:
        loader.close()


def checks(tmp_path: Path, train: str, *overrides: str) -> list[Any]:
    cfg = with_overrides(
        Config(), [f"run_dir={tmp_path / 'run'}", f"data.train={train}", *overrides]
    )
    return check_data(cfg)


# -- 1. an untrusted index never runs a command --------------------------------------------


def hostile_index(root: Path, marker: Path) -> dict[str, Any]:
    """The index of `root` with its second shard replaced by a pipe: command."""
    data = json.loads((root / "index.json").read_text())
    data["shards"][1]["url"] = f"pipe:touch {marker}; cat {root / 'train-000001.tar'}"
    return data


@pytest.mark.network
@pytest.mark.parametrize("served", [False, True], ids=["local-index", "http-index"])
def test_an_index_naming_a_pipe_command_is_refused_and_nothing_runs(tmp_path, served):
    root = tmp_path / "shards"
    make_shards(root, SIZES)
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "index.json").write_text(json.dumps(hostile_index(root, marker)))
    error = r"index.json: shards\[1\]\.url is a pipe: command"
    with serve_http(hostile) as (url, _log):
        spec = f"{url}/index.json" if served else str(hostile / "index.json")
        for allow_pipe in (False, True):  # the opt-in is for the user's own patterns only
            with pytest.raises(ShardIndexError, match=error):
                open_index(spec, allow_pipe=allow_pipe)
        for allow in ("false", "true"):  # preflight (run by submit) refuses it too
            (check,) = checks(tmp_path, spec, f"data.allow_pipe={allow}")
            assert not check.ok and "shards[1].url is a pipe: command" in check.message
        with pytest.raises(ShardIndexError, match=error):
            inspect_dataset(spec)
        with pytest.raises(ShardIndexError, match=error):
            list_shards(spec)  # convert's "existing shards" source
    assert not marker.exists()


def test_pipe_urls_reach_the_loader_only_with_allow_pipe(tmp_path):
    root = tmp_path / "shards"
    index = make_shards(root, SIZES)
    marker = tmp_path / "ran"
    piped = ShardIndex(
        shards=tuple(
            ShardInfo(f"pipe:touch {marker}; cat {root / s.url}", s.num_samples)
            for s in index.shards
        )
    )
    with pytest.raises(ShardIndexError, match="shard 0 of the index is a pipe: command"):
        ShardedLoader(piped, data_cfg(), rank=0, world_size=1, seed=0)
    assert not marker.exists()
    pattern = f"pipe:cat {root}/train-{{000000..000001}}.tar"
    with pytest.raises(ShardIndexError, match=r"pipe:cat \.\.\.: pipe: shards run a shell"):
        open_index(pattern)
    (check,) = checks(tmp_path, pattern)
    assert not check.ok and "data.allow_pipe: true" in check.message
    with pytest.raises(ConvertError, match="inspect does not run pipe: commands"):
        inspect_dataset(pattern)
    # the user's own opt-in: the trainer reads it, so preflight (and submit) let it through
    opted = open_index(pattern, allow_pipe=True)
    assert [s.num_samples for s in opted.shards] == SIZES
    (check,) = checks(tmp_path, pattern, "data.allow_pipe=true")
    assert check.ok, check.message
    batches, _ = read_all(opted, data_cfg(allow_pipe=True))
    assert {k for b in batches for k in b["key"]} == all_keys(SIZES)


@pytest.mark.parametrize(
    "url",
    ["/etc/passwd", "file:///etc/passwd", "s3://bucket/x.tar", "simplecache::file:///x.tar"],
)
def test_a_remote_index_cannot_point_outside_its_filesystem(url):
    data = {"format": "hpctrain-shards", "version": 1, "shards": [{"url": url, "num_samples": 1}]}
    with pytest.raises(
        ShardIndexError, match=r"shards\[0\]\.url = .* leaves the index's filesystem"
    ):
        parse_index(data, "https://host/data/index.json")
    parse_index(data, "/local/data/index.json")  # the user's own disk: any file or URL


def test_preflight_and_inspect_accept_every_form_the_loader_reads(tmp_path):
    """`submit` must never refuse a dataset the trainer would read: an index under any
    name, a folder, a brace pattern, a single shard."""
    root = tmp_path / "shards"
    make_shards(root, SIZES)
    (root / "index.json").rename(root / "train.json")
    forms = [
        str(root / "train.json"),
        f"{root}/train-{{000000..000001}}.tar",
        str(root / "train-000000.tar"),
    ]
    for spec in forms:
        assert open_index(spec).num_samples in (sum(SIZES), SIZES[0])
        (check,) = checks(tmp_path, spec)
        assert check.ok, check.message
        assert not inspect_dataset(spec)[0].errors


# -- 7. nonsense values in an index entry ----------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "total", "message"),
    [
        ({"num_samples": -5}, {}, r"shards\[0\]\.num_samples = -5: must be a whole number >= 0"),
        ({"num_samples": 2.5}, {}, r"shards\[0\]\.num_samples = 2\.5"),
        ({"num_samples": "7"}, {}, r"shards\[0\]\.num_samples = '7'"),
        ({"num_samples": True}, {}, r"shards\[0\]\.num_samples = True"),
        ({"num_bytes": -1}, {}, r"shards\[0\]\.num_bytes = -1"),
        ({"num_samples": 10**12}, {}, r"shards\[0\]\.num_samples = 1000000000000 cannot fit"),
        ({"url": ""}, {}, r"shards\[0\]\.url must be a non-empty printable string"),
        ({"url": 3}, {}, r"shards\[0\]\.url must be"),
        ({"sha256": "zz"}, {}, r"shards\[0\]\.sha256 must be 64"),
        ({}, {"num_samples": 99}, r"num_samples = 99 but its shards add up to 4"),
        ({}, {"shards": {"url": "a.tar"}}, r"shards must be a list"),
        ({}, {"class_names": "abc"}, r"class_names must be a list of strings"),
    ],
)
def test_nonsense_index_values_are_refused_naming_the_key(tmp_path, entry, total, message):
    shard = {"url": "a.tar", "num_samples": 4, "num_bytes": 10240, **entry}
    data = {"format": "hpctrain-shards", "version": 1, "shards": [shard], **total}
    (tmp_path / "index.json").write_text(json.dumps(data))
    with pytest.raises(ShardIndexError, match=rf"{tmp_path}/index\.json: {message}"):
        open_index(str(tmp_path))


# -- 2. a malformed tar header ----------------------------------------------------------------


def pax_length_zero(path: Path) -> None:
    """Shard bytes whose first PAX record has length 0 (this made the parser loop for ever)."""
    data = bytearray(SHARDS[0])
    at = next(h for h in _headers(bytes(data)) if data[h + 156 : h + 157] == b"x") + 512
    end = data.index(b"\n", at) + 1
    data[at:end] = BAD_NUMBERS[0] + data[at:end][data[at:end].index(b" ") :]
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_a_malformed_tar_header_is_a_shard_error_that_on_error_handles(tmp_path):
    root = tmp_path / "shards"
    index = make_shards(root, SIZES)
    pax_length_zero(root / "train-000001.tar")
    bad = ShardIndex(shards=(index.shards[0], ShardInfo("train-000001.tar", 4)), base_url=str(root))
    with pytest.raises(
        ShardReadError, match=r"train-000001\.tar: PAX record of impossible length 0"
    ):
        read_all(bad, data_cfg())
    batches, stats = read_all(bad, data_cfg(on_error="skip"))
    assert len(batches) == (SIZES[0] + 4) // 2
    assert stats["samples_lost"] == 4 and stats["shards_failed"] == 1
    valid = {k for b in batches for k, ok in zip(b["key"], b["valid"], strict=True) if ok}
    assert valid == {k for k in all_keys(SIZES) if k.startswith("s0000")}


BUSY_PARENT = textwrap.dedent(
    """
    import os, re, signal, sys, threading, time
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index

    def spin(sample):
        if sys.argv[2] == "c":
            re.fullmatch(r"(a|aa)+b", "a" * 80)  # C code holding the GIL for ever
        while True:
            pass

    cfg = DataConfig(batch_size=2, workers_per_rank=1, shuffle_buffer=0, timeout_s=0)
    loader = ShardedLoader(open_index(sys.argv[1]), cfg, rank=0, world_size=1, seed=0, transform=spin)

    def kill_me_once_busy():
        while loader._pool is None:
            time.sleep(0.05)
        time.sleep(2)  # the worker is in the transform by now
        print(*loader._pool.pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if sys.argv[2] == "thread":  # workers forked by another thread: no parent-death signal
        threading.Thread(target=lambda: next(iter(loader)), daemon=True).start()
        kill_me_once_busy()
    threading.Thread(target=kill_me_once_busy, daemon=True).start()
    next(iter(loader))  # waits for ever: the worker never finishes its batch
    """
)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
@pytest.mark.parametrize("busy", ["python", "c", "thread"])
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_a_busy_worker_dies_with_the_killed_training_process(tmp_path, busy):
    make_shards(tmp_path, SIZES)
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    out, err = tmp_path / "pids", tmp_path / "stderr"
    # files, not pipes: a worker that outlived its parent would hold a pipe open for ever
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", BUSY_PARENT, str(tmp_path), busy],
            stdout=stdout,
            stderr=stderr,
            env=env,
        )
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    pids = [int(p) for p in out.read_text().split()]
    try:
        assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]
        assert len(pids) == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(running(p) for p in pids):
            time.sleep(0.2)
        assert not any(running(p) for p in pids), "the busy worker outlived its parent"
    finally:
        for pid in pids:  # never leave a spinning process behind on a shared machine
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class SleepOn:
    """A transform that sleeps on one sample: a worker stalled mid-shard."""

    def __init__(self, key: str, seconds: float) -> None:
        self.key, self.seconds = key, seconds

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["key"] == self.key:
            time.sleep(self.seconds)
        return sample


@pytest.mark.timeout(120)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_a_stalled_worker_fails_the_step_naming_it_and_its_shard(tmp_path):
    index = make_shards(tmp_path, SIZES)
    stall = SleepOn("s0001-00002", 4.0)
    cfg = data_cfg(workers_per_rank=2, shuffle_buffer=0, timeout_s=0.5)
    with pytest.raises(
        WorkerTimeoutError,
        match=r"loader worker 1 \(pid \d+\) sent no batch for 0\.5 s \(data\.timeout_s\); "
        rf"it was reading {tmp_path}/train-000001\.tar",
    ) as stuck:
        read_all(index, cfg, train=False, transform=stall)
    assert stuck.value.exit_code == 8  # transient (a hung file system): retried
    # a slow batch within the timeout is no fault
    batches, _ = read_all(
        index, data_cfg(workers_per_rank=2, timeout_s=10), transform=SleepOn("s0001-00002", 0.5)
    )
    assert len(batches) == sum(SIZES) // 2


# -- 6. a shard truncated while it is read ----------------------------------------------------


class TruncateOn:
    """A transform that truncates a shard when it sees one of its samples: the shard shrinks
    while the loader is reading it (a copy in progress, rsync --inplace)."""

    def __init__(self, key: str, path: Path, keep: int) -> None:
        self.key, self.path, self.keep = key, path, keep

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if sample["key"] == self.key and self.path.stat().st_size > self.keep:
            os.truncate(self.path, self.keep)
        return sample


def read_truncated(root: str, on_error: str, workers: int, conn: Any) -> None:
    """In a child process: a mapped shard's SIGBUS would kill it, not the test run."""
    index = open_index(root)
    cut = TruncateOn("s0000-00000", Path(root) / "train-000000.tar", 4096)
    cfg = data_cfg(on_error=on_error, workers_per_rank=workers, max_retries=1)
    try:
        batches, stats = read_all(index, cfg, train=False, transform=cut)
        valid = sum(int(b["valid"].sum()) for b in batches)
        conn.send(("ok", len(batches), valid, stats))
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc), None))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_shard_truncated_while_read_is_a_shard_error(tmp_path, on_error, workers):
    make_shards(tmp_path, SIZES)
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=read_truncated, args=(str(tmp_path), on_error, workers, theirs))
    child.start()
    child.join(90)
    assert child.exitcode == 0, f"the reading process died: exit code {child.exitcode}"
    result = mine.recv()
    if on_error == "fail":
        assert result[:2] == ("error", "ShardReadError"), result
        assert f"{tmp_path}/train-000000.tar" in result[2]
    else:
        status, num_batches, valid, stats = result
        assert status == "ok" and num_batches == sum(SIZES) // 2
        assert stats["shards_failed"] == 1 and stats["samples_lost"] >= 1
        assert valid == sum(SIZES) - stats["samples_lost"]
