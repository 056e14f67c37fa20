"""Text -> token shards (`hpctrain convert --tokenizer`), tokenizers and the tokenizer check."""

from __future__ import annotations

import csv
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hpctrain.config import ConfigError, DataConfig
from hpctrain.convert import text as text_module
from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.options import ConvertOptions
from hpctrain.convert.run import convert
from hpctrain.convert.sources import text as text_sources
from hpctrain.convert.verify import format_report, inspect_dataset
from hpctrain.data.index import read_index
from hpctrain.data.tokenizer import TokenizerError, check_tokenizer, load_tokenizer
from hpctrain.data.tokens import decode_tokens

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Zürich — ünïcödé text ✓",
    "def f(x):\n    return x + 1\n",
    "short",
    "a longer document " * 12,
    "",
    "line one\nline two\n\nline four",
]


def stream_of(index_path: Path) -> tuple[list[np.ndarray], list[int]]:
    """(every sample's ids in shard order, each shard's id count) of an index."""
    index = read_index(str(index_path))
    samples, counts = [], []
    for i in range(len(index.shards)):
        count = 0
        with tarfile.open(index.shard_url(i)) as tar:
            for member in tar:
                f = tar.extractfile(member)
                assert f is not None
                ids = decode_tokens(f.read(), member.name.split(".", 1)[1])
                samples.append(ids.astype(np.int64))
                count += ids.size
        counts.append(count)
    return samples, counts


def documents_of(samples: list[np.ndarray], eod: int) -> list[np.ndarray]:
    """Split the concatenated stream at the EOD ids (each sample must end with one)."""
    docs = []
    for ids in samples:
        assert ids[-1] == eod  # whole documents only
        ends = np.flatnonzero(ids == eod)
        docs += np.split(ids, ends + 1)[:-1]
    return [d[:-1] for d in docs]


def decoded(index_path: Path) -> list[str]:
    samples, _ = stream_of(index_path)
    return [bytes(d.astype(np.uint8)).decode() for d in documents_of(samples, 256)]


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DOCS as a folder of .txt files (plus a .py file and a hidden file, both left out)."""
    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(DOCS):
        folder = root / ("sub" if i % 2 else "")
        folder.mkdir(exist_ok=True)
        (folder / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    (root / "code.py").write_text("print('hi')\n")
    (root / ".hidden.txt").write_text("not a document")
    return root


def sorted_docs(corpus: Path) -> list[str]:
    """DOCS in the order convert reads them: sorted paths."""
    paths = sorted(corpus.rglob("doc*.txt"), key=lambda p: str(p.relative_to(corpus)))
    return [p.read_text(encoding="utf-8") for p in paths]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE with a tiny vocabulary, trained here on the test's own text."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 4, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_bytes_tokenizer_round_trip() -> None:
    tok = load_tokenizer("bytes")
    for doc in DOCS:
        ids = tok.encode(doc)
        assert ids == list(doc.encode("utf-8"))
        assert tok.decode([*ids, tok.eod_id]) == doc  # the EOD is left out
    assert tok.info() == {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""}
    with pytest.raises(ValueError, match="257"):
        tok.decode([257])


def test_hf_tokenizer_round_trip_and_eod(hf_tokenizer: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer))
    assert tok.eod_id == 1  # <|endoftext|>, found by the candidate rule
    assert tok.vocab_size <= 300 and len(tok.sha256) == 64
    for doc in DOCS:
        ids = tok.encode(doc)
        assert all(0 <= i < tok.vocab_size for i in ids) and tok.eod_id not in ids
        assert tok.decode([*ids, tok.eod_id]) == doc
    assert len(tok.encode(DOCS[0])) < len(DOCS[0].encode())  # it did learn merges
    assert load_tokenizer(str(hf_tokenizer), eod_token="<pad>").eod_id == 0
    with pytest.raises(TokenizerError, match="<nope>"):
        load_tokenizer(str(hf_tokenizer), eod_token="<nope>")


def test_hf_tokenizer_without_eod_token(hf_tokenizer: Path, tmp_path: Path) -> None:
    data = json.loads(hf_tokenizer.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|endoftext|>"]
    data["model"]["vocab"].pop("<|endoftext|>")
    path = tmp_path / "noeod.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="--eod-token"):
        load_tokenizer(str(path))


def test_missing_tokenizer_file_or_hub_name(tmp_path: Path) -> None:
    for spec in ("gpt2", "meta-llama/Llama-3-8B", str(tmp_path / "missing.json")):
        with pytest.raises(TokenizerError, match="no such file") as info:
            load_tokenizer(spec)
        assert spec in str(info.value) and "offline" in str(info.value)
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer("")


def test_folder_counts_layout_and_round_trip(corpus: Path, tmp_path: Path) -> None:
    result = convert(
        ConvertOptions(
            str(corpus),
            str(tmp_path / "out"),
            tokenizer="bytes",
            sample_tokens=64,
            samples_per_shard=2,
            progress="none",
        )
    )
    index = result.indexes[""]
    docs = sorted_docs(corpus)
    assert index.tokenizer == {"name": "bytes", "vocab_size": 257, "eod_id": 256, "sha256": ""}
    assert index.num_tokens == sum(len(d.encode()) + 1 for d in docs)
    samples, counts = stream_of(tmp_path / "out" / "index.json")
    assert counts == [s.num_tokens for s in index.shards] and len(counts) > 1
    assert decoded(tmp_path / "out" / "index.json") == docs  # all shards, in order
    long_docs = {len(d.encode()) + 1 for d in docs if len(d.encode()) + 1 > 64}
    for ids in samples:  # packing: at most 64 ids, or one document longer than that
        assert ids.size <= 64 or (ids.size in long_docs and (ids == 256).sum() == 1)
    assert sum(s.size for s in samples) < 64 * len(docs)  # short documents share samples
    extra = index.extra
    assert extra["source_kind"] == "text" and extra["sample_tokens"] == 64
    assert "--tokenizer bytes" in index.command and "--sample-tokens 64" in index.command

    reports = inspect_dataset(str(tmp_path / "out"))  # token checks need no --verify (torch)
    assert not reports[0].errors and reports[0].num_tokens == index.num_tokens
    assert "tokens: " in format_report(reports[0]) and "bytes" in format_report(reports[0])


def test_inspect_flags_ids_against_the_tokenizer(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(ConvertOptions(str(corpus), str(out), tokenizer="bytes", progress="none"))
    (out / "index.compact").unlink()  # edited below: its compact form would not match (reported)
    data = json.loads((out / "index.json").read_text())
    data["tokenizer"]["eod_id"] = 10  # newline: the samples do not end with it
    (out / "index.json").write_text(json.dumps(data))
    errors = inspect_dataset(str(out))[0].errors
    assert errors and "end-of-document id 10" in errors[0]
    data["tokenizer"].update(vocab_size=200, eod_id=0)  # UTF-8 lead bytes are above 200
    (out / "index.json").write_text(json.dumps(data))
    errors = inspect_dataset(str(out))[0].errors
    assert any(">= the tokenizer's vocab_size 200" in e for e in errors)
    data["tokenizer"].update(vocab_size=257, eod_id=256)
    data["shards"][0]["num_tokens"] += 1
    data["num_tokens"] += 1
    (out / "index.json").write_text(json.dumps(data))
    errors = inspect_dataset(str(out))[0].errors
    assert len(errors) == 1 and "token ids, index says" in errors[0]


def test_workers_byte_identical_with_val_split(
    corpus: Path, hf_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_sources, "CHUNK_FILES", 2)  # several tokenize tasks (forked: seen)
    outputs = []
    dest = tmp_path / "out"  # one DEST: the index's command names it
    for workers in (1, 2):
        result = convert(
            ConvertOptions(
                str(corpus),
                str(dest),
                tokenizer=str(hf_tokenizer),
                sample_tokens=8,
                val_fraction=0.3,
                shuffle=True,
                seed=3,
                workers=workers,
                overwrite=True,
                progress="none",
            )
        )
        outputs.append(files(dest))
    assert outputs[0] == outputs[1]
    train, val = result.indexes["train"], result.indexes["val"]
    tok = load_tokenizer(str(hf_tokenizer))
    assert train.tokenizer == val.tokenizer == tok.info()
    # by documents: round(0.3 * 7) = 2 whole documents in val
    val_samples, _ = stream_of(dest / "val" / "index.json")
    val_docs = documents_of(val_samples, tok.eod_id)
    assert len(val_docs) == 2 and all(tok.decode(d) in DOCS for d in val_docs)
    assert train.num_tokens + val.num_tokens == sum(len(tok.encode(d)) + 1 for d in DOCS)


def write_tables(root: Path, docs: list[str]) -> dict[str, Path]:
    root.mkdir()
    jsonl = root / "docs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs))
    )
    csv_path = root / "docs.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "content"])
        writer.writerows(enumerate(docs))
    paths = {"jsonl": jsonl, "csv": csv_path}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return paths
    paths["parquet"] = root / "docs.parquet"
    pq.write_table(pa.table({"content": docs, "id": list(range(len(docs)))}), paths["parquet"])
    return paths


def test_tables_with_text_field(tmp_path: Path) -> None:
    tables = write_tables(tmp_path / "tables", DOCS)
    assert len(tables) == 3  # pyarrow is installed here
    for kind, path in tables.items():
        dest = tmp_path / kind
        convert(
            ConvertOptions(
                str(path), str(dest), tokenizer="bytes", text_field="content", progress="none"
            )
        )
        assert decoded(dest / "index.json") == DOCS, kind
        with pytest.raises(ConvertError, match="'body'"):
            convert(
                ConvertOptions(
                    str(path),
                    str(tmp_path / "x"),
                    tokenizer="bytes",
                    text_field="body",
                    progress="none",
                )
            )


def test_bad_utf8_fail_or_skip(tmp_path: Path) -> None:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "also fine"}\n')
    csv_path = tmp_path / "bad.csv"
    csv_path.write_bytes(b"text\nfine\ncaf\xe9\nalso fine\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"fine")
    (folder / "b.txt").write_bytes(b"line one\ncaf\xe9\n")
    (folder / "c.txt").write_bytes(b"also fine")
    for src, where in ((jsonl, "bad.jsonl:2"), (csv_path, "bad.csv:3"), (folder, "b.txt:2")):
        dest = tmp_path / f"out-{src.name}"
        with pytest.raises(ConvertError, match=f"{where}: not valid UTF-8.*--on-error skip"):
            convert(ConvertOptions(str(src), str(dest), tokenizer="bytes", progress="none"))
        assert not (dest / "index.json").exists()
        result = convert(
            ConvertOptions(
                str(src),
                str(dest),
                tokenizer="bytes",
                on_error="skip",
                overwrite=True,
                progress="none",
            )
        )
        assert decoded(dest / "index.json") == ["fine", "also fine"]
        assert len(result.skipped) == 1 and where in (dest / "skipped.txt").read_text()
        assert result.indexes[""].extra["num_skipped_documents"] == 1


def test_text_per_line_and_glob(corpus: Path, tmp_path: Path) -> None:
    convert(
        ConvertOptions(
            str(corpus / "doc06.txt"),
            str(tmp_path / "lines"),
            tokenizer="bytes",
            text_per_line=True,
            progress="none",
        )
    )
    assert decoded(tmp_path / "lines" / "index.json") == ["line one", "line two", "line four"]
    convert(
        ConvertOptions(
            str(corpus),
            str(tmp_path / "py"),
            tokenizer="bytes",
            text_glob="*.py",
            progress="none",
        )
    )
    assert decoded(tmp_path / "py" / "index.json") == ["print('hi')\n"]
    with pytest.raises(ConvertError, match=r"\*\.md"):
        convert(
            ConvertOptions(
                str(corpus),
                str(tmp_path / "md"),
                tokenizer="bytes",
                text_glob="*.md",
                progress="none",
            )
        )
    with pytest.raises(ConvertOptionError, match="--text-per-line"):
        tables = write_tables(tmp_path / "t", ["x"])
        convert(
            ConvertOptions(
                str(tables["jsonl"]),
                str(tmp_path / "j"),
                tokenizer="bytes",
                text_per_line=True,
                progress="none",
            )
        )


def test_reshard_keeps_ids_and_refuses_another_tokenizer(
    corpus: Path, hf_tokenizer: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    convert(ConvertOptions(str(corpus), str(first), tokenizer=str(hf_tokenizer), progress="none"))
    before, _ = stream_of(first / "index.json")
    again = tmp_path / "again"
    # no --tokenizer needed: a token index is resharded with its own
    result = convert(
        ConvertOptions(
            str(first / "index.json"),
            str(again),
            sample_tokens=4,
            samples_per_shard=1,
            progress="none",
        )
    )
    after, _ = stream_of(again / "index.json")
    assert len(after) > len(before)  # re-packed...
    assert np.array_equal(np.concatenate(after), np.concatenate(before))  # ...ids kept
    assert result.indexes[""].tokenizer == read_index(str(first / "index.json")).tokenizer
    assert result.indexes[""].extra["source_kind"] == "tokens"
    with pytest.raises(
        ConfigError, match="--tokenizer = 'bytes'.*differs.*tokenizer.json' \\(sha256"
    ):
        convert(ConvertOptions(str(first), str(tmp_path / "x"), tokenizer="bytes"))


def test_check_tokenizer(corpus: Path, hf_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(ConvertOptions(str(corpus), str(out), tokenizer="bytes", progress="none"))
    index = read_index(str(out / "index.json"))
    where = str(out / "index.json")
    assert check_tokenizer(index, "", where)["eod_id"] == 256  # "": take the index's
    assert check_tokenizer(index, "bytes", where)["name"] == "bytes"
    sha = load_tokenizer(str(hf_tokenizer)).sha256
    with pytest.raises(ConfigError) as info:
        check_tokenizer(index, str(hf_tokenizer), where)
    message = str(info.value)
    assert str(hf_tokenizer) in message and sha[:12] in message
    assert "'bytes'" in message and where in message
    other = tmp_path / "other.json"
    other.write_text(hf_tokenizer.read_text() + "\n")  # same tokenizer, another file: sha256
    file_index = read_index(str(out / "index.json"))
    object.__setattr__(file_index, "tokenizer", load_tokenizer(str(hf_tokenizer)).info())
    assert check_tokenizer(file_index, str(hf_tokenizer), where)["eod_id"] == 1
    with pytest.raises(ConfigError, match="differs"):
        check_tokenizer(file_index, str(other), where)
    with pytest.raises(ConfigError, match="differs"):
        check_tokenizer(file_index, "bytes", where)
    with pytest.raises(ConfigError, match="no such file"):
        check_tokenizer(file_index, str(tmp_path / "gone.json"), where)
    object.__setattr__(file_index, "tokenizer", None)
    with pytest.raises(ConfigError, match="not a token index"):
        check_tokenizer(file_index, "", where)
    assert DataConfig().tokenizer == ""


def test_cli_convert_and_inspect(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.cli.main import main

    dest = tmp_path / "cli"
    args = [str(corpus), str(dest), "--tokenizer", "bytes", "--text-glob", "*.py"]
    assert main(["convert", *args, "--sample-tokens", "100", "--progress", "none"]) == 0
    assert decoded(dest / "index.json") == ["print('hi')\n"]
    assert main(["inspect", str(dest)]) == 0
    assert "tokens: 13 (bytes, vocab_size 257, eod_id 256)" in capsys.readouterr().out
    # a hub name is an error naming it (a usage error, before anything is written)
    assert main(["convert", str(corpus), str(tmp_path / "hub"), "--tokenizer", "gpt2"]) != 0
    assert "'gpt2': no such file" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists()


def test_resume_after_an_interrupted_text_conversion(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = ConvertOptions(
        str(corpus), str(tmp_path / "out"), tokenizer="bytes", sample_tokens=16,
        samples_per_shard=1, progress="none",
    )  # fmt: skip
    reference = tmp_path / "reference"
    convert(ConvertOptions(**{**options.__dict__, "dest": str(reference)}))
    write = text_module._write
    calls = []

    def write_then_die(*args: object) -> object:
        if len(calls) == 3:
            raise KeyboardInterrupt  # a killed job: three shards committed, no index
        calls.append(1)
        return write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(text_module, "_write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        convert(options)
    assert not (tmp_path / "out" / "index.json").exists()
    monkeypatch.setattr(text_module, "_write", write)
    result = convert(ConvertOptions(**{**options.__dict__, "resume": True}))
    assert result.num_resumed_shards == 3
    ours, theirs = files(tmp_path / "out"), files(reference)
    assert ours.pop("index.json") != theirs.pop("index.json")  # the command names DEST
    assert ours.pop("index.compact") != theirs.pop("index.compact")  # as its JSON
    assert ours == theirs


@pytest.mark.parametrize("value", ["-1", "0"])
def test_samples_per_shard_below_one_is_refused_like_images(
    corpus: Path, image_folder: Path, tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.cli.main import main

    common = ["--samples-per-shard", value, "--progress", "none"]
    assert main(["convert", str(corpus), str(tmp_path / "t"), "--tokenizer", "bytes", *common]) == 2
    text_error = capsys.readouterr().err
    assert main(["convert", str(image_folder), str(tmp_path / "i"), *common]) == 2
    assert text_error == capsys.readouterr().err
    assert "usage error: --samples-per-shard must be >= 1" in text_error
    assert not (tmp_path / "t").exists()


def word_tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    """A word-level tokenizer.json with exactly `vocab` (ids as given) and `<|endoftext|>`."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_ids_that_are_not_contiguous_fit_the_vocab_size(tmp_path: Path) -> None:
    # 6 tokens, one of them id 50: the vocabulary must hold 51 ids, not 6.
    spec = word_tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "d": 50})
    assert load_tokenizer(str(spec)).vocab_size == 51
    (tmp_path / "docs.jsonl").write_text('{"text": "a d b"}\n')
    out = tmp_path / "out"
    convert(ConvertOptions(str(tmp_path / "docs.jsonl"), str(out), tokenizer=str(spec)))
    index = read_index(str(out / "index.json"))
    assert index.tokenizer is not None and index.tokenizer["vocab_size"] == 51
    samples, _ = stream_of(out / "index.json")
    assert samples[0].tolist() == [1, 50, 2, index.tokenizer["eod_id"]]
    assert not inspect_dataset(str(out))[0].errors


def test_special_token_text_inside_a_document_is_ordinary_text(
    hf_tokenizer: Path, tmp_path: Path
) -> None:
    # Web text holds the string "<|endoftext|>": it must not end the document there.
    tok = load_tokenizer(str(hf_tokenizer))
    text = "before <|endoftext|> after"
    ids = tok.encode(text)
    assert tok.eod_id not in ids and tok.decode(ids) == text
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "out"
    convert(ConvertOptions(str(tmp_path / "docs.jsonl"), str(out), tokenizer=str(hf_tokenizer)))
    samples, _ = stream_of(out / "index.json")
    docs = documents_of(samples, tok.eod_id)
    assert len(docs) == 1 and tok.decode(docs[0]) == text


def test_eod_token_must_be_a_special_token(hf_tokenizer: Path, tmp_path: Path) -> None:
    vocab = json.loads(hf_tokenizer.read_text())["model"]["vocab"]
    word = next(t for t in vocab if len(t) > 2 and t.isalpha())  # an ordinary word of it
    with pytest.raises(TokenizerError, match=f"--eod-token '{word}' is an ordinary token"):
        load_tokenizer(str(hf_tokenizer), word)
    with pytest.raises(TokenizerError, match="--eod-token 'nothing-like-it' is not in its"):
        load_tokenizer(str(hf_tokenizer), "nothing-like-it")
    assert load_tokenizer(str(hf_tokenizer), "<pad>").eod_id == 0  # a special token: fine
    # A candidate that is only an ordinary word is no end-of-document token either.
    spec = word_tokenizer(tmp_path / "w.json", {"[UNK]": 0, "</s>": 1, "a": 2})
    data = json.loads(spec.read_text())
    data["added_tokens"] = []  # "</s>" only in the ordinary vocabulary
    spec.write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="is a special token of it; name one with"):
        load_tokenizer(str(spec))


def test_progress_counts_documents_and_tokens(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.cli.main import main

    out = tmp_path / "out"
    assert (
        main(["convert", str(corpus), str(out), "--tokenizer", "bytes", "--progress", "plain"]) == 0
    )
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenize:")]
    tokens = sum(len(doc.encode()) + 1 for doc in DOCS)  # each document and its EOD
    assert lines[-1].startswith(f"tokenize: {len(DOCS)}/{len(DOCS)} documents (100%), ")
    assert f" docs/s, {tokens} tokens (" in lines[-1] and "img/s" not in lines[-1]
    (tmp_path / "docs.jsonl").write_text('{"text": "ab"}\n{"text": "c"}\n')
    args = ["--tokenizer", "bytes", "--progress", "plain"]
    assert main(["convert", str(tmp_path / "docs.jsonl"), str(tmp_path / "t"), *args]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenize:")]
    assert lines[-1].startswith("tokenize: 2 documents, ")  # a table: no total known ahead
    assert "5 tokens (" in lines[-1] and "ETA" not in lines[-1]


def test_the_summary_says_documents_packed_into_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """270 records packed into one sample read "1 samples" (#49): say both counts."""
    from hpctrain.cli.main import main

    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"text": f"q{i}"}) + "\n" for i in range(270)))
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--tokenizer", "bytes", "--progress", "none"]) == 0
    tokens = read_index(str(out / "index.json")).num_tokens
    assert capsys.readouterr().out == (
        f"shards: 270 documents ({tokens:,} tokens) packed into 1 sample of up to 8,192 tokens "
        f"in 1 shards, 0.0 MB -> {out / 'index.json'}\n"
    )
