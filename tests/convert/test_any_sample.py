"""Any sample: manifests whose columns all become members, and Python (callable) sources."""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpctrain.cli.main import main
from hpctrain.data.index import read_index
from hpctrain.data.stream import open_shard
from hpctrain.data.tar import iter_samples

from .conftest import image_bytes


def read_back(folder: Path) -> dict[str, dict[str, bytes]]:
    """key -> {field: bytes}, read with the loader's own tar parser, in index order."""
    index = read_index(str(folder / "index.json"))
    out: dict[str, dict[str, bytes]] = {}
    for i in range(len(index.shards)):
        with open_shard(index.shard_url(i)) as stream:
            for _, key, members in iter_samples(stream):
                out[key] = {field: bytes(data) for field, data in members.items()}
    return out


def palette_png(seed: int, size: int = 12) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 5, size=(size, size), dtype=np.uint8), mode="P")
    image.putpalette([v for i in range(256) for v in (i * 40 % 256, i * 80 % 256, i * 20 % 256)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def convert(*args: str) -> int:
    return main(["convert", *args, "--progress", "none"])


@pytest.fixture
def multi_field_manifest(tmp_path: Path) -> Path:
    """A JSONL manifest: img.jpg, mask (palette PNG paths), depth.npy, left (a second image),
    cls, txt, json, and a scalar column `source` gathered into the json member... which the
    explicit json column forbids, so `source` is named source.txt here."""
    root = tmp_path / "data"
    for sub in ("img", "mask", "depth", "left"):
        (root / sub).mkdir(parents=True)
    rows = []
    for i in range(6):
        (root / "img" / f"{i}.jpg").write_bytes(image_bytes(i))
        (root / "mask" / f"{i}.png").write_bytes(palette_png(i))
        (root / "depth" / f"{i}.npy").write_bytes(npy_bytes(np.full((3, 4), i, np.float32)))
        (root / "left" / f"{i}.jpg").write_bytes(image_bytes(100 + i))
        rows.append(
            {
                "img.jpg": f"img/{i}.jpg",
                "mask": f"mask/{i}.png",
                "depth.npy": f"depth/{i}.npy",
                "left": str(root / "left" / f"{i}.jpg"),  # absolute paths work too
                "cls": i % 3,
                "txt": f"caption {i} – ünïcode",
                "json": {"boxes": [[i, i, 2, 2]], "id": f"s{i}"},
                "source.txt": "camera-a",
            }
        )
    manifest = root / "list.jsonl"
    manifest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return manifest


def test_manifest_every_column_becomes_a_member(multi_field_manifest: Path, tmp_path: Path) -> None:
    root = multi_field_manifest.parent
    dest = tmp_path / "out"
    assert convert(str(multi_field_manifest), str(dest), "--samples-per-shard", "4") == 0
    samples = read_back(dest)
    assert list(samples) == [f"{i:09d}" for i in range(6)]
    for i, sample in enumerate(samples.values()):
        # member order in the shard: column order (file and scalar columns alike)
        assert list(sample) == [
            "img.jpg",
            "mask.png",
            "depth.npy",
            "left.jpg",
            "cls",
            "txt",
            "json",
            "source.txt",
        ]
        assert sample["img.jpg"] == (root / "img" / f"{i}.jpg").read_bytes()
        assert sample["mask.png"] == (root / "mask" / f"{i}.png").read_bytes()
        assert sample["left.jpg"] == (root / "left" / f"{i}.jpg").read_bytes()
        assert np.array_equal(np.load(io.BytesIO(sample["depth.npy"])), np.full((3, 4), i))
        with Image.open(io.BytesIO(sample["mask.png"])) as mask:
            assert mask.mode == "P"  # palette indices (class ids) kept
            assert np.array_equal(
                np.asarray(mask), np.asarray(Image.open(io.BytesIO(palette_png(i))))
            )
        assert sample["cls"] == str(i % 3).encode()
        assert sample["txt"].decode() == f"caption {i} – ünïcode"
        assert json.loads(sample["json"]) == {"boxes": [[i, i, 2, 2]], "id": f"s{i}"}
        assert sample["source.txt"] == b"camera-a"


def test_csv_manifest_scalars_and_gathered_json(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(image_bytes(1))
    (tmp_path / "m.png").write_bytes(palette_png(1))
    (tmp_path / "list.csv").write_text(
        'path,mask,label,cls2,meta.json,caption,weight\na.jpg,m.png,dog,7,"{""b"": 2, ""a"": 1}",hi,0.5\n'
    )
    assert convert(str(tmp_path / "list.csv"), str(tmp_path / "out")) == 0
    (sample,) = read_back(tmp_path / "out").values()
    assert sample == {
        "jpg": image_bytes(1),  # the path column: named by the image's format, as before
        "cls": b"0",  # labels that are names: class positions, names in the index
        "mask.png": palette_png(1),
        "cls2": b"7",
        "meta.json": b'{"a":1,"b":2}',  # a CSV cell of JSON text, written canonically
        "json": b'{"caption":"hi","weight":"0.5"}',  # the other columns, gathered
        "__source__": b"a.jpg",  # the path column as written
    }
    assert read_index(str(tmp_path / "out" / "index.json")).class_names == ("dog",)


def test_missing_file_names_row_column_and_path_or_is_skipped(
    multi_field_manifest: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = multi_field_manifest.parent / "mask" / "3.png"
    missing.unlink()
    dest = tmp_path / "out"
    assert convert(str(multi_field_manifest), str(dest)) == 3
    err = capsys.readouterr().err
    assert f"{missing}: {multi_field_manifest} row 4, column 'mask': cannot read" in err
    assert not (dest / "index.json").exists()
    assert convert(str(multi_field_manifest), str(dest), "--on-error", "skip", "--overwrite") == 0
    assert (dest / "skipped.txt").read_text().startswith(f"{missing}\t{multi_field_manifest} row 4")
    index = read_index(str(dest / "index.json"))
    assert index.num_samples == 5 and index.extra["num_skipped"] == 1
    assert "000000003" not in read_back(dest)


def test_bad_cell_is_a_bad_sample_named_by_row_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.jpg").write_bytes(image_bytes(1))
    (tmp_path / "list.csv").write_text("img.jpg,cls\na.jpg,1\na.jpg,abc\n")
    assert convert(str(tmp_path / "list.csv"), str(tmp_path / "out")) == 3
    assert "row 2: column 'cls': 'abc' is not an integer" in capsys.readouterr().err
    assert (
        convert(
            str(tmp_path / "list.csv"), str(tmp_path / "out"), "--on-error", "skip", "--overwrite"
        )
        == 0
    )
    assert read_index(str(tmp_path / "out" / "index.json")).num_samples == 1


def test_manifest_column_errors_name_the_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.jpg").write_bytes(image_bytes(1))
    cases = {
        "label,caption\ncat,x\n": "no file column",
        "path,label,cls\na.jpg,1,2\n": "column 'cls' and the label column",
        "img.jpg,json,other\na.jpg,{},x\n": "column 'json' and the columns gathered into json",
        "img.jpg,a/b.txt\na.jpg,x\n": "'a/b.txt' cannot be a field name",
    }
    for i, (text, message) in enumerate(cases.items()):
        (tmp_path / f"{i}.csv").write_text(text)
        assert convert(str(tmp_path / f"{i}.csv"), str(tmp_path / f"out{i}")) == 3
        assert message in capsys.readouterr().err


# -- Python sources ------------------------------------------------------------------------

DATASET_MODULE = """
import numpy as np
import torch
from PIL import Image


def _mask(i):
    image = Image.fromarray(np.arange(16, dtype=np.uint8).reshape(4, 4) % (i + 2), mode="P")
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] * 85 + [0])
    return image


def _sample(i):
    rgb = np.random.default_rng(i).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    return {
        "__key__": f"item{i:03d}",
        "img.png": Image.fromarray(rgb),
        "photo.jpg": Image.fromarray(rgb),
        "mask.png": _mask(i),
        "depth": np.full((2, 3), i, np.float32),
        "feat": torch.arange(4, dtype=torch.int64) * i,
        "txt": f"sample {i}",
        "cls": i % 3,
        "meta": {"i": i, "tags": ["a", "b"]},
        "score": 0.25 * i,
        "raw.bin": bytes([i, 255]),
        "nothing": None,
    }


class Pairs(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return _sample(i)


def make_dataset(size=5):
    return Pairs(size)


def make_generator(size=5):
    return (_sample(i) for i in range(size))


def not_dicts():
    return iter([{"txt": "ok"}, ["a", "list"]])


NOT_CALLABLE = 3
"""


@pytest.fixture
def dataset_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package in the current folder, as a user's own project has it; its unique name."""
    name = f"userdata_{tmp_path.name.replace('-', '_')}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "data.py").write_text(textwrap.dedent(DATASET_MODULE))
    monkeypatch.chdir(tmp_path)
    return f"{name}.data"


@pytest.mark.parametrize("function", ["make_dataset", "make_generator"])
def test_python_source_round_trip(dataset_module: str, tmp_path: Path, function: str) -> None:
    dest = tmp_path / "out"
    spec = f"{dataset_module}:{function}"
    assert convert(spec, str(dest), "--arg", "size=7", "--samples-per-shard", "3") == 0
    index = read_index(str(dest / "index.json"))
    assert [s.num_samples for s in index.shards] == [3, 3, 1]
    assert "--arg size=7" in index.command and spec in index.command
    samples = read_back(dest)
    assert list(samples) == [f"item{i:03d}" for i in range(7)]
    for i, sample in enumerate(samples.values()):
        assert list(sample) == [
            "img.png",
            "photo.jpg",
            "mask.png",
            "depth.npy",
            "feat.npy",
            "txt",
            "cls",
            "meta.json",
            "score.json",
            "raw.bin",
        ]
        rgb = np.random.default_rng(i).integers(0, 256, (8, 6, 3), dtype=np.uint8)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["img.png"]))), rgb)
        assert sample["photo.jpg"][:3] == b"\xff\xd8\xff"  # JPEG, lossy: only its size is exact
        assert Image.open(io.BytesIO(sample["photo.jpg"])).size == (6, 8)
        with Image.open(io.BytesIO(sample["mask.png"])) as mask:
            assert mask.mode == "P"
            expected = np.arange(16, dtype=np.uint8).reshape(4, 4) % (i + 2)
            assert np.array_equal(np.asarray(mask), expected)
        depth = np.load(io.BytesIO(sample["depth.npy"]), allow_pickle=False)
        assert depth.dtype == np.float32 and np.array_equal(depth, np.full((2, 3), i))
        assert np.array_equal(np.load(io.BytesIO(sample["feat.npy"])), np.arange(4) * i)
        assert sample["txt"] == f"sample {i}".encode() and sample["cls"] == str(i % 3).encode()
        assert json.loads(sample["meta.json"]) == {"i": i, "tags": ["a", "b"]}
        assert json.loads(sample["score.json"]) == 0.25 * i
        assert sample["raw.bin"] == bytes([i, 255])


def test_python_source_same_bytes_for_any_workers(dataset_module: str, tmp_path: Path) -> None:
    spec = f"{dataset_module}:make_dataset"
    trees = []
    for workers in ("1", "2"):
        args = ["--arg", "size=9", "--samples-per-shard", "2", "--workers", workers, "--shuffle"]
        assert convert(spec, str(tmp_path / "out"), *args, "--overwrite") == 0
        trees.append(tree(tmp_path / "out"))
    assert len(trees[0]) == 7 and trees[0] == trees[1]  # 5 shards, index.json and .compact


def test_python_source_resume_continues_the_same_plan(
    dataset_module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spool is a new temporary file on each run: the plan's fingerprint must not depend on it."""
    import hpctrain.convert.run as run

    spec = f"{dataset_module}:make_dataset"
    args = ["--samples-per-shard", "2"]
    assert convert(spec, str(tmp_path / "a"), *args) == 0

    def killed(*_: object) -> None:
        raise KeyboardInterrupt  # killed after the shards, before skipped.txt and the index

    with monkeypatch.context() as patch:
        patch.setattr(run, "_commit", killed)
        assert convert(spec, str(tmp_path / "b"), *args) == 130  # one line, as after Ctrl-C
    assert (tmp_path / "b" / ".hpctrain-convert.json").exists()
    (tmp_path / "b" / "shard-000001.tar").unlink()
    assert convert(spec, str(tmp_path / "b"), *args, "--resume") == 0
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    index_a, index_b = json.loads(a.pop("index.json")), json.loads(b.pop("index.json"))
    a.pop("index.compact"), b.pop("index.compact")  # derived from the JSONs
    assert a == b and len(a) == 3
    assert index_a["shards"] == index_b["shards"]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "no_such_module_xyz.data:make",
            "no_such_module_xyz.data:make: cannot import 'no_such_module_xyz.data'",
        ),
        ("{module}:missing", "{module}:missing: '{module}' has no attribute 'missing'"),
        ("{module}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
        ("{module}:not_dicts", "{module}:not_dicts: sample 1 is a list, not a dict of fields"),
    ],
)
def test_python_source_errors_name_the_callable(
    dataset_module: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    message: str,
) -> None:
    code = convert(spec.format(module=dataset_module), str(tmp_path / "out"))
    assert code in (2, 3)  # a command-line mistake (import) or bad data (a sample)
    assert message.format(module=dataset_module) in capsys.readouterr().err
    assert not (tmp_path / "out" / "index.json").exists()


def test_python_values_that_cannot_be_encoded_are_named() -> None:
    from hpctrain.convert.sources.generated import encode_sample
    from hpctrain.errors import DataError

    with pytest.raises(
        DataError, match=r"m:f: sample 4, field 'when': a set value has no encoding"
    ):
        encode_sample({"when": {1, 2}}, 4, "m:f")
    with pytest.raises(DataError, match=r"m:f: sample 0: key 'a.b' is empty, has a dot"):
        encode_sample({"__key__": "a.b", "txt": "x"}, 0, "m:f")
    with pytest.raises(DataError, match=r"target field .mask.jpg. would lose its values"):
        encode_sample({"mask.jpg": Image.new("P", (2, 2))}, 0, "m:f")
    key, members = encode_sample({"key": 12, "x": np.uint8(3), "flag": True}, 0, "m:f")
    assert key == "12" and members == [("x.cls", b"3"), ("flag.json", b"true")]


def test_an_index_or_manifest_never_imports(tmp_path: Path) -> None:
    """A source kind comes from what SRC is; `pkg.mod:fn` text inside files is only data."""
    from hpctrain.convert.sources import detect_kind

    (tmp_path / "list.csv").write_text("path\nos:system\n")
    assert detect_kind(str(tmp_path / "list.csv")) == "manifest"
    assert detect_kind("os.path:join") == "python"


def test_python_source_decodes_back_value_for_value(dataset_module: str, tmp_path: Path) -> None:
    """Through the loader's decoders: pixels, palette indices, arrays, text, labels, JSON."""
    import torch

    from hpctrain.data.decode import decode_sample

    assert convert(f"{dataset_module}:make_dataset", str(tmp_path / "out")) == 0
    for i, (key, members) in enumerate(read_back(tmp_path / "out").items()):
        sample = decode_sample(key, members)
        rgb = np.random.default_rng(i).integers(0, 256, (8, 6, 3), dtype=np.uint8)
        assert torch.equal(sample["img.png"], torch.from_numpy(rgb).permute(2, 0, 1))
        assert sample["photo.jpg"].shape == (3, 8, 6)
        mask = np.arange(16, dtype=np.uint8).reshape(4, 4) % (i + 2)
        assert torch.equal(sample["mask.png"], torch.from_numpy(mask))  # [H, W] class ids
        assert torch.equal(sample["depth.npy"], torch.full((2, 3), float(i)))
        assert torch.equal(sample["feat.npy"], torch.arange(4) * i)
        assert (sample["txt"], sample["cls"]) == (f"sample {i}", i % 3)
        assert sample["meta.json"] == {"i": i, "tags": ["a", "b"]}
        assert sample["raw.bin"] == bytes([i, 255])


def test_general_shards_reshard_unchanged(dataset_module: str, tmp_path: Path) -> None:
    """Re-sharding copies every member of samples without any image member too."""
    assert (
        convert(f"{dataset_module}:make_generator", str(tmp_path / "a"), "--samples-per-shard", "2")
        == 0
    )
    assert convert(str(tmp_path / "a"), str(tmp_path / "b"), "--samples-per-shard", "4") == 0
    assert [s.num_samples for s in read_index(str(tmp_path / "b" / "index.json")).shards] == [4, 1]
    assert read_back(tmp_path / "b") == read_back(tmp_path / "a")


def test_reencoding_leaves_target_fields_alone(multi_field_manifest: Path, tmp_path: Path) -> None:
    """--max-side/--quality re-encode images as JPEG, but never a mask (its values are ids)."""
    assert convert(str(multi_field_manifest), str(tmp_path / "out"), "--quality", "50") == 0
    for i, sample in enumerate(read_back(tmp_path / "out").values()):
        assert sample["mask.png"] == palette_png(i)
        assert sample["img.jpg"] != image_bytes(i) and sample["img.jpg"][:3] == b"\xff\xd8\xff"


def test_python_source_val_split_is_stratified_by_cls(dataset_module: str, tmp_path: Path) -> None:
    args = ["--arg", "size=12", "--val-fraction", "0.25"]
    assert convert(f"{dataset_module}:make_dataset", str(tmp_path / "out"), *args) == 0
    val = read_back(tmp_path / "out" / "val")
    assert sorted(int(s["cls"]) for s in val.values()) == [0, 1, 2]  # one of each class's four
    assert len(read_back(tmp_path / "out" / "train")) == 9


@pytest.mark.parametrize("workers", [0, 2])
def test_manifest_shards_through_the_loader(
    multi_field_manifest: Path, tmp_path: Path, workers: int
) -> None:
    """convert -> ShardedLoader (no task: the default decoders): every field as in the source."""
    import torch

    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index

    root = multi_field_manifest.parent
    assert (
        convert(str(multi_field_manifest), str(tmp_path / "out"), "--samples-per-shard", "3") == 0
    )
    index = open_index(str(tmp_path / "out"))
    cfg = DataConfig(batch_size=2, workers_per_rank=workers)
    loader = ShardedLoader(index, cfg, rank=0, world_size=1, seed=0, train=False)
    seen = {}
    try:
        for batch in loader:
            for row, key in enumerate(batch["key"]):
                if batch["valid"][row]:
                    seen[key] = {field: batch[field][row] for field in batch if field != "key"}
    finally:
        loader.close()
    assert sorted(seen) == [f"{i:09d}" for i in range(6)]
    for key, sample in seen.items():
        i = int(key)
        mask = np.array(Image.open(root / "mask" / f"{i}.png"))
        assert torch.equal(sample["mask.png"], torch.from_numpy(mask))  # palette indices
        assert torch.equal(sample["depth.npy"], torch.full((3, 4), float(i)))
        assert sample["img.jpg"].shape == sample["left.jpg"].shape == (3, 16, 16)
        assert int(sample["cls"]) == i % 3 and sample["txt"] == f"caption {i} – ünïcode"
        assert sample["json"] == {"boxes": [[i, i, 2, 2]], "id": f"s{i}"}


def test_duplicate_keys_are_named(tmp_path: Path) -> None:
    from hpctrain.convert.sources.generated import Spool
    from hpctrain.errors import DataError

    spool = Spool(str(tmp_path), "m:f")
    spool.add("a", [("txt", b"x")], "m:f sample 0")
    with pytest.raises(DataError, match="m:f: samples 0 and 1 have the same key 'a'"):
        spool.add("a", [("txt", b"y")], "m:f sample 1")
    spool.abort()
