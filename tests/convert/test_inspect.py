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
    # the loader's own decoder's words: the shard, the sample's key and the field
    assert (
        "shard-000001.tar: sample '000000012': field 'jpg' (" in out and "cannot be decoded" in out
    )


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
    assert "shard-000002.tar: unreadable tar after sample 000000021: truncated tar member" in errors


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


def _replace_member(shard: Path, name: str, data: bytes) -> None:
    """Overwrite a member's bytes in place (same size: only decoding or a digest can tell)."""
    raw = bytearray(shard.read_bytes())
    offset = _member_offset(shard, name)
    raw[offset : offset + len(data)] = data
    shard.write_bytes(bytes(raw))


def test_labels_outside_the_index_classes_are_flagged(
    shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _replace_member(shards / "shard-000000.tar", "000000003.cls", b"7")
    assert main(["inspect", str(shards), "--verify"]) == 3
    out = capsys.readouterr().out
    assert "shard-000000.tar: 000000003.cls: label 7 outside the index's 3 classes" in out


def test_verify_decodes_every_field_of_general_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    from hpctrain.convert.tar import ShardTarWriter

    from .test_any_sample import npy_bytes, palette_png

    with open(tmp_path / "s.tar", "wb") as f:
        writer = ShardTarWriter(f)
        for i in range(3):
            writer.add(f"k{i}.mask.png", palette_png(i))
            writer.add(f"k{i}.depth.npy", npy_bytes(np.zeros((2, 2), np.float32)))
            writer.add(f"k{i}.txt", b"ok")
        writer.finish()
    assert main(["inspect", str(tmp_path / "s.tar"), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 3
    _replace_member(tmp_path / "s.tar", "k1.depth.npy", b"\x93NUMPY garbage!!")
    assert main(["inspect", str(tmp_path / "s.tar"), "--verify"]) == 3
    out = capsys.readouterr().out
    assert "s.tar: sample 'k1': field 'depth.npy'" in out and "cannot be decoded" in out


def test_pax_headers_and_long_names_are_read_like_the_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards from other writers (webdataset's ShardWriter writes a PAX header per member)."""
    import io

    from .conftest import image_bytes

    path = tmp_path / "pax.tar"
    long_key = "dir/" + "k" * 150  # longer than USTAR's name field: a PAX path record
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key in ("a", long_key):
            for field, data in (("jpg", image_bytes(1)), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mtime = len(data), 1.5  # a fractional mtime: PAX headers
                tar.addfile(info, io.BytesIO(data))
    assert main(["inspect", str(path), "--verify", "--json", "--keys", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_samples"] == 2 and report["sample_keys"] == ["a", long_key]


@pytest.mark.parametrize("verify", [False, True])
def test_token_shards_of_large_members_check_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], verify: bool
) -> None:
    """Members of several kB one after another: the loader's read-ahead takes part of the next
    one and reads it again from its start; inspect's hashing stream must read each byte once
    (its size and sha256 against the index)."""
    text = tmp_path / "text"
    text.mkdir()
    for i in range(6):
        (text / f"{i}.txt").write_text(f"document {i} " * (400 + 300 * i))
    assert main(["convert", str(text), str(tmp_path / "tok"), "--tokenizer", "bytes",
                 "--sample-tokens", "4000"]) == 0  # fmt: skip
    capsys.readouterr()
    args = ["inspect", str(tmp_path / "tok"), *(["--verify"] if verify else [])]
    assert main(args) == 0, capsys.readouterr().out
    assert "PROBLEMS" not in capsys.readouterr().out
