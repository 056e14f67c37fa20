"""`hpctrain eval` and `hpctrain predict` on checkpoints of tiny DDP and FSDP2 runs (2 gloo ranks).

One 2-rank job (`evalpredict_worker.py`) trains both runs and evaluates and predicts them
in-process; the assertions below share it.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config import load_config
from hpctrain.data.index import ShardIndex, ShardInfo
from hpctrain.inference.evaluate import data_name
from hpctrain.inference.predict import decode_run_length, jsonl_line, run_length, shard_members
from tests.support.train_kit import REPO, run_hpctrain, run_two_ranks

S3_BUCKET = "predictions"


def val_keys(shards: Path) -> set[str]:
    keys = set()
    for tar in sorted((shards / "val").glob("*.tar")):
        with tarfile.open(tar) as f:
            keys.update(m.name.split(".", 1)[0] for m in f.getmembers())
    return keys


def read_jsonl(folder: Path) -> list[dict]:
    lines = []
    for part in sorted(folder.glob("part-*.jsonl")):
        lines += [json.loads(line) for line in part.read_text().splitlines()]
    return lines


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from tests.support.local_servers import moto_s3_server, s3_environment

    with moto_s3_server() as endpoint, s3_environment(endpoint):
        import fsspec

        fsspec.filesystem("s3").mkdir(S3_BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def done(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Path:
    out = tmp_path_factory.mktemp("evalpredict")
    corrupt = out / "corrupt-val"
    shutil.copytree(shapes_shards / "val", corrupt)
    shard = corrupt / "val-000001.tar"
    with tarfile.open(shard) as f:
        members = f.getmembers()
    middle = members[len(members) // 2].offset  # a header in the middle: the rest is lost
    data = bytearray(shard.read_bytes())
    data[middle : middle + 512] = b"\xff" * 512
    shard.write_bytes(bytes(data))
    run_two_ranks(
        REPO / "tests" / "support" / "evalpredict_worker.py",
        str(shapes_shards),
        str(corrupt),
        str(out),
        f"s3://{S3_BUCKET}/fsdp",
        timeout=300,
    )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["ddp", "ema"])
def test_eval_of_the_best_checkpoint_matches_the_training_evaluation(done: Path, run: str) -> None:
    """`ema`: an FSDP2 run that evaluated (and kept its best checkpoint by) its EMA."""
    record = json.loads((done / f"eval-{run}-best.json").read_text())
    best = (done / run / "checkpoints" / "best").read_text().strip()
    assert record["checkpoint"].endswith(best) and record["step"] == int(best.split("-")[1])
    training = [
        json.loads(line)
        for line in (done / run / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    same_step = next(r for r in training if r["step"] == record["step"])
    for key in ("val_loss", "val_accuracy", "val_top5", "val_samples"):
        assert record[key] == pytest.approx(same_step[key], rel=1e-6), key
    assert record["val_samples"] == 80 and record["world_size"] == 2
    assert record["loader_samples_lost"] == 0
    assert record["weights"] == same_step.get("weights", "model")


@pytest.mark.distributed
def test_eval_and_predict_of_an_ema_run_read_its_ema_unless_told(done: Path) -> None:
    ema = json.loads((done / "eval-ema-best.json").read_text())
    trained = json.loads((done / "eval-ema-trained.json").read_text())
    assert (ema["weights"], trained["weights"]) == ("ema", "model")
    assert ema["step"] == trained["step"] and ema["val_loss"] != trained["val_loss"]
    manifest = json.loads((done / "pred-ema" / "manifest.json").read_text())
    assert manifest["weights"] == "ema" and manifest["num_samples"] == 80


@pytest.mark.distributed
def test_eval_of_an_fsdp2_checkpoint_under_fsdp2_and_ddp(done: Path) -> None:
    fsdp = json.loads((done / "eval-fsdp.json").read_text())
    as_ddp = json.loads((done / "eval-fsdp-as-ddp.json").read_text())
    assert fsdp["step"] == as_ddp["step"] == 1 and fsdp["val_samples"] == 80
    for key in ("val_loss", "val_accuracy", "val_top5"):
        assert fsdp[key] == pytest.approx(as_ddp[key], rel=1e-6), key


@pytest.mark.distributed
def test_predictions_cover_every_sample_once_on_two_ranks(done: Path, shapes_shards: Path) -> None:
    folder = done / "pred-ddp"
    manifest = json.loads((folder / "manifest.json").read_text())
    lines = read_jsonl(folder)
    keys = [line["key"] for line in lines]
    assert len(keys) == len(set(keys)) == manifest["num_samples"] == 80
    assert set(keys) == val_keys(shapes_shards)
    assert [p["url"] for p in manifest["parts"]] == [
        "part-00000-of-00002.jsonl",
        "part-00001-of-00002.jsonl",
    ]
    assert sum(p["num_samples"] for p in manifest["parts"]) == 80
    first = lines[0]
    assert first["class"] == first["top_k"][0]["class"] and len(first["top_k"]) == 5
    probabilities = [t["probability"] for t in first["top_k"]]
    assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0001
    assert not list(folder.glob(".tmp*"))
    # each row names the file its sample was converted from (#43 item 13)
    images = shapes_shards.parent / "images"
    sources = [line["source"] for line in lines]
    assert len(set(sources)) == 80 and all((images / s).is_file() for s in sources)


@pytest.mark.distributed
def test_shards_output_is_a_dataset_with_an_index(done: Path, shapes_shards: Path) -> None:
    folder = done / "pred-fsdp"
    index = json.loads((folder / "index.json").read_text())
    keys = []
    for shard in index["shards"]:
        with tarfile.open(folder / shard["url"]) as f:
            names = f.getnames()
            assert all(n.endswith((".json", ".__source__")) for n in names)
            keys += [n.split(".", 1)[0] for n in names if n.endswith(".json")]
            sample = json.loads(f.extractfile(names[0]).read())  # type: ignore[union-attr]
            assert {"label", "class", "probability", "top_k"} <= set(sample)
            source = f.extractfile(names[1]).read().decode()  # type: ignore[union-attr]
            assert names[1].endswith(".__source__") and source.endswith(".jpg")
    assert sorted(keys) == sorted(val_keys(shapes_shards))
    assert index["num_samples"] == 80


@pytest.mark.distributed
def test_lost_samples_are_counted_and_absent(done: Path, shapes_shards: Path) -> None:
    manifest = json.loads((done / "pred-skip" / "manifest.json").read_text())
    keys = [line["key"] for line in read_jsonl(done / "pred-skip")]
    lost = manifest["loader_samples_lost"] + manifest["loader_samples_skipped"]
    assert manifest["loader_shards_failed"] == 1 and lost > 0
    assert len(keys) == len(set(keys)) == manifest["num_samples"] == 80 - lost
    assert set(keys) < val_keys(shapes_shards)


@pytest.mark.distributed
@pytest.mark.network
def test_predictions_to_s3(done: Path, s3_endpoint: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3")
    manifest = json.loads(fs.cat(f"{S3_BUCKET}/fsdp/manifest.json"))
    keys = []
    for part in manifest["parts"]:
        text = fs.cat(f"{S3_BUCKET}/fsdp/{part['url']}").decode()
        keys += [json.loads(line)["key"] for line in text.splitlines()]
    assert len(keys) == len(set(keys)) == 80


@pytest.mark.distributed
def test_a_bad_data_path_is_a_clear_error(done: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "index.json"
    proc = run_hpctrain(
        "predict", str(done / "ddp"), "--data", str(missing), "--out", str(tmp_path / "p"),
        "--nproc", "2", check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    for rank in (0, 1):  # both ranks of the local launcher, each with the same line
        assert (
            f"hpctrain predict [rank {rank}]: data error: {missing}: index not found" in proc.stderr
        )
    assert not (tmp_path / "p").exists()


@pytest.mark.distributed
def test_a_checkpoint_folder_names_its_run_and_config(done: Path, tmp_path: Path) -> None:
    from hpctrain.errors import UsageError
    from hpctrain.inference.target import resolve_target

    step = done / "fsdp" / "checkpoints" / "step-1"
    cfg, checkpoint = resolve_target(str(step), ["data.batch_size=4"])
    assert checkpoint == str(step) and cfg.train.strategy == "fsdp"
    assert cfg.run_dir == str(done / "fsdp") and cfg.data.batch_size == 4
    cfg, checkpoint = resolve_target(str(done / "ddp"))
    assert checkpoint is None and cfg.checkpoint.keep_best == 1
    with pytest.raises(UsageError, match="no such file or folder"):
        resolve_target(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="neither a config file, a run folder"):
        resolve_target(str(tmp_path))


def test_segmentation_masks_as_png_members_and_run_lengths() -> None:
    from hpctrain.tasks.segmentation import Segmentation

    cfg = load_config(None, ["task=segmentation", "model.num_classes=3", "model.image_size=16"])
    task = Segmentation(cfg, ShardIndex(shards=(ShardInfo("x.tar", 1),)))
    # data to predict on needs no mask: the predict transform reads and resizes the image only
    image = torch.randint(0, 255, (3, 40, 30), dtype=torch.uint8)
    sample = task.predict_transform()({"key": "k1", "img.jpg": image})
    assert sorted(sample) == ["image", "key"] and sample["image"].shape == (3, 16, 16)
    torch.manual_seed(0)
    model = task.build_model().eval()
    batch = {"image": torch.stack([sample["image"], sample["image"].flip(-1)])}
    with torch.no_grad():
        outputs = task.predict(model, batch)
    assert len(outputs) == 2 and outputs[0]["mask.png"].shape == (16, 16)
    from PIL import Image

    members = dict(shard_members("k1", outputs[0]))
    png = np.array(Image.open(io.BytesIO(members["k1.mask.png"])))
    assert (png == outputs[0]["mask.png"].numpy()).all()
    assert json.loads(members["k1.json"])["classes"] == outputs[0]["classes"]
    line = json.loads(jsonl_line("k1", outputs[0]))
    assert torch.equal(decode_run_length(line["mask.png"]), outputs[0]["mask.png"].long())


def test_run_length_round_trip_and_data_names() -> None:
    mask = torch.tensor([[0, 0, 1], [1, 1, 2]], dtype=torch.uint8)
    encoded = run_length(mask)
    assert encoded == {"size": [2, 3], "values": [0, 1, 2], "lengths": [2, 3, 1]}
    assert torch.equal(decode_run_length(encoded), mask.long())
    assert data_name("data/shards/val/index.json") == "val"
    assert data_name("s3://b/test-{000000..000003}.tar") == "test-_000000..000003_"
    with pytest.raises(TypeError, match="'key'"):
        jsonl_line("k", {"key": 1})
    with pytest.raises(TypeError, match="not JSON-able"):
        jsonl_line("k", {"x": object()})
