"""What convert reads from its sources: symlinks, keys, manifests' encodings, label columns."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli.main import main
from hpctrain.data.index import read_index

from .conftest import image_bytes


def convert(*args: str | Path) -> int:
    return main(["convert", *map(str, args), "--progress", "none"])


def test_symlinked_class_folders_and_subfolders_are_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"  # $STORE, where $SCRATCH's class folders link to
    for name in ("square", "star", "extra"):
        (store / name).mkdir(parents=True)
        for i in range(2):
            (store / name / f"{i}.jpg").write_bytes(image_bytes(i))
    imgs = tmp_path / "imgs"
    (imgs / "circle").mkdir(parents=True)
    (imgs / "circle" / "0.jpg").write_bytes(image_bytes(9))
    (imgs / "circle" / "more").symlink_to(store / "extra")  # a folder inside a class
    (imgs / "square").symlink_to(store / "square")
    (imgs / "star").symlink_to(store / "star")
    assert convert(imgs, tmp_path / "out") == 0
    index = read_index(str(tmp_path / "out" / "index.json"))
    assert index.class_names == ("circle", "square", "star")
    assert index.num_samples == 7
    index_folder = tmp_path / "out"
    with tarfile.open(index_folder / index.shards[0].url) as tar:
        labels = [
            int(tar.extractfile(m).read())  # type: ignore[union-attr]
            for m in tar
            if m.name.endswith(".cls")
        ]
    assert labels == [0, 0, 0, 1, 1, 2, 2]  # circle: its own image and the linked folder's two
    # A loop is a clear error naming the path, not a walk without end.
    (store / "star" / "again").symlink_to(imgs)
    assert convert(imgs, tmp_path / "loop") == 3
    err = capsys.readouterr().err
    assert f"{imgs}/star/again/star: a symlink loop" in err
    assert len(err.strip().splitlines()) == 1


def test_symlinked_folders_of_a_text_corpus_are_read(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("linked document")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("own document")
    (corpus / "linked").symlink_to(elsewhere)
    assert convert(corpus, tmp_path / "tokens", "--tokenizer", "bytes") == 0
    index = read_index(str(tmp_path / "tokens" / "index.json"))
    assert index.num_tokens == len("own document") + len("linked document") + 2


@pytest.mark.parametrize(
    "key", ["../../etc/x", "a/../../b", "/etc/x", "a//b", "./x", "a/./b", "a/", "..\\x"]
)
def test_keys_leaving_the_folder_are_refused_naming_them(key: str) -> None:
    from hpctrain.convert.sources.generated import encode_sample
    from hpctrain.errors import DataError

    with pytest.raises(DataError, match=f"key {re.escape(repr(key))}"):
        encode_sample({"__key__": key, "txt": "x"}, 0, "m:f")
    key_ok, _ = encode_sample({"__key__": "train/a/x", "txt": "x"}, 0, "m:f")
    assert key_ok == "train/a/x"  # folders inside the shard stay allowed


def test_python_and_shard_sources_with_dotdot_keys_write_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "evilkeys.py").write_text(
        "def make():\n    return [{'__key__': '../../etc/x', 'txt': 'owned'}]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert convert("evilkeys:make", tmp_path / "out") == 3
    err = capsys.readouterr().err
    assert "evilkeys:make: sample 0: key '../../etc/x'" in err
    assert not (tmp_path / "out").exists()
    # A shard made elsewhere (re-sharding copies keys as they are).
    shard = tmp_path / "in" / "shard-000000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("../../etc/x.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"owned"))
    assert convert(shard.parent, tmp_path / "out2") == 3
    assert f"{shard}: key '../../etc/x'" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


BOM = b"\xef\xbb\xbf"  # Excel's "CSV UTF-8" begins with it


def test_manifests_with_a_byte_order_mark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(2):
        (tmp_path / f"{i}.jpg").write_bytes(image_bytes(i))
    (tmp_path / "label_first.csv").write_bytes(BOM + b"label,path\ncat,0.jpg\ndog,1.jpg\n")
    (tmp_path / "path_first.csv").write_bytes(BOM + b"path,label\n0.jpg,cat\n1.jpg,dog\n")
    (tmp_path / "rows.jsonl").write_bytes(
        BOM + b'{"path": "0.jpg", "label": "cat"}\n{"path": "1.jpg", "label": "dog"}\n'
    )
    for name in ("label_first.csv", "path_first.csv", "rows.jsonl"):
        out = tmp_path / f"out-{name}"
        assert convert(tmp_path / name, out) == 0
        index = read_index(str(out / "index.json"))
        assert index.class_names == ("cat", "dog")
        with tarfile.open(out / index.shards[0].url) as tar:
            names = ["000000000.jpg", "000000000.cls", "000000000.__source__", "000000001.jpg"]
            assert tar.getnames()[:4] == names and len(tar.getnames()) == 6
    (tmp_path / "latin1.csv").write_bytes(b"path,label\n0.jpg,caf\xe9\n")
    assert convert(tmp_path / "latin1.csv", tmp_path / "out-latin1") == 3
    assert f"{tmp_path}/latin1.csv:2: not valid UTF-8" in capsys.readouterr().err


def test_text_sources_with_a_byte_order_mark(tmp_path: Path) -> None:
    (tmp_path / "docs.csv").write_bytes(BOM + b"text,id\nhello,1\n")
    (tmp_path / "docs.jsonl").write_bytes(BOM + b'{"text": "hello"}\n')
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(BOM + b"hello")
    for src in ("docs.csv", "docs.jsonl", "corpus"):
        out = tmp_path / f"out-{src}"
        assert convert(tmp_path / src, out, "--tokenizer", "bytes") == 0
        with tarfile.open(out / "shard-000000.tar") as tar:
            member = tar.extractfile(tar.getmembers()[0])
            assert member is not None
            ids = np.frombuffer(member.read(), dtype="<u2")
        assert ids.tolist() == [*b"hello", 256], src


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--label-column", "y"], "--label-column: does nothing for a folder source"),
        (["--path-column", "p"], "--path-column: does nothing for a folder source"),
        (["--column", "a=b"], "--column: does nothing for a folder source"),
        (["--arg", "k=v"], "--arg: does nothing for a folder source"),
        (["--text-field", "content"], "--text-field: only for text sources (with --tokenizer)"),
        (["--sample-tokens", "64"], "--sample-tokens: only for text sources (with --tokenizer)"),
        (["--val-fraction", "0.2", "--prefix", "x"], "--prefix: does nothing with --val-fraction"),
        (["--tokenizer", "bytes", "--label-column", "y"], "--label-column: not for text sources"),
        (["--tokenizer", "bytes", "--text-field", "t"], "--text-field: does nothing for a folder"),
    ],
)
def test_options_that_do_nothing_for_the_source_are_refused(
    image_folder: Path,
    tmp_path: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert convert(image_folder, tmp_path / "out", *args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_text_options_that_do_nothing_for_a_table_or_index_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    common = ["--tokenizer", "bytes"]
    assert convert(tmp_path / "docs.jsonl", tmp_path / "a", *common, "--text-glob", "*.md") == 2
    assert "--text-glob: does nothing for a table" in capsys.readouterr().err
    (tmp_path / "one.txt").write_text("hello")
    assert convert(tmp_path / "one.txt", tmp_path / "b", *common, "--text-glob", "*.md") == 2
    assert "--text-glob: does nothing for a text file" in capsys.readouterr().err
    assert convert(tmp_path / "docs.jsonl", tmp_path / "tokens", *common) == 0
    assert convert(tmp_path / "tokens", tmp_path / "c", "--eod-token", "<|endoftext|>") == 2
    assert "--eod-token: does nothing for a token index" in capsys.readouterr().err
    (tmp_path / "list.csv").write_text("path\n0.jpg\n")
    assert convert(tmp_path / "list.csv", tmp_path / "d", "--column", "a=b") == 2
    assert "--column: does nothing for a manifest source" in capsys.readouterr().err


def test_a_new_source_kind_is_one_lister_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """`list_source` dispatches through `LISTERS`: a kind added there is listed, options passed."""
    from hpctrain.convert import sources
    from hpctrain.convert.errors import ConvertOptionError
    from hpctrain.convert.sources.base import ListOptions, SampleRef, Source

    def list_numbers(src: str, options: ListOptions) -> Source:
        return Source("numbers", (SampleRef(key=options.label_column, url=src, size=0),))

    monkeypatch.setitem(sources.LISTERS, "numbers", list_numbers)
    listed = sources.list_source("7", "numbers", ListOptions(label_column="k"))
    assert listed.samples == (SampleRef(key="k", url="7", size=0),)
    monkeypatch.delitem(sources.LISTERS, "numbers")
    with pytest.raises(ConvertOptionError, match="unknown source kind 'numbers'"):
        sources.list_source("7", "numbers")
