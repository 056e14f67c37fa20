"""Compatibility and safety: other readers and writers, parallel writers, kills, object stores."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from hpctrain.cli.main import main
from hpctrain.data.index import read_index
from tests.support.local_servers import moto_s3_server, s3_environment

from .conftest import image_bytes, make_image_folder

REPO = Path(__file__).resolve().parents[2]


def convert(*args: str) -> None:
    assert main(["convert", *args, "--progress", "none"]) == 0


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_webdataset_reads_our_shards_completely(image_folder: Path, tmp_path: Path) -> None:
    import webdataset as wds

    dest = tmp_path / "shards"
    convert(str(image_folder), str(dest), "--samples-per-shard", "7", "--shuffle")
    index = read_index(str(dest / "index.json"))
    urls = [index.shard_url(i) for i in range(len(index.shards))]
    samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert len(samples) == index.num_samples == 25
    assert len({s["__key__"] for s in samples}) == 25
    for sample in samples:
        image_ext = "png" if "png" in sample else "jpg"
        assert sample[image_ext][:2] in (b"\xff\xd8", b"\x89P") and sample["cls"] in (
            b"0",
            b"1",
            b"2",
        )


def test_gnu_tar_lists_our_shards(image_folder: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    convert(str(image_folder), str(dest), "--samples-per-shard", "10")
    listing = subprocess.run(
        ["tar", "-tvf", str(dest / "shard-000000.tar")], check=True, capture_output=True, text=True
    )
    assert listing.stderr == ""
    lines = listing.stdout.splitlines()
    assert (
        len(lines) == 30
        and lines[0].split()[-1] == "000000000.jpg"
        and lines[1].split()[-1] == "000000000.cls"
        and lines[2].split()[-1] == "000000000.__source__"
    )
    assert all(line.startswith("-rw-r--r-- 0/0") for line in lines)


def test_long_member_names_fall_back_to_pax_for_that_member_only(tmp_path: Path) -> None:
    from hpctrain.convert.tar import ShardTarWriter

    path = tmp_path / "long.tar"
    long_key = "k" * 120  # no "/" to split at: USTAR cannot hold it
    with open(path, "wb") as f:
        writer = ShardTarWriter(f)
        writer.add("short.jpg", b"x" * 10)
        writer.add(f"{long_key}.jpg", b"y" * 600)
        writer.add("ünïcode.cls", b"1")
        writer.finish()
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == ["short.jpg", f"{long_key}.jpg", "ünïcode.cls"]
        assert [bool(i.pax_headers) for i in infos] == [False, True, False]  # UTF-8 fits USTAR
        assert tar.extractfile(infos[1]).read() == b"y" * 600  # type: ignore[union-attr]
    listing = subprocess.run(["tar", "-tf", str(path)], check=True, capture_output=True, text=True)
    assert listing.stdout.split() == ["short.jpg", f"{long_key}.jpg", "ünïcode.cls"]


def test_shardwriter_and_gnu_tar_shards_pass_inspect_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import webdataset as wds

    wds_dir = tmp_path / "wds"
    wds_dir.mkdir()
    with wds.ShardWriter(str(wds_dir / "part-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write(
                {
                    "__key__": f"s{i:03d}",
                    "jpg": image_bytes(i),
                    "cls": str(i % 3).encode(),
                    "json": b'{"i": 1}',
                }
            )
    assert main(["inspect", str(wds_dir), "--verify", "--json"]) == 0
    assert '"num_samples": 10' in capsys.readouterr().out

    files = tmp_path / "files"
    files.mkdir()
    for i in range(6):
        (files / f"key{i}.jpg").write_bytes(image_bytes(i))
        (files / f"key{i}.cls").write_text(str(i % 2))
    gnu = tmp_path / "gnu"
    gnu.mkdir()
    subprocess.run(
        ["tar", "--sort=name", "-cf", str(gnu / "a.tar"), "-C", str(files), "."], check=True
    )
    assert main(["inspect", str(gnu / "a.tar"), "--verify", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"num_samples": 6' in out and '"1": 3' in out
    # And our converter re-shards both.
    convert(str(wds_dir), str(tmp_path / "re"), "--samples-per-shard", "3")
    assert read_index(str(tmp_path / "re" / "index.json")).num_samples == 10
    convert(str(gnu / "a.tar"), str(tmp_path / "re-gnu"))
    assert read_index(str(tmp_path / "re-gnu" / "index.json")).num_samples == 6


def test_workers_1_and_4_are_byte_identical(tmp_path: Path) -> None:
    source = make_image_folder(tmp_path / "images", per_class=12)
    args = [
        "--samples-per-shard",
        "5",
        "--shuffle",
        "--seed",
        "7",
        "--val-fraction",
        "0.2",
        "--max-side",
        "12",
    ]
    dest = tmp_path / "out"
    convert(str(source), str(dest), *args, "--workers", "1")
    one = tree_bytes(dest)
    shutil.rmtree(dest)
    convert(str(source), str(dest), *args, "--workers", "4")
    assert tree_bytes(dest) == one  # shards and both indexes
    # 37 samples: val 2 + 2 + 3 (round(0.2 * n) per class) in 2 shards, train 30 in 6; 2 indexes
    # and their compact forms
    assert len(one) == 6 + 2 + 2 + 2
    assert all("workers" not in name for name in one)


@pytest.fixture
def blocking_source(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An image folder whose last file is a FIFO: a converter blocks on it until we write to it."""
    source = make_image_folder(tmp_path / "images")
    fifo = source / "eel" / "zzz.jpg"
    os.mkfifo(fifo)
    yield source, fifo


def test_killed_conversion_leaves_no_index_and_resume_equals_uninterrupted(
    blocking_source: tuple[Path, Path], tmp_path: Path
) -> None:
    source, fifo = blocking_source
    dest = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "hpctrain",
        "convert",
        str(source),
        str(dest),
        "--samples-per-shard",
        "4",
    ]
    proc = subprocess.Popen([*command, "--progress", "none"], cwd=REPO, stderr=subprocess.PIPE)
    try:
        # 26 samples, 4 per shard: shards 0-5 complete, shard 6 (samples 24, 25=FIFO) blocks.
        deadline = time.monotonic() + 60
        while not (
            (dest / "shard-000005.tar").exists() and list(dest.glob(".shard-000006.tar.tmp-*"))
        ):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "converter never reached the FIFO"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (dest / "index.json").exists(), "a killed run leaves no index"
    assert not (dest / "shard-000006.tar").exists(), "no partial shard under a final name"
    assert sorted(p.name for p in dest.glob("shard-*.tar")) == [
        f"shard-{i:06d}.tar" for i in range(6)
    ]

    fifo.unlink()
    fifo.write_bytes(image_bytes(12345))
    assert (
        main(["convert", str(source), str(dest), "--samples-per-shard", "4", "--progress", "none"])
        == 3
    )  # no --resume: a data error
    assert (
        main(
            [
                "convert",
                str(source),
                str(dest),
                "--samples-per-shard",
                "9",
                "--resume",
                "--progress",
                "none",
            ]
        )
        == 3
    )
    assert (
        main(
            [
                "convert",
                str(source),
                str(dest),
                "--samples-per-shard",
                "4",
                "--resume",
                "--progress",
                "none",
            ]
        )
        == 0
    )
    resumed = tree_bytes(dest)
    shutil.rmtree(dest)
    convert(str(source), str(dest), "--samples-per-shard", "4")
    assert tree_bytes(dest) == resumed
    assert read_index(str(dest / "index.json")).num_samples == 26


def test_memory_destination_round_trip(
    image_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = "memory://convert-test/shards"
    try:
        convert(
            str(image_folder),
            dest,
            "--samples-per-shard",
            "10",
            "--val-fraction",
            "0.2",
            "--workers",
            "1",
        )
        fs = fsspec.filesystem("memory")
        assert fs.exists("/convert-test/shards/train/index.json")
        assert main(["inspect", dest, "--verify"]) == 0
        assert capsys.readouterr().out.count("OK:") == 2
    finally:
        fsspec.filesystem("memory").rm("/convert-test", recursive=True)


@pytest.mark.network
def test_s3_destination_on_local_moto_server(
    image_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with moto_s3_server() as endpoint, s3_environment(endpoint):
        fs = fsspec.filesystem("s3")
        fs.mkdir("bucket")
        dest = "s3://bucket/data/shards"
        # Two workers: child processes reach the server through the same environment.
        convert(str(image_folder), dest, "--samples-per-shard", "10", "--workers", "2")
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bucket/data/shards")) == [
            "index.compact",
            "index.json",
            "shard-000000.tar",
            "shard-000001.tar",
            "shard-000002.tar",
        ]
        capsys.readouterr()
        assert main(["inspect", dest, "--verify", "--json"]) == 0
        assert '"num_samples": 25' in capsys.readouterr().out
        # And back: re-shard from S3 to S3 with re-encoding.
        convert(dest, "s3://bucket/data/small", "--max-side", "8")
        data = fs.cat_file("bucket/data/small/shard-000000.tar")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            names = tar.getnames()
        assert len(names) == 75 and all(n.endswith((".jpg", ".cls", ".__source__")) for n in names)


def test_loader_reads_shardwriter_and_gnu_tar_shards(tmp_path: Path) -> None:
    import webdataset as wds

    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index

    wds_dir = tmp_path / "wds"
    wds_dir.mkdir()
    with wds.ShardWriter(str(wds_dir / "part-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"s{i:03d}", "jpg": image_bytes(i), "cls": str(i % 3).encode()})
    files = tmp_path / "files"
    files.mkdir()
    for i in range(6):
        (files / f"key{i}.jpg").write_bytes(image_bytes(i))
        (files / f"key{i}.cls").write_text(str(i % 2))
    subprocess.run(
        ["tar", "--sort=name", "-cf", str(tmp_path / "gnu.tar"), "-C", str(files), "."], check=True
    )
    cfg = DataConfig(batch_size=4, workers_per_rank=0)
    for spec, expected in (
        (str(wds_dir / "part-{000000..000002}.tar"), 10),
        (str(tmp_path / "gnu.tar"), 6),
    ):
        index = open_index(spec)
        assert index.num_samples == expected
        loader = ShardedLoader(index, cfg, rank=0, world_size=1, seed=0, train=False)
        labels = []
        for batch in loader:  # no task: the default decoders' fields, by member name
            assert batch["jpg"].shape[1:] == (3, 16, 16)
            labels += batch["cls"][batch["valid"]].tolist()
        assert len(labels) == expected
