"""Verbs that use a trained checkpoint (predict, eval, export, generate) on one tiny CPU run:
what they refuse to overwrite, the class names that travel with the model, and one-line errors.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpctrain.cli.main import main
from hpctrain.errors import EXIT_CONFIG
from tests.support.train_kit import REPO, run_hpctrain

CLASSES = ("circle", "square", "star")


def image_shards(root: Path, classes: tuple[str, ...], *, val_fraction: float = 0.0) -> Path:
    """root/images/<class>/<n>.jpg (6 random 16 px images a class) converted to root/shards."""
    rng = np.random.default_rng(len(root.name))
    for name in classes:
        (root / "images" / name).mkdir(parents=True)
        for i in range(6):
            pixels = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG")
            (root / "images" / name / f"{i}.jpg").write_bytes(buffer.getvalue())
    args = ["convert", str(root / "images"), str(root / "shards")]
    assert main([*args, "--val-fraction", str(val_fraction)] if val_fraction else args) == 0
    return root / "shards"


def tiny_run(run_dir: Path, shards: Path, *overrides: str) -> Path:
    """Two steps of small_cnn on `shards` (DIR/train, DIR/val), a checkpoint at each."""
    run_hpctrain(
        "train", str(REPO / "configs" / "demo.yaml"), f"run_dir={run_dir}",
        f"data.train={shards / 'train'}", f"data.val={shards / 'val'}", "data.batch_size=4",
        "data.workers_per_rank=0", "model.image_size=16", "train.max_epochs=0",
        "train.max_steps=2", "train.warmup_steps=0", "train.eval_every=1",
        "checkpoint.every_steps=1", *overrides,
    )  # fmt: skip
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("use")
    shards = image_shards(root / "data", CLASSES, val_fraction=0.5)
    return tiny_run(root / "run", shards)


def test_predict_refuses_an_out_that_is_or_holds_data(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#31 item 5: `--out` onto the dataset deleted its index.json."""
    val = run.parent / "data" / "shards" / "val"
    before = {p.name: p.read_bytes() for p in val.iterdir()}
    for out in (val, val / "preds", val.parent):
        for fmt in ("jsonl", "shards"):
            code = main(["predict", str(run), "--data", str(val), "--out", str(out),
                         "--format", fmt])  # fmt: skip
            assert code == EXIT_CONFIG, out
            assert "lies inside --data" in capsys.readouterr().err
    other = tmp_path / "other"  # another dataset's folder, not the one read
    other.mkdir()
    (other / "index.json").write_text('{"shards": []}')
    assert main(["predict", str(run), "--data", str(val), "--out", str(other)]) == EXIT_CONFIG
    assert "holds a data index (index.json) that no prediction wrote" in capsys.readouterr().err
    assert (other / "index.json").read_text() == '{"shards": []}'
    assert {p.name: p.read_bytes() for p in val.iterdir()} == before
    assert not (val / "preds").exists()


def test_predict_replaces_only_its_own_previous_prediction(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "preds"
    val = run.parent / "data" / "shards" / "val"
    assert main(["predict", str(run), "--data", str(val), "--out", str(out), "--format",
                 "shards"]) == 0  # fmt: skip
    (out / "part-notes.txt").write_text("mine")  # the user's, though named part-*
    assert main(["predict", str(run), "--data", str(val), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "part-00000-of-00001.jsonl", "part-notes.txt"]


def test_eval_out_a_folder_is_one_line(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#31 item 24: an IsADirectoryError traceback after the whole evaluation."""
    assert main(["eval", str(run), "--out", str(tmp_path)]) == EXIT_CONFIG
    assert f"--out {tmp_path}: is a folder" in capsys.readouterr().err


def test_evals_of_two_folders_of_one_name_keep_two_records(run: Path, tmp_path: Path) -> None:
    """#31 item 31: both wrote eval/step-2.val.json, the second over the first."""
    val = run.parent / "data" / "shards" / "val"
    shutil.copytree(val, tmp_path / "other" / "val")
    records = set()
    for data in (val, tmp_path / "other" / "val", tmp_path / "other" / "val" / "index.json"):
        assert main(["eval", str(run), f"data.val={data}"]) == 0
        records |= {p.name for p in (run / "eval").glob("step-2.val-*.json")}
    assert len(records) == 2  # the folder and its index.json are one dataset
    for name in records:
        record = json.loads((run / "eval" / name).read_text())
        assert record["record"].endswith(name) and record["val_samples"] == 9


@pytest.fixture(scope="module")
def other_classes(run: Path) -> Path:
    """A dataset naming 2 classes, `circle` and `star`, where the run's model has 3."""
    return image_shards(run.parent / "other", ("circle", "star"))


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_train_refuses_validation_data_of_other_classes(
    run: Path, other_classes: Path, tmp_path: Path
) -> None:
    """#31 item 6: val label 1 (star) was scored as the model's class 1 (square)."""
    shards = run.parent / "data" / "shards"
    proc = run_hpctrain(
        "train", str(REPO / "configs" / "demo.yaml"), f"run_dir={tmp_path / 'r'}",
        f"data.train={shards / 'train'}", f"data.val={other_classes}", "train.max_steps=1",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert (
        "data error: data.val names the classes ['circle', 'star'], data.train "
        "['circle', 'square', 'star']"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "checkpoints").exists()


def test_eval_refuses_and_predict_warns_on_data_of_other_classes(
    run: Path, other_classes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(run), f"data.val={other_classes}"]) == 3
    err = capsys.readouterr().err
    assert (
        "data.val names the classes ['circle', 'star'], the model ['circle', 'square', 'star']"
        in err
    )
    out = tmp_path / "preds"
    assert main(["predict", str(run), "--data", str(other_classes), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert (
        "--data names the classes ['circle', 'star'], the model ['circle', 'square', 'star']" in err
    )
    first = json.loads((out / "part-00000-of-00001.jsonl").read_text().splitlines()[0])
    assert first["class"] in CLASSES


def test_class_names_travel_with_the_checkpoint_and_the_export(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#31 item 7: the names were read from the current data.train, so re-converting it with
    renamed classes changed what an old checkpoint's predictions said."""
    manifest = json.loads((run / "checkpoints" / "step-2" / "manifest.json").read_text())
    assert manifest["metadata"]["class_names"] == list(CLASSES)
    renamed = tmp_path / "train"
    shutil.copytree(run.parent / "data" / "shards" / "train", renamed)
    index = json.loads((renamed / "index.json").read_text())
    index["class_names"] = ["a", "b", "c"]
    (renamed / "index.json").write_text(json.dumps(index))
    val = run.parent / "data" / "shards" / "val"
    out = tmp_path / "preds"
    args = ["--data", str(val), "--out", str(out), f"data.train={renamed}"]
    assert main(["predict", str(run), *args]) == 0
    err = capsys.readouterr().err
    assert "data.train names the classes ['a', 'b', 'c'], the checkpoint" in err
    lines = (out / "part-00000-of-00001.jsonl").read_text().splitlines()
    assert {json.loads(line)["class"] for line in lines} <= set(CLASSES)
    assert main(["eval", str(run), f"data.train={renamed}"]) == 0  # val agrees with the model
    assert main(["export", str(run), str(tmp_path / "m.pt")]) == 0
    card = json.loads((tmp_path / "m.pt.json").read_text())
    assert card["class_names"] == list(CLASSES)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of a tiny GPT on byte-token shards, a checkpoint at the end."""
    from hpctrain.config import load_config
    from tests.support.lm_kit import write_token_shards
    from tests.support.lm_worker import overrides
    from tests.train.test_trainer import build

    root = tmp_path_factory.mktemp("lm")
    write_token_shards(root / "shards" / "train", 1, seed=1)
    write_token_shards(root / "shards" / "val", 1, seed=2)
    cfg = load_config(None, overrides(root / "shards", root / "run", "train.max_steps=2"))
    assert build(cfg).fit() == 0
    return root / "run"


def test_predict_of_a_causal_lm_writes_one_line_a_sequence(lm_run: Path, tmp_path: Path) -> None:
    """#31 item 17: the task's predict returned `key`/`valid`, which the writer refused."""
    val = lm_run.parent / "shards" / "val"
    assert main(["predict", str(lm_run), "--data", str(val), "--out", str(tmp_path / "p")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "p" / "part-00000-of-00001.jsonl").open()]
    assert len(lines) == len({line["key"] for line in lines}) == 16  # every sequence once
    assert set(lines[0]) == {"key", "loss", "accuracy", "targets", "next_token", "next_text"}
    assert 0 < lines[0]["loss"] < 10 and 0 <= lines[0]["next_token"] < 257


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_generate_bad_options_are_one_line(
    lm_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """#31 item 22: tracebacks for a missing GPU, a NaN temperature, a non-UTF-8 prompt."""
    import torch

    generate = ["generate", str(lm_run), "--prompt", "the ", "--max-new-tokens", "2"]
    for option, value, message in (
        ("--temperature", "nan", "--temperature nan: must be a finite number >= 0"),
        ("--temperature", "inf", "--temperature inf: must be a finite number >= 0"),
        ("--device", "tpu", "--device tpu: not a device (cpu, cuda, cuda:N)"),
    ):
        assert main([*generate, option, value]) == EXIT_CONFIG, value
        assert message in capsys.readouterr().err
    # a machine without a GPU (mocked: this one may have one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*generate, "--device", "cuda"]) == EXIT_CONFIG
    assert "--device cuda: no CUDA GPU here; use --device cpu" in capsys.readouterr().err
    monkeypatch.undo()
    latin1 = [sys.executable, "-m", "hpctrain", "generate", str(lm_run), "--prompt", b"caf\xe9"]
    proc = subprocess.run(latin1, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert "usage error: --prompt: not UTF-8 text" in proc.stderr and "Traceback" not in proc.stderr
    assert main([*generate, "--device", "cpu"]) == 0


def test_the_demo_config_keeps_a_best_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#32 item 2: README's `export runs/demo model.safetensors --best` and `eval runs/demo
    --checkpoint best` failed after `make demo` ("no best checkpoint"); `run` is a tiny run
    of configs/demo.yaml."""
    assert main(["config", "show", str(REPO / "configs" / "demo.yaml")]) == 0
    shown = capsys.readouterr().out
    assert "monitor: val_accuracy" in shown and "keep_best: 1" in shown
    best = (run / "checkpoints" / "best").read_text().strip()
    assert main(["eval", str(run), "--checkpoint", "best", "--out", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["checkpoint"].endswith(best)
    assert main(["export", str(run), str(tmp_path / "model.safetensors"), "--best"]) == 0


def test_export_and_generate_choose_a_checkpoint_as_eval_does(
    run: Path, lm_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#43 item 12: `--checkpoint PATH|latest|best` on every verb (`generate` took no PATH,
    `export` only `--best`), `-o` for the output; the older spellings still work."""

    def exported_step(*options: str) -> int:
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.pt"
        assert main(["export", str(run), "-o", str(out), *options]) == 0
        return int(json.loads(out.with_name(out.name + ".json").read_text())["step"])

    best = int((run / "checkpoints" / "best").read_text().strip().split("-")[1])
    assert exported_step() == exported_step("--checkpoint", "latest") == 2
    assert exported_step("--checkpoint", str(run / "checkpoints" / "step-1")) == 1
    assert exported_step("--checkpoint", "best") == exported_step("--best") == best
    generate = ["generate", str(lm_run), "--prompt", "the ", "--max-new-tokens", "2"]
    assert main([*generate, "--checkpoint", str(lm_run / "checkpoints" / "step-2")]) == 0
    assert main([*generate, "--checkpoint", str(tmp_path / "nope")]) == 4
    assert f"{tmp_path / 'nope'}: no committed checkpoint" in capsys.readouterr().err


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_export_of_an_ema_eval_run_writes_the_ema_unless_told(tmp_path: Path) -> None:
    """#32 item 7: `export --best` of a `train.ema_eval` run wrote the trained weights, not the
    EMA whose evaluation picked the checkpoint (eval, predict and generate read the EMA)."""
    import torch

    shards = image_shards(tmp_path / "data", CLASSES, val_fraction=0.5)
    run = tiny_run(tmp_path / "run", shards, "train.ema_decay=0.5", "train.ema_eval=true")
    exported = {}
    for option in (None, "--ema", "--no-ema"):
        out = tmp_path / f"{(option or 'default').lstrip('-')}.pt"
        assert main(["export", str(run), str(out), "--best", *([option] if option else [])]) == 0
        exported[option] = torch.load(out, weights_only=True)
    default, ema, trained = exported[None], exported["--ema"], exported["--no-ema"]
    assert all(torch.equal(default[k], ema[k]) for k in default)
    assert any(not torch.equal(default[k], trained[k]) for k in default)
    assert json.loads((tmp_path / "default.pt.json").read_text())["ema"] is True
    assert "ema" not in json.loads((tmp_path / "no-ema.pt.json").read_text())


def new_images(folder: Path) -> Path:
    """folder/b.jpg, a.jpg, more/c.png (16 px), and a text file that is no image."""
    rng = np.random.default_rng(7)
    (folder / "more").mkdir(parents=True)
    for name in ("b.jpg", "a.jpg", "more/c.png"):
        pixels = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)
    (folder / "notes.txt").write_text("not an image")
    return folder


def prediction_rows(out: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(out.glob("part-*")) for line in part.open()]


def test_predict_on_a_folder_of_images_names_each_file(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """#43 item 13: a folder of new images (no index) is converted for the prediction, and each
    row names the file it is about, not only the sample's position."""
    import tempfile

    new, out = new_images(tmp_path / "new"), tmp_path / "preds"
    temporary = set(Path(tempfile.gettempdir()).glob("hpctrain-predict-*"))
    assert main(["predict", str(run), "--data", str(new), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"3 images of {new} converted for this prediction" in captured.err
    # a line to read, not the manifest's JSON again (#49)
    [done] = [line for line in captured.out.splitlines() if line.startswith("predicted ")]
    assert done.startswith(f"predicted 3 samples of {new} with ") and done.endswith(
        f"on 1 rank(s) -> {out}/manifest.json (jsonl, 1 part(s))"
    )
    rows = prediction_rows(out)
    assert [r["source"] for r in rows] == ["a.jpg", "b.jpg", "more/c.png"]
    assert all(r["class"] in CLASSES for r in rows) and len({r["key"] for r in rows}) == 3
    assert json.loads((out / "manifest.json").read_text())["data"] == str(new)
    assert set(Path(tempfile.gettempdir()).glob("hpctrain-predict-*")) == temporary  # removed
    # every task of an srun step (or of a submitted job) would convert it: one line instead
    command = f"hpctrain convert {new} -o SHARDS --source images"
    submit = ["submit", str(run), "--predict", "--data", str(new), "-o", str(out), "--dry-run"]
    assert main([*submit, "--profile", "local-dev"]) == EXIT_CONFIG
    assert command in capsys.readouterr().err
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert main(["predict", str(run), "--data", str(new), "-o", str(out)]) == EXIT_CONFIG
    assert f"convert it first ({command}) and predict on SHARDS" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_predict_on_a_folder_of_images_with_two_ranks_converts_it_once(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, out = new_images(tmp_path / "new"), tmp_path / "preds"
    assert main(["predict", str(run), "--data", str(new), "-o", str(out), "--nproc", "2"]) == 0
    assert capsys.readouterr().err.count("converted for this prediction") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["data"] == str(new)
    assert sorted(r["source"] for r in prediction_rows(out)) == ["a.jpg", "b.jpg", "more/c.png"]


def test_predict_with_two_ranks_refuses_before_starting_them(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    val = run.parent / "data" / "shards" / "val"
    assert main(["predict", str(run), "--data", str(val), "--out", str(val), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("lies inside --data") == 1 and "[rank" not in err
