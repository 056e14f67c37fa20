"""What a conversion may delete in DEST: never its source, never more than it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli.main import main


def convert(*args: str | Path) -> int:
    return main(["convert", *map(str, args), "--progress", "none"])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_dest_that_is_holds_or_lies_inside_the_source_is_refused(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = tmp_path / "x"
    assert convert(image_folder, x, "--samples-per-shard", "10") == 0
    before = snapshot(x)
    # Re-sharding in place deleted the index and the shards before reading them.
    assert convert(x, x, "--overwrite", "--max-side", "8") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"DEST {x} is, holds or lies inside the source" in err
    assert snapshot(x) == before
    link = tmp_path / "link"
    link.symlink_to(x)
    assert convert(link, x, "--overwrite") == 2  # the same folder under another name
    assert convert(f"{x}/shard-{{000000..000001}}.tar", x, "--overwrite") == 2
    assert convert(x / "index.json", tmp_path, "--overwrite") == 2  # DEST holds the source
    assert snapshot(x) == before
    # DEST inside an image folder would become one of its classes.
    assert convert(image_folder, image_folder / "shards") == 2
    assert not (image_folder / "shards").exists()

    split = tmp_path / "split"
    assert convert(image_folder, split, "--val-fraction", "0.2") == 0
    before = snapshot(split)
    train = split / "train"
    assert convert(train, train, "--overwrite", "--prefix", "train") == 2
    assert convert(train, split, "--overwrite") == 2
    assert snapshot(split) == before
    capsys.readouterr()
    assert convert(train, tmp_path / "resharded") == 0  # apart from the source: fine


def test_text_dest_inside_the_corpus_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello")
    assert convert(corpus, corpus / "tokens", "--tokenizer", "bytes") == 2
    assert "is, holds or lies inside the source" in capsys.readouterr().err
    assert convert(corpus, tmp_path / "tokens", "--tokenizer", "bytes") == 0
    tokens = tmp_path / "tokens"
    before = snapshot(tokens)
    assert convert(tokens, tokens, "--overwrite", "--sample-tokens", "2") == 2
    assert snapshot(tokens) == before


def test_two_layouts_in_one_folder_are_refused_or_replaced(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lay = tmp_path / "lay"
    assert convert(image_folder, lay, "--samples-per-shard", "10") == 0
    before = snapshot(lay)
    capsys.readouterr()
    # A flat index beside train/ and val/: `data.train: lay` trained on validation samples.
    assert convert(image_folder, lay, "--val-fraction", "0.2") == 3
    err = capsys.readouterr().err
    assert f"holds a layout without --val-fraction ({lay}/index.json)" in err
    assert "--overwrite" in err
    assert snapshot(lay) == before
    (lay / "notes.txt").write_text("mine")
    assert convert(image_folder, lay, "--val-fraction", "0.2", "--overwrite") == 0
    assert sorted(snapshot(lay)) == [
        "notes.txt",
        "train/index.compact",
        "train/index.json",
        "train/train-000000.tar",
        "val/index.compact",
        "val/index.json",
        "val/val-000000.tar",
    ]
    (lay / "val" / "mine.txt").write_text("mine")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello")
    assert convert(corpus, lay, "--tokenizer", "bytes") == 3  # text conversions too
    assert "holds a train/ and val/ layout" in capsys.readouterr().err
    assert convert(image_folder, lay, "--samples-per-shard", "10", "--overwrite") == 0
    assert sorted(snapshot(lay)) == [
        "index.compact",
        "index.json",
        "notes.txt",
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
        "val/mine.txt",
    ]
    assert not (lay / "train").exists()


def test_a_skipped_txt_of_the_user_is_not_removed(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "skipped.txt").write_text("my own notes")
    # The commit writes DEST/skipped.txt, or removes it when nothing was skipped.
    assert convert(image_folder, dest) == 3
    assert f"{dest}/skipped.txt: not written by a conversion here" in capsys.readouterr().err
    assert (dest / "skipped.txt").read_text() == "my own notes"
    assert convert(image_folder, dest, "--overwrite") == 0  # the user said so
    assert not (dest / "skipped.txt").exists()


def test_text_conversions_keep_one_layout_per_folder_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sibling of #31 item 8 for `--tokenizer`: both directions, refused, then replaced."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"d{i}.txt").write_text(f"document {i} " * 4)
    lay = tmp_path / "lay"
    text = [corpus, lay, "--tokenizer", "bytes", "--sample-tokens", "8"]
    assert convert(*text, "--val-fraction", "0.2") == 0
    before = snapshot(lay)
    capsys.readouterr()
    assert convert(*text) == 3  # a flat index.json beside train/ and val/
    err = capsys.readouterr().err
    assert f"holds a train/ and val/ layout ({lay}/train/index.json, {lay}/val/index.json)" in err
    assert snapshot(lay) == before
    assert convert(*text, "--overwrite") == 0
    assert sorted(snapshot(lay)) == ["index.compact", "index.json", "shard-000000.tar"]
    before = snapshot(lay)
    assert convert(*text, "--val-fraction", "0.2") == 3  # and back
    assert f"holds a layout without --val-fraction ({lay}/index.json)" in capsys.readouterr().err
    assert snapshot(lay) == before
    assert convert(*text, "--val-fraction", "0.2", "--overwrite") == 0
    assert sorted(snapshot(lay)) == [
        "train/index.compact",
        "train/index.json",
        "train/train-000000.tar",
        "val/index.compact",
        "val/index.json",
        "val/val-000000.tar",
    ]


def test_the_same_command_again_has_nothing_to_do_and_another_is_refused(
    image_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A page of the docs after `make demo`, which converted the same images the same way."""
    out = tmp_path / "shards"
    same = ("--val-fraction", "0.2", "--samples-per-shard", "10", "--shuffle", "--seed", "0")
    assert convert(image_folder, out, *same) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert convert(image_folder, out, *same) == 0
    assert capsys.readouterr().out == (
        f"{out}: converted already by the same command (its index.json says so): nothing to "
        "do; --overwrite converts again\n"
    )
    assert snapshot(out) == before
    assert convert(image_folder, out, "--val-fraction", "0.2") == 3  # other options
    assert "already holds shards or an index; use --overwrite" in capsys.readouterr().err
