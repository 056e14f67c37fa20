"""A full disk during `convert`, `predict` and `export --format hf` (issue #37 item 18): one
line naming the path and "No space left on device", as checkpoint saves say it, no partial
file left behind to keep the disk full, nothing of the user's removed. A really full file
system: a small tmpfs (root only; skipped elsewhere, see `tiny_tmpfs`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli.main import main
from tests.faults.test_checkpoint_faults import tiny_tmpfs

pytestmark = pytest.mark.slow  # a run trained first, tmpfs mounts: seconds


def leftovers(root: Path) -> list[str]:
    """Temporary files or folders of an interrupted write under `root`."""
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name]


def fill(disk: Path) -> Path:
    """A file of the user's that takes every free byte of `disk`."""
    filler = disk / "users-own-file"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of a tiny GPT on byte-token shards (on the ordinary disk)."""
    from hpctrain.config import load_config
    from tests.support.lm_kit import write_token_shards
    from tests.support.lm_worker import overrides
    from tests.train.test_trainer import build

    root = tmp_path_factory.mktemp("lm")
    write_token_shards(root / "shards" / "train", 1, seed=1)
    write_token_shards(root / "shards" / "val", 1, seed=2)
    cfg = load_config(None, overrides(root / "shards", root / "run", "train.max_steps=1"))
    assert build(cfg).fit() == 0
    return root / "run"


def test_convert_onto_a_full_disk_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc-{i}.txt").write_text(f"the cat sat on the mat {i} " * 2000)  # 400 kB
    images = tmp_path / "images"
    rng = np.random.default_rng(0)
    from PIL import Image

    for label in ("a", "b"):
        (images / label).mkdir(parents=True)
        for i in range(40):  # noise does not compress: 40 x 2 x ~12 kB
            pixels = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / label / f"{i}.png")
    with tiny_tmpfs("256k") as disk:
        for source, extra in ((corpus, ["--tokenizer", "bytes"]), (images, [])):
            dest = disk / "out"
            dest.mkdir()
            (dest / "notes.txt").write_text("mine")
            capsys.readouterr()
            code = main(["convert", str(source), str(dest), "--progress", "none", *extra])
            err = capsys.readouterr().err.strip()
            assert code == 3 and err.count("\n") == 0, err
            assert f"{dest}/shard-000000.tar: cannot write the shard: " in err, err
            assert err.endswith("No space left on device"), err
            assert not leftovers(disk) and (dest / "notes.txt").read_text() == "mine"
            for name in os.listdir(dest):  # the state file stays for --resume
                if name not in ("notes.txt", ".hpctrain-convert.json"):
                    (dest / name).unlink()
            os.unlink(dest / "notes.txt")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest / ".hpctrain-convert.json")
            dest.rmdir()


def test_export_hf_onto_a_full_disk_is_one_line(
    lm_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tiny_tmpfs("64k") as disk:  # the weights take ~140 kB
        capsys.readouterr()
        assert main(["export", str(lm_run), str(disk / "hf"), "--format", "hf"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{disk}/hf/model.safetensors: cannot write the export: No space left" in err
        assert err.count("\n") == 0 and os.listdir(disk) == []  # the partial folder is gone


def test_predict_onto_a_full_disk_is_one_line(
    lm_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    val = lm_run.parent / "shards" / "val"
    with tiny_tmpfs("64k") as disk:
        (disk / "preds").mkdir()
        filler = fill(disk)
        size = filler.stat().st_size
        capsys.readouterr()
        code = main(["predict", str(lm_run), "--data", str(val), "--out", str(disk / "preds")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "Traceback" not in err, err
        err = err.splitlines()[-1]  # after the start-up log lines
        assert err.startswith("hpctrain predict: usage error: "), err
        assert f"{disk}/preds/part-00000-of-00001.jsonl: cannot write the predictions:" in err
        assert err.endswith("No space left on device"), err
        assert os.listdir(disk / "preds") == [] and filler.stat().st_size == size
