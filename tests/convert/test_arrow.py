"""Arrow/parquet sources: Hugging Face save_to_disk folders and parquet files, built with pyarrow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.data.index import read_index
from hpctrain.errors import install_hint

from .conftest import image_bytes
from .test_any_sample import palette_png, read_back

pa = pytest.importorskip("pyarrow")  # in the dev extra: CI has it
import pyarrow.parquet as pq  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def convert(*args: str) -> int:
    return main(["convert", *args, "--progress", "none"])


def save_to_disk(folder: Path, table: pa.Table, features: dict[str, object]) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC stream + two JSON files."""
    folder.mkdir(parents=True)
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        for batch in table.to_batches(max_chunksize=2):
            out.write_batch(batch)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": name}], "_split": "train"})
    )
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    return folder


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    n = 5
    table = pa.table(
        {
            "image": pa.array(
                [{"bytes": image_bytes(i), "path": f"{i}.jpg"} for i in range(n)], IMAGE
            ),
            "mask": pa.array([{"bytes": palette_png(i), "path": None} for i in range(n)], IMAGE),
            "label": pa.array([i % 2 for i in range(n)], pa.int64()),
            "text": pa.array([f"caption {i}" for i in range(n)]),
            "score": pa.array([0.5 * i for i in range(n)]),
            "tags": pa.array([["a", str(i)] for i in range(n)]),
        }
    )
    features = {
        "image": {"_type": "Image"},
        "mask": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": ["cat", "dog"]},
        "text": {"_type": "Value", "dtype": "string"},
        "score": {"_type": "Value", "dtype": "float64"},
        "tags": {"feature": {"_type": "Value", "dtype": "string"}, "_type": "Sequence"},
    }
    return save_to_disk(tmp_path / "hf", table, features)


def test_hf_save_to_disk_folder(hf_folder: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    assert convert(str(hf_folder), str(dest), "--samples-per-shard", "2") == 0
    index = read_index(str(dest / "index.json"))
    assert index.class_names == ("cat", "dog")  # from the ClassLabel feature, written as cls
    assert index.extra["source_kind"] == "arrow"
    samples = read_back(dest)
    assert list(samples) == [f"{i:09d}" for i in range(5)]
    for i, sample in enumerate(samples.values()):
        assert sample == {
            "image.jpg": image_bytes(i),  # the encoded bytes as they are, format detected
            "mask.png": palette_png(i),
            "cls": str(i % 2).encode(),
            "text": f"caption {i}".encode(),
            # the columns without a member of their own, gathered (sorted keys, no spaces)
            "json": json.dumps(
                {"score": 0.5 * i, "tags": ["a", str(i)]}, separators=(",", ":")
            ).encode(),
        }


def test_parquet_glob_with_column_mapping(tmp_path: Path) -> None:
    (tmp_path / "pq").mkdir()
    for part in range(2):
        rows = range(3 * part, 3 * part + 3)
        pq.write_table(
            pa.table(
                {
                    "__key__": [f"k{i:02d}" for i in rows],
                    "png": pa.array([{"bytes": palette_png(i), "path": None} for i in rows], IMAGE),
                    "caption": [f"c{i}" for i in rows],
                    "junk": [b"x" * i for i in rows],
                    "label": list(rows),
                }
            ),
            tmp_path / "pq" / f"train-{part:05d}.parquet",
        )
    dest = tmp_path / "out"
    args = ["--column", "png=seg.png", "--column", "caption=txt", "--column", "junk="]
    assert convert(str(tmp_path / "pq" / "train-*.parquet"), str(dest), *args) == 0
    samples = read_back(dest)
    assert list(samples) == [f"k{i:02d}" for i in range(6)]  # __key__ names the samples
    assert samples["k04"] == {
        "seg.png": palette_png(4),
        "txt": b"c4",
        "cls": b"4",  # the label column is cls, as in manifests
    }
    assert "--column junk=" in read_index(str(dest / "index.json")).command


def test_unknown_column_and_collisions_are_named(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert convert(str(hf_folder), str(tmp_path / "a"), "--column", "picture=img.jpg") == 2
    err = capsys.readouterr().err
    assert "--column picture=img.jpg" in err and "no column 'picture'" in err
    assert "columns: image, mask, label, text, score, tags" in err
    assert convert(str(hf_folder), str(tmp_path / "b"), "--column", "text=cls") == 2
    assert "columns 'label' and 'text' would both write the member 'cls'" in capsys.readouterr().err


def test_image_path_without_bytes_is_read_or_a_bad_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "hf"
    table = pa.table(
        {"image": pa.array([{"bytes": None, "path": f"img/{i}.jpg"} for i in range(3)], IMAGE)}
    )
    save_to_disk(folder, table, {"image": {"_type": "Image"}})
    (folder / "img").mkdir()
    for i in (0, 2):
        (folder / "img" / f"{i}.jpg").write_bytes(image_bytes(i))
    assert convert(str(folder), str(tmp_path / "out")) == 3
    assert (
        f"{folder} row 2: column 'image': cannot read {folder}/img/1.jpg" in capsys.readouterr().err
    )
    assert convert(str(folder), str(tmp_path / "out"), "--on-error", "skip", "--overwrite") == 0
    samples = read_back(tmp_path / "out")
    assert {k: s["image.jpg"] for k, s in samples.items()} == {
        "000000000": image_bytes(0),
        "000000002": image_bytes(2),
    }


def test_dataset_dict_folder_names_a_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert convert(str(tmp_path / "dd"), str(tmp_path / "out")) == 3
    assert f"convert one: {tmp_path / 'dd'}/train" in capsys.readouterr().err


def test_missing_pyarrow_names_the_extra(
    hf_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    assert convert(str(hf_folder), str(tmp_path / "out")) == 2
    assert f"needs pyarrow: {install_hint('arrow')}" in capsys.readouterr().err


def test_file_structs_that_are_not_images_keep_their_bytes(tmp_path: Path) -> None:
    """An `Audio`-like {bytes, path} struct: named by its path's extension, bytes unchanged."""
    sounds = [b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes([i]) * 9 for i in range(2)]
    table = pa.table(
        {
            "audio": pa.array(
                [{"bytes": b, "path": f"clip{i}.wav"} for i, b in enumerate(sounds)], IMAGE
            )
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    assert convert(str(tmp_path / "a.parquet"), str(tmp_path / "out")) == 0
    assert [s["audio.wav"] for s in read_back(tmp_path / "out").values()] == sounds


def test_label_column_is_cls_as_in_manifests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule for every tabular source: the label column (`--label-column`) becomes `cls`."""
    images = [{"bytes": image_bytes(i), "path": None} for i in range(3)]
    table = pa.table(
        {
            "image": pa.array(images, IMAGE),
            "label": ["dog", "cat", "dog"],
            "species": [7, 3, 7],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    manifest = tmp_path / "m.jsonl"
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(image_bytes(i))
    manifest.write_text(
        "".join(
            json.dumps({"path": f"{i}.jpg", "label": label, "species": species}) + "\n"
            for i, (label, species) in enumerate(zip(["dog", "cat", "dog"], [7, 3, 7], strict=True))
        )
    )
    for src in ("t.parquet", "m.jsonl"):
        assert convert(str(tmp_path / src), str(tmp_path / f"{src}-out")) == 0
        index = read_index(str(tmp_path / f"{src}-out" / "index.json"))
        assert index.class_names == ("cat", "dog"), src
        samples = read_back(tmp_path / f"{src}-out")
        assert [s["cls"] for s in samples.values()] == [b"1", b"0", b"1"], src
        assert [s["json"] for s in samples.values()] == [
            b'{"species":7}',
            b'{"species":3}',
            b'{"species":7}',
        ], src
        out = tmp_path / f"{src}-species"
        assert convert(str(tmp_path / src), str(out), "--label-column", "species") == 0
        assert read_index(str(out / "index.json")).class_names == ()  # integers: the labels
        assert [s["cls"] for s in read_back(out).values()] == [b"7", b"3", b"7"], src
        assert convert(str(tmp_path / src), str(tmp_path / "x"), "--label-column", "kind") == 2
        err = capsys.readouterr().err
        assert f"--label-column kind: {tmp_path / src} has no column 'kind'" in err


def test_a_label_column_of_lists_is_a_bad_sample_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(pa.table({"x.bin": [b"a", b"b"], "label": [[1], [2]]}), tmp_path / "t.parquet")
    assert convert(str(tmp_path / "t.parquet"), str(tmp_path / "out")) == 3
    err = capsys.readouterr().err.strip()
    assert "row 1" in err and "column 'label': [1] is not an integer" in err
    assert len(err.splitlines()) == 1
