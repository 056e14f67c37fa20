"""Each converted sample keeps the path of the file it came from, as `KEY.__source__` (#43
item 13), and `--source images` converts a folder of images without labels."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.convert.fields import check_field_name
from hpctrain.data.fieldnames import SOURCE_FIELD
from hpctrain.errors import EXIT_DATA, DataError
from tests.convert.conftest import image_bytes


def sources(shards: Path) -> dict[str, str]:
    """key -> `__source__` of every sample of the shards under `shards`."""
    found = {}
    for path in sorted(shards.rglob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                key, _, field = member.name.partition(".")
                if field == SOURCE_FIELD:
                    found[key] = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    return found


def test_an_image_folder_keeps_each_path_under_it(image_folder: Path, tmp_path: Path) -> None:
    assert main(["convert", str(image_folder), "-o", str(tmp_path / "s"), "--shuffle"]) == 0
    found = sources(tmp_path / "s")
    expected = {str(p.relative_to(image_folder)) for p in image_folder.rglob("*.*")}
    assert len(found) == 25 and set(found.values()) == expected
    assert main(["inspect", str(tmp_path / "s"), "--verify"]) == 0  # decodes every field


def test_a_manifest_keeps_its_path_column_as_written(tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    for i in range(3):
        (tmp_path / "pics" / f"{i}.jpg").write_bytes(image_bytes(i))
    rows = "".join(f"pics/{i}.jpg,{i % 2}\n" for i in range(3))
    (tmp_path / "list.csv").write_text("path,label\n" + rows)
    assert main(["convert", str(tmp_path / "list.csv"), str(tmp_path / "s")]) == 0
    assert sorted(sources(tmp_path / "s").values()) == ["pics/0.jpg", "pics/1.jpg", "pics/2.jpg"]


def test_no_field_of_the_data_may_take_its_name() -> None:
    """A Python or Arrow source's bytes value under that name would become the member."""
    with pytest.raises(DataError, match="'__Source__' is hpctrain's field"):
        check_field_name("__Source__", "pkg.mod:fn sample 0")


def test_images_without_labels_at_any_depth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new"
    (new / "day 2" / "deep").mkdir(parents=True)
    (new / ".thumbs").mkdir()
    (new / "b.jpg").write_bytes(image_bytes(1))
    (new / "a.PNG").write_bytes(image_bytes(2, "PNG"))
    (new / "day 2" / "deep" / "c.jpg").write_bytes(image_bytes(3))
    (new / "notes.txt").write_text("not an image")
    (new / ".thumbs" / "b.jpg").write_bytes(image_bytes(4))
    assert main(["convert", str(new), "-o", str(tmp_path / "s"), "--source", "images"]) == 0
    assert sources(tmp_path / "s") == {
        "000000000": "a.PNG",
        "000000001": "b.jpg",
        "000000002": "day 2/deep/c.jpg",
    }
    with tarfile.open(next((tmp_path / "s").glob("*.tar"))) as tar:
        assert not [m.name for m in tar.getmembers() if m.name.endswith(".cls")]  # no labels
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    assert (
        main(["convert", str(tmp_path / "empty"), "-o", str(tmp_path / "e"), "--source", "images"])
        == EXIT_DATA
    )
    assert "no image files (" in capsys.readouterr().err
