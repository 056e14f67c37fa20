"""User mistakes in data and plan options: one line naming the index or option, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpctrain.cli.main import main
from hpctrain.data.index import ShardIndexError
from hpctrain.data.locate import open_index
from hpctrain.data.mixture import MAX_PASSES_PER_EPOCH, Mixture, MixtureError, Source
from hpctrain.data.mixture_index import source_names as names_of
from hpctrain.errors import EXIT_CONFIG, EXIT_DATA
from tests.support.loader_kit import make_shards


def write_empty_index(root: Path, shards: list[dict[str, object]] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    index = {"format": "hpctrain-shards", "version": 1, "shards": shards or []}
    (root / "index.json").write_text(json.dumps(index))
    return root


def test_an_index_without_samples_is_refused_naming_it_however_it_is_opened(tmp_path):
    empty = write_empty_index(tmp_path / "empty")
    for spec in (str(empty), f"{empty}/", str(empty / "index.json")):
        with pytest.raises(ShardIndexError, match=r"empty/index.json: the index lists no shards"):
            open_index(spec)
    (tmp_path / "nil").mkdir()
    (tmp_path / "nil" / "x.tar").write_bytes(b"\0" * 1024)  # a tar file without members
    zero = write_empty_index(tmp_path / "zero", [{"url": "x.tar", "num_samples": 0}])
    with pytest.raises(ShardIndexError, match=r"zero/index.json: .* 1 shard\(s\) hold no samples"):
        open_index(str(zero))
    with pytest.raises(ShardIndexError, match=r"nil/x.tar: .* hold no samples"):
        open_index(str(tmp_path / "nil" / "x.tar"))


def one_line(err: str, verb: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"hpctrain {verb}")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("key", ["data.train", "data.val"])
def test_train_with_an_empty_index_is_one_data_error_naming_it(key, tmp_path, capsys):
    make_shards(tmp_path / "shards", [4])
    empty = write_empty_index(tmp_path / "empty")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {{name: small_cnn, image_size: 8}}\n"
        f"data: {{train: {tmp_path / 'shards'}, batch_size: 2, workers_per_rank: 0}}\n"
        "train: {max_steps: 1, precision: fp32}\n"
    )
    assert main(["train", str(config), f"{key}={empty}"]) == EXIT_DATA
    line = one_line(capsys.readouterr().err, "train")
    assert f"data error: {empty}/index.json: the index lists no shards" in line


def test_plan_of_an_empty_index_or_mixture_source_names_it(tmp_path, capsys):
    make_shards(tmp_path / "a", [4])
    empty = write_empty_index(tmp_path / "empty")
    size = ["--world-size", "1", "--batch-size", "2"]
    for data in ([str(empty)], [str(tmp_path / "a"), str(empty)]):
        assert main(["plan", *data, *size]) == EXIT_DATA
        line = one_line(capsys.readouterr().err, "plan")
        assert f"{empty}/index.json: the index lists no shards" in line


def test_plan_weights_that_are_not_numbers_are_a_usage_error_naming_the_flag(tmp_path, capsys):
    make_shards(tmp_path / "a", [4])
    make_shards(tmp_path / "b", [4], prefix="b")
    data = [str(tmp_path / "a"), str(tmp_path / "b"), "--world-size", "1", "--batch-size", "2"]
    for weights in ("a,b", "1,nan", "1,-2", "1,"):
        assert main(["plan", *data, "--weights", weights]) == EXIT_CONFIG
        line = one_line(capsys.readouterr().err, "plan")
        assert f"usage error: --weights {weights}: " in line and "not a number > 0" in line


def test_an_epoch_that_repeats_a_small_source_too_often_is_refused_before_planning():
    sources = (Source("big", 1.0, 0, (6, 6)), Source("tiny", 1.0, 2, (8,)))
    Mixture(sources, samples_per_epoch=2 * 8 * MAX_PASSES_PER_EPOCH)  # at the bound: planned
    with pytest.raises(MixtureError, match=r"data.samples_per_epoch=3000000000: data.train\[1\] "):
        Mixture(sources, samples_per_epoch=3_000_000_000)  # was ~1e8 passes: MemoryError
    many = (Source("wide", 1.0, 0, (1,) * 200_000), Source("tiny", 1.0, 200_000, (1000,)))
    with pytest.raises(
        MixtureError, match=r"\(wide, 200000 samples, weight 1\) would be read 100 "
    ):
        Mixture(many, samples_per_epoch=40_000_000)  # 100 passes of 200k shards: 2e7 segments


def test_sources_with_the_same_folder_name_are_named_after_the_folder_above(tmp_path, capsys):
    """`convert --val-fraction` makes `web/train` and `books/train`: both `train` by default."""
    for name in ("web", "books", "x/code", "y/code"):
        make_shards(tmp_path / name / "train", [4])
    size = ["--world-size", "1", "--batch-size", "2"]
    data = [str(tmp_path / "web" / "train"), f"{tmp_path}/books/train/index.json"]
    assert main(["plan", *data, "--weights", "5,3", *size]) == 0
    out = capsys.readouterr().out
    assert "  web: weight 0.625" in out and "  books: weight 0.375" in out
    assert names_of(
        [SimpleNamespace(path="s3://train", name=""), SimpleNamespace(path="train", name="")]
    ) == ["train", "train"]
    clash = [str(tmp_path / "x" / "code" / "train"), str(tmp_path / "y" / "code" / "train")]
    assert main(["plan", *clash, *size]) == EXIT_DATA
    line = one_line(capsys.readouterr().err, "plan")
    assert "name 'code' is also the name of data.train[0]" in line and "--names" in line
    assert main(["plan", *clash, *size, "--names", "x,y"]) == 0


def test_plan_eval_pads_as_evaluation_does(tmp_path, capsys):
    make_shards(tmp_path, [4, 4, 4])  # 12 samples on 5 ranks of batch 1
    size = [str(tmp_path), "--world-size", "5", "--batch-size", "1"]
    assert main(["plan", *size, "--eval"]) == 0
    assert "remainder pad: 0 samples dropped, 3 padded" in capsys.readouterr().out
    assert main(["plan", *size]) == 0  # training keeps data.remainder's default
    assert "remainder drop: 2 samples dropped, 0 padded" in capsys.readouterr().out
    assert main(["plan", *size, "--eval", "--remainder", "drop"]) == EXIT_CONFIG
    assert "--eval --remainder drop: evaluation always pads" in one_line(
        capsys.readouterr().err, "plan"
    )
