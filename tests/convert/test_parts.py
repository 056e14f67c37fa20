"""A conversion in parts (`--parts N`) gives the one-process conversion's output, kind by kind;
`--resume` runs only the parts that did not finish; the merge refuses while one is missing."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.convert.errors import ConvertError
from hpctrain.convert.options import ConvertOptions
from hpctrain.convert.parts import (
    PARTS_DIR,
    merge_parts,
    missing_parts,
    prepare_parts,
    record_url,
    run_locally,
    run_part,
    stages_of,
)
from hpctrain.convert.run import convert
from hpctrain.convert.sources import text as text_sources
from hpctrain.data.index import read_index
from tests.support.instruction_kit import write_instructions

from .conftest import image_bytes, make_image_folder
from .test_any_sample import read_back

pa = pytest.importorskip("pyarrow")  # in the dev extra: CI has it
import pyarrow.parquet as pq  # noqa: E402

PARTS = 3


def contents(dest: Path) -> dict[str, object]:
    """Every split's samples (key -> field bytes) and its index without the command (which
    names DEST): what must not depend on how the conversion was spread."""
    out: dict[str, object] = {}
    for index_path in sorted(dest.rglob("index.json")):
        split = str(index_path.parent.relative_to(dest)).strip(".")  # "" without a split
        index = json.loads(index_path.read_text())
        index.pop("command")
        out[split] = {"samples": read_back(index_path.parent), "index": index}
    for name in ("skipped.txt",):
        if (dest / name).exists():
            out[name] = (dest / name).read_text()
    return out


def in_parts(options: ConvertOptions, parts: int = PARTS, seed: int = 0) -> None:
    """The stages' parts run here in a shuffled order (the code path of an array task), then
    the merge."""
    assert prepare_parts(options, parts) is None
    order = list(range(parts))
    for stage in stages_of(options):
        random.Random(seed).shuffle(order)
        for k in order:
            run_part(options, parts, k, stage)
    merge_parts(options, parts)


def same_both_ways(tmp_path: Path, src: Path | str, **kw: object) -> dict[str, object]:
    one = ConvertOptions(src=str(src), dest=str(tmp_path / "one"), progress="none", **kw)
    spread = ConvertOptions(src=str(src), dest=str(tmp_path / "parts"), progress="none", **kw)
    convert(one)
    in_parts(spread)
    expected = contents(tmp_path / "one")
    assert contents(tmp_path / "parts") == expected
    assert not (tmp_path / "parts" / PARTS_DIR).exists()  # the parts' work is cleaned up
    assert (tmp_path / "parts" / ".hpctrain-convert.json").exists() is False
    return expected


def test_an_image_folder_in_parts_has_the_same_split_keys_bytes_and_labels(tmp_path):
    folder = make_image_folder(tmp_path / "images", per_class=7)
    out = same_both_ways(
        tmp_path, folder, val_fraction=0.25, shuffle=True, seed=3, samples_per_shard=2
    )
    assert set(out) == {"train", "val"} and out["val"]["samples"]


def test_a_manifest_with_text_labels_and_skipped_rows_in_parts(tmp_path):
    rows = [["path", "label", "caption"]]
    for i in range(17):
        image = tmp_path / f"{i}.jpg"
        if i != 5:  # row 5 names a missing file: skipped and listed, the same both ways
            image.write_bytes(image_bytes(i))
        rows.append([str(image), random.Random(i).choice(["ant", "bee", "cow"]), f"c{i}"])
    manifest = tmp_path / "list.csv"
    with manifest.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = same_both_ways(tmp_path, manifest, val_fraction=0.2, shard_size=2000, on_error="skip")
    assert out["train"]["index"]["class_names"] == ["ant", "bee", "cow"]
    assert "5.jpg" in out["skipped.txt"]


def test_parquet_row_groups_and_arrow_files_in_parts(tmp_path):
    src = tmp_path / "pq"
    src.mkdir()
    for f, n in enumerate([7, 5]):  # 2 files, row groups of 3: 5 units for 3 parts
        rows = range(f * 100, f * 100 + n)
        table = pa.table(
            {
                "img": pa.array([image_bytes(i) for i in rows], pa.binary()),
                "label": pa.array([["x", "y"][i % 2] for i in rows]),
                "score": pa.array([i * 0.5 for i in rows]),
            }
        )
        pq.write_table(table, src / f"part-{f}.parquet", row_group_size=3)
    out = same_both_ways(tmp_path, src, samples_per_shard=3, val_fraction=0.3, shuffle=True)
    keys = sorted(k for split in ("train", "val") for k in out[split]["samples"])
    assert keys == [f"{i:09d}" for i in range(12)]  # positions over the whole source
    assert out["train"]["index"]["class_names"] == ["x", "y"]


def test_an_arrow_folder_with_keys_and_a_bad_row_in_parts(tmp_path):
    from .test_arrow import IMAGE, save_to_disk

    keys = [f"k{i}" for i in range(6)]
    table = pa.table(
        {
            "__key__": pa.array(keys),
            "image": pa.array(
                [{"bytes": None if i == 4 else image_bytes(i), "path": None} for i in range(6)],
                IMAGE,
            ),
            "label": pa.array([i % 2 for i in range(6)], pa.int64()),
        }
    )
    folder = save_to_disk(
        tmp_path / "hf", table, {"label": {"_type": "ClassLabel", "names": ["a", "b"]}}
    )
    out = same_both_ways(tmp_path, folder, samples_per_shard=2, on_error="skip")
    assert sorted(out[""]["samples"]) == ["k0", "k1", "k2", "k3", "k5"]
    assert "row 5" in out["skipped.txt"]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Text files in several tokenize chunks (two files each: the parts share them out)."""
    monkeypatch.setattr(text_sources, "CHUNK_FILES", 2)
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = random.Random(0)
    for i in range(11):
        words = [rng.choice(["alpha", "beta", "gamma", "é"]) for _ in range(rng.randint(5, 300))]
        (folder / f"{i:02d}.txt").write_text(" ".join(words) + "\n")
    return folder


def test_text_to_tokens_in_parts_splits_and_packs_over_the_whole_corpus(tmp_path, corpus):
    out = same_both_ways(
        tmp_path,
        corpus,
        tokenizer="bytes",
        val_fraction=0.2,
        shuffle=True,
        sample_tokens=400,
        samples_per_shard=2,
    )
    assert out["train"]["index"]["num_tokens"] > 0 and out["val"]["samples"]


def test_instruction_data_in_parts_keeps_its_loss_masks(tmp_path, monkeypatch):
    monkeypatch.setattr(text_sources, "CHUNK_BYTES", 300)  # several chunks of records
    source = tmp_path / "sft.jsonl"
    write_instructions(source, 30)
    out = same_both_ways(
        tmp_path,
        source,
        tokenizer="bytes",
        prompt_field="prompt",
        response_field="response",
        sample_tokens=256,
    )
    index = out[""]["index"]
    assert index["num_targets"] > 0
    assert any(field.endswith("loss_mask.bits") for s in out[""]["samples"].values() for field in s)


def test_a_part_missing_is_named_by_the_merge_and_resume_runs_only_it(tmp_path, corpus):
    options = ConvertOptions(
        src=str(corpus), dest=str(tmp_path / "out"), tokenizer="bytes", progress="none"
    )
    assert prepare_parts(options, PARTS) is None
    for k in range(PARTS):
        run_part(options, PARTS, k, "tokenize")
    run_part(options, PARTS, 0, "write")
    run_part(options, PARTS, 2, "write")
    written = sorted(p.name for p in (tmp_path / "out").glob("*.tar"))
    with pytest.raises(ConvertError, match=r"part 1 of 3 has not finished its write stage"):
        merge_parts(options, PARTS)
    assert not (tmp_path / "out" / "index.json").exists()
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == written  # kept
    assert missing_parts(options, PARTS, "write") == [1]
    assert Path(record_url(options, "write", 2)).exists()
    resumed = ConvertOptions(**{**options.__dict__, "resume": True})
    calls = []
    monkeypatched = run_part_spy(calls)
    with monkeypatched:
        result = run_locally(resumed, PARTS)
    assert calls == [["--run-part", "1", "--stage", "write"]]  # only the missing part
    assert result.indexes[""].num_samples > 0
    one = ConvertOptions(**{**options.__dict__, "dest": str(tmp_path / "one")})
    convert(one)
    assert contents(tmp_path / "out") == contents(tmp_path / "one")


class run_part_spy:
    """Run the local processes' commands in this process instead (and record them)."""

    def __init__(self, calls: list[list[str]]) -> None:
        self.calls = calls

    def __enter__(self) -> run_part_spy:
        import hpctrain.convert.parts as parts

        self.saved = parts._run_all

        def run_all(commands: list[list[str]], max_parallel: int) -> list[int]:
            failed = []
            for i, words in enumerate(commands):
                self.calls.append(words[words.index("--run-part") :])
                if main(["convert", *words]) != 0:
                    failed.append(i)
            return failed

        parts._run_all = run_all
        return self

    def __exit__(self, *exc: object) -> None:
        import hpctrain.convert.parts as parts

        parts._run_all = self.saved


def test_a_failing_part_is_named_and_leaves_what_others_wrote(tmp_path, capsys):
    folder = make_image_folder(tmp_path / "images", per_class=4)
    bad = sorted(folder.rglob("*.jpg"))[-1]
    bad.write_bytes(b"not an image")  # in the last part's shards
    dest = tmp_path / "out"
    args = ["convert", str(folder), str(dest), "--samples-per-shard", "2", "--progress", "none"]
    assert main([*args, "--parts", "3", "--max-parallel", "2"]) == 3
    err = capsys.readouterr().err
    assert "part 2 of 3 failed in the write stage" in err and "--resume" in err
    records = sorted(p.name for p in (dest / PARTS_DIR).glob("write-*.json"))
    assert records == ["write-00000.json", "write-00001.json"]
    assert not (dest / "index.json").exists()
    assert main([*args, "--parts", "3", "--resume", "--on-error", "skip"]) == 3  # other options
    assert "different source or options" in capsys.readouterr().err
    bad.write_bytes(image_bytes(99))
    assert main([*args, "--parts", "3", "--resume"]) == 0
    images = [p for p in folder.rglob("*") if p.is_file()]
    assert read_index(str(dest / "index.json")).num_samples == len(images)
    assert not (dest / PARTS_DIR).exists()


def test_parts_options_are_checked_before_anything_is_written(tmp_path, capsys):
    folder = make_image_folder(tmp_path / "images", per_class=2)
    base = ["convert", str(folder), str(tmp_path / "out"), "--progress", "none"]
    assert main([*base, "--parts", "0", "--run-part", "0"]) == 2
    assert "need --parts N" in capsys.readouterr().err
    assert main([*base, "--parts", "2", "--run-part", "0"]) == 3  # not prepared
    assert "not being converted in 2 parts" in capsys.readouterr().err
    assert main([*base, "--parts", "2", "--dry-run"]) == 2
    assert "--dry-run prints job scripts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_shard_changed_after_its_part_is_named_by_the_merge(tmp_path):
    folder = make_image_folder(tmp_path / "images", per_class=2)
    options = ConvertOptions(
        src=str(folder), dest=str(tmp_path / "out"), samples_per_shard=2, progress="none"
    )
    assert prepare_parts(options, 2) is None
    for k in range(2):
        run_part(options, 2, k, "write")
    shard = tmp_path / "out" / "shard-000003.tar"
    shard.write_bytes(shard.read_bytes()[:1024])
    with pytest.raises(ConvertError, match=r"shard-000003.tar: 1024 bytes, but part 1 wrote"):
        merge_parts(options, 2)
    shard.unlink()
    Path(record_url(options, "write", 1)).unlink()  # as the message says
    run_part(options, 2, 1, "write")
    assert merge_parts(options, 2).indexes[""].num_shards == 4  # 7 samples: 3 classes x 2 + a png
