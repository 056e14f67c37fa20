"""`hpctrain inspect`: reports, --verify, --json, and the problems it names."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from hpctrain.cli.main import main


@pytest.fixture
def shards(image_folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "shards"
    assert (
        main(
            [
                "convert",
                str(image_folder),
                str(dest),
                "--samples-per-shard",
                "10",
                "--progress",
                "none",
            ]
        )
        == 0
    )
    return dest


def test_inspect_reports_totals_histogram_and_keys(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(shards), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["verified"]
    assert (report["num_samples"], report["num_shards"]) == (25, 3)
    assert report["class_names"] == ["cat", "dog", "eel"]
    assert report["class_histogram"] == {"0": 8, "1": 8, "2": 9}
    assert report["sample_keys"][:2] == ["000000000", "000000001"]
    assert main(["inspect", str(shards / "index.json")]) == 0
    text = capsys.readouterr().out
    assert "samples: 25 in 3 shards" in text and "OK:" in text
    # Two reader processes: the same report.
    assert main(["inspect", str(shards), "--verify", "--json", "--workers", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == report


def test_inspect_split_layout(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "split"
    assert (
        main(
            ["convert", str(image_folder), str(dest), "--val-fraction", "0.2", "--progress", "none"]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["inspect", str(dest), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["index"].rsplit("/", 2)[-2] for r in reports] == ["train", "val"]
    assert sum(r["num_samples"] for r in reports) == 25


def _member_offset(path: Path, name: str) -> int:
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset_data


def test_verify_names_the_bad_member(shards: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = shards / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    offset = _member_offset(shard, "000000012.jpg")
    data[offset : offset + 16] = b"this is no jpeg!"  # same size: only decoding can tell
    shard.write_bytes(bytes(data))
    # Without --verify the digest check still catches it, naming the shard.
    assert main(["inspect", str(shards)]) == 3  # a data error
    assert "shard-000001.tar: sha256 differs from the index" in capsys.readouterr().out
    assert main(["inspect", str(shards), "--verify"]) == 3
    out = capsys.readouterr().out
    assert "shard-000001.tar: 000000012.jpg: cannot decode image" in out


def test_verify_reports_truncated_and_missing_shards(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = shards / "shard-000002.tar"
    offset = _member_offset(shard, "000000023.jpg")
    shard.write_bytes(shard.read_bytes()[: offset + 100])
    (shards / "shard-000000.tar").unlink()
    assert main(["inspect", str(shards), "--verify", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert [s["ok"] for s in report["shards"]] == [False, True, False]
    errors = "\n".join(report["errors"])
    assert "shard-000000.tar: shard not found" in errors
    assert "shard-000002.tar: 000000023.jpg: unreadable member: unexpected end of data" in errors


def test_inspect_missing_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 3
    assert "not found" in capsys.readouterr().err


def test_inspect_brace_pattern_without_index(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (shards / "index.json").unlink()
    assert main(["inspect", str(shards / "shard-{000000..000001}.tar"), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["index"] is None and report["num_samples"] == 20 and report["num_shards"] == 2
