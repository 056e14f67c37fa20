"""`hpctrain convert`: image folders to shards + index, splits, shuffling, errors, safety."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.convert.errors import ConvertError
from hpctrain.convert.layout import assign_shards, parse_size, split_train_val
from hpctrain.convert.sources.base import SampleRef
from hpctrain.data.index import read_index

from .conftest import CLASSES, image_bytes


def members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]  # type: ignore[union-attr]


def samples_of(folder: Path) -> dict[str, dict[str, bytes]]:
    """key -> {ext: bytes} over every shard an index in `folder` lists (in index order)."""
    index = read_index(str(folder / "index.json"))
    out: dict[str, dict[str, bytes]] = {}
    for i in range(len(index.shards)):
        for name, data in members(Path(index.shard_url(i))):
            key, ext = name.split(".", 1)
            out.setdefault(key, {})[ext] = data
    return out


def test_folder_to_shards_with_index(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert "25 samples in 3 shards" in capsys.readouterr().out
    index = read_index(str(dest / "index.json"))
    assert index.class_names == CLASSES
    assert [s.url for s in index.shards] == [
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
    ]
    assert [s.num_samples for s in index.shards] == [10, 10, 5]
    for shard in index.shards:
        assert (dest / shard.url).stat().st_size == shard.num_bytes
    assert (
        index.command.startswith("hpctrain convert ") and "--samples-per-shard 10" in index.command
    )
    samples = samples_of(dest)
    assert len(samples) == 25
    # Source order: classes sorted, files sorted; labels are class positions; bytes unchanged.
    assert samples["000000000"]["jpg"] == (image_folder / "cat" / "img000.jpg").read_bytes()
    assert samples["000000000"]["cls"] == b"0"
    assert samples["000000024"]["png"] == (image_folder / "eel" / "zz.png").read_bytes()
    assert samples["000000024"]["cls"] == b"2"
    assert not list(dest.glob(".*")), "no temp or state files left behind"


def test_members_are_plain_ustar_with_fixed_metadata(image_folder: Path, tmp_path: Path) -> None:
    dest = tmp_path / "shards"
    assert main(["convert", str(image_folder), str(dest), "--progress", "none"]) == 0
    raw = (dest / "shard-000000.tar").read_bytes()
    assert len(raw) % tarfile.RECORDSIZE == 0
    with tarfile.open(dest / "shard-000000.tar") as tar:
        infos = tar.getmembers()
    assert len(infos) == 75  # 25 samples: image, cls and __source__ (the path it came from)
    for info in infos:
        assert (info.mtime, info.uid, info.gid, info.mode, info.uname, info.gname) == (
            0,
            0,
            0,
            0o644,
            "",
            "",
        )
        assert not info.pax_headers
        # Byte-for-byte the header tarfile itself writes for a USTAR member with this metadata.
        assert raw[info.offset : info.offset + 512] == info.tobuf(tarfile.USTAR_FORMAT)


def test_deterministic_and_split_is_stratified(image_folder: Path, tmp_path: Path) -> None:
    args = [
        "--val-fraction",
        "0.25",
        "--shuffle",
        "--seed",
        "3",
        "--samples-per-shard",
        "7",
        "--progress",
        "none",
    ]
    assert main(["convert", str(image_folder), str(tmp_path / "a"), *args]) == 0
    (tmp_path / "a").rename(tmp_path / "first")
    assert main(["convert", str(image_folder), str(tmp_path / "a"), *args]) == 0
    for split in ("train", "val"):
        files = sorted(p.name for p in (tmp_path / "a" / split).iterdir())
        assert files == sorted(p.name for p in (tmp_path / "first" / split).iterdir())
        for name in files:
            assert (tmp_path / "a" / split / name).read_bytes() == (
                tmp_path / "first" / split / name
            ).read_bytes()
    train, val = samples_of(tmp_path / "a" / "train"), samples_of(tmp_path / "a" / "val")
    assert not set(train) & set(val) and len(train) + len(val) == 25
    # round(0.25 * 8) = 2 of each 8-image class, round(0.25 * 9) = 2 of the 9-image class.
    assert sorted(int(s["cls"]) for s in val.values()) == [0, 0, 1, 1, 2, 2]
    assert (tmp_path / "a" / "val" / "val-000000.tar").exists()
    assert list(train) != sorted(train), "shuffled"


def test_shuffle_depends_on_seed(image_folder: Path, tmp_path: Path) -> None:
    orders = []
    for seed in ("1", "2"):
        dest = tmp_path / seed
        assert (
            main(
                [
                    "convert",
                    str(image_folder),
                    str(dest),
                    "--shuffle",
                    "--seed",
                    seed,
                    "--progress",
                    "none",
                ]
            )
            == 0
        )
        orders.append(list(samples_of(dest)))
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_non_image_fails_with_path_or_is_skipped(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = image_folder / "dog" / "notes.txt"
    bad.write_text("not an image")
    dest = tmp_path / "shards"
    assert (
        main(
            [
                "convert",
                str(image_folder),
                str(dest),
                "--samples-per-shard",
                "4",
                "--progress",
                "none",
            ]
        )
        == 3  # a data error
    )
    err = capsys.readouterr().err
    assert str(bad) in err and "not an image" in err
    assert not (dest / "index.json").exists()
    assert (
        main(
            [
                "convert",
                str(image_folder),
                str(dest),
                "--on-error",
                "skip",
                "--overwrite",
                "--progress",
                "none",
            ]
        )
        == 0
    )
    assert (dest / "skipped.txt").read_text() == f"{bad}\tnot an image\n"
    index = read_index(str(dest / "index.json"))
    assert index.num_samples == 25 and index.extra["num_skipped"] == 1


def test_refuses_to_overwrite_without_flag(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "shards"
    assert main(["convert", str(image_folder), str(dest), "--progress", "none"]) == 0
    # the same command again has nothing to do (#49); another is refused
    assert main(["convert", str(image_folder), str(dest), "--progress", "none"]) == 0
    assert "converted already by the same command" in capsys.readouterr().out
    assert main(["convert", str(image_folder), str(dest), "--shuffle", "--progress", "none"]) == 3
    assert "--overwrite" in capsys.readouterr().err
    # A finished conversion run again with --resume (a requeued job) is a no-op success.
    assert main(["convert", str(image_folder), str(dest), "--resume", "--progress", "none"]) == 0


def test_shard_size_planning() -> None:
    samples = [SampleRef(key=f"{i:09d}", url=f"/x/{i}.jpg", size=1000, label=0) for i in range(10)]
    # Each sample: 512 + 1024 (image) + 512 + 512 (cls) = 2560 bytes.
    shards = assign_shards(samples, samples_per_shard=None, shard_size=3 * 2560)
    assert [len(s) for s in shards] == [3, 3, 3, 1]
    assert (
        parse_size("512MB") == 512 * 10**6
        and parse_size("1GiB") == 2**30
        and parse_size("2048") == 2048
    )
    with pytest.raises(ConvertError, match="--shard-size"):
        parse_size("lots")


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(ConvertError, match="--val-fraction"):
        split_train_val([], 1.5, 0)


def test_manifest_csv_and_jsonl(image_folder: Path, tmp_path: Path) -> None:
    rows = [
        ("cat/img000.jpg", "cat", "a"),
        ("dog/img001.jpg", "dog", "b"),
        ("eel/zz.png", "eel", "c"),
    ]
    (image_folder / "m.csv").write_text(
        "path,label,caption\n" + "".join(f"{p},{name},{c}\n" for p, name, c in rows)
    )
    (image_folder / "m.jsonl").write_text(
        "".join(
            json.dumps({"path": str(image_folder / p), "label": i, "caption": c}) + "\n"
            for i, (p, _, c) in enumerate(rows)
        )
    )
    assert (
        main(["convert", str(image_folder / "m.csv"), str(tmp_path / "csv"), "--progress", "none"])
        == 0
    )
    index = read_index(str(tmp_path / "csv" / "index.json"))
    assert index.class_names == ("cat", "dog", "eel")
    samples = samples_of(tmp_path / "csv")
    assert [s["cls"] for s in samples.values()] == [b"0", b"1", b"2"]
    assert json.loads(samples["000000001"]["json"]) == {"caption": "b"}
    assert (
        main(
            [
                "convert",
                str(image_folder / "m.jsonl"),
                str(tmp_path / "jsonl"),
                "--progress",
                "none",
            ]
        )
        == 0
    )
    samples = samples_of(tmp_path / "jsonl")
    assert samples["000000002"]["png"] == image_bytes(999, "PNG")
    assert read_index(str(tmp_path / "jsonl" / "index.json")).class_names == ()


def test_reencode_max_side(image_folder: Path, tmp_path: Path) -> None:
    from io import BytesIO

    from PIL import Image

    dest = tmp_path / "small"
    assert (
        main(["convert", str(image_folder), str(dest), "--max-side", "8", "--progress", "none"])
        == 0
    )
    for sample in samples_of(dest).values():
        assert set(sample) == {"jpg", "cls", "__source__"}
        assert Image.open(BytesIO(sample["jpg"])).size == (8, 8)


def test_reshard_existing_shards(image_folder: Path, tmp_path: Path) -> None:
    assert (
        main(
            [
                "convert",
                str(image_folder),
                str(tmp_path / "a"),
                "--samples-per-shard",
                "4",
                "--progress",
                "none",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--samples-per-shard",
                "10",
                "--progress",
                "none",
            ]
        )
        == 0
    )
    index = read_index(str(tmp_path / "b" / "index.json"))
    assert [s.num_samples for s in index.shards] == [10, 10, 5]
    assert index.class_names == CLASSES  # carried over from the source index
    assert samples_of(tmp_path / "b") == samples_of(tmp_path / "a")


def test_manifest_with_fsspec_urls(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        for i in range(3):
            fs.pipe_file(f"/manifest-test/img{i}.jpg", image_bytes(i))
        lines = [
            json.dumps({"path": f"memory://manifest-test/img{i}.jpg", "label": i % 2})
            for i in range(3)
        ]
        fs.pipe_file("/manifest-test/list.jsonl", ("\n".join(lines) + "\n").encode())
        convert_args = [
            "convert",
            "memory://manifest-test/list.jsonl",
            str(tmp_path / "out"),
            "--progress",
            "none",
        ]
        assert main(convert_args) == 0
        samples = samples_of(tmp_path / "out")
        assert [s["jpg"] for s in samples.values()] == [image_bytes(i) for i in range(3)]
        assert [s["cls"] for s in samples.values()] == [b"0", b"1", b"0"]
        assert "json" not in samples["000000000"]  # no extra fields, no .json member
    finally:
        fs.rm("/manifest-test", recursive=True)


def test_memory_destination_needs_one_worker(
    image_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["convert", str(image_folder), "memory://x/y", "--workers", "2", "--progress", "none"])
        == 3
    )
    assert "--workers 1" in capsys.readouterr().err


def test_plain_progress_lines() -> None:
    import io

    from hpctrain.convert.progress import Progress

    stream = io.StringIO()
    progress = Progress(10, "auto", interval=0.0, stream=stream)  # StringIO is no terminal: plain
    progress.update(4)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert (
        lines[0].startswith("convert: 4/10 samples (40%)")
        and "img/s" in lines[0]
        and "ETA" in lines[0]
    )
    assert lines[-1].startswith("convert: 4/10 samples")


def test_split_output_as_source_names_the_split(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    convert_args = ["--val-fraction", "0.2", "--progress", "none"]
    assert main(["convert", str(image_folder), str(tmp_path / "a"), *convert_args]) == 0
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--progress", "none"]) == 3
    assert f"{tmp_path / 'a'}/train" in capsys.readouterr().err
