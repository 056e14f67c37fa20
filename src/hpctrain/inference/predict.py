"""`hpctrain predict`: a task's per-sample outputs over a dataset, each sample exactly once.

Every rank runs the task's `predict(model, batch) -> list[dict]` (one dict per sample, in
batch order) over its share of the data (an evaluation loader: index order, padded to equal
batches with padding flagged `valid=False`, which is dropped here) and writes one part;
rank 0 writes the manifest last. The layout of DEST (a local folder or any fsspec URL):

    DEST/part-00000-of-00002.jsonl   rank 0's samples: one JSON object a line, {"key": ...,
                                     "source": ..., <outputs>}
    DEST/part-00001-of-00002.jsonl   (with --format shards: .tar shards, plus DEST/index.json)
    DEST/manifest.json               written last: parts, sample counts, sha256, what was lost

A part is written under a temporary name (`.tmp.part-...`) and renamed when its rank has
finished; the manifest appears only once every rank's part is in place, so a DEST without
`manifest.json` is not a complete prediction (a failed or killed job leaves none). A new
prediction into the same DEST first removes the old manifest, index and parts (only a
prediction's: a DEST that is, holds or lies inside the data, or holds another index or
manifest, is refused before any work).

Values: JSON-able values go as they are; tensors and numpy arrays become lists in JSONL and
`KEY.<name>.npy` members in shards (gathered JSON-able values in `KEY.json`), except a field
whose name ends in `.png` (a class-id mask [H, W]): a PNG member `KEY.<name>` in shards,
and in JSONL a run-length encoding `{"size": [H, W], "values": [...], "lengths": [...]}`
of the row-major pixels. Shards output is itself a dataset: `hpctrain inspect DEST` reads it.

Each prediction names its sample by `key` and, when the data has one (`hpctrain convert` keeps
it for image folders and manifests), by the file it was converted from: `"source"` in JSONL,
a `KEY.__source__` member in shards (`hpctrain.data.fieldnames.SOURCE_FIELD`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
import torch.distributed as dist

from hpctrain.config import Config, ConfigError
from hpctrain.convert.tar import ShardTarWriter
from hpctrain.data.fieldnames import SOURCE_FIELD
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes, redact_url
from hpctrain.errors import UsageError
from hpctrain.files import write_atomic
from hpctrain.inference.session import inference_session
from hpctrain.observe.waits import Ticker
from hpctrain.train.evaluation import loss_counters, to_device

log = logging.getLogger("hpctrain")

FORMATS = ("jsonl", "shards")
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hpctrain-predictions"
MANIFEST_VERSION = 1
INDEX_NAME = "index.json"
PART_PREFIX = "part-"
TMP_PREFIX = ".tmp."
PART_NAME = re.compile(r"part-\d{5}-of-\d{5}\.(jsonl|tar)")  # `part_name`'s


def part_name(rank: int, world_size: int, fmt: str) -> str:
    return f"{PART_PREFIX}{rank:05d}-of-{world_size:05d}.{'jsonl' if fmt == 'jsonl' else 'tar'}"


def run_length(mask: torch.Tensor) -> dict[str, Any]:
    """Row-major run-length encoding of a 2-D class-id mask: runs of equal values."""
    flat = mask.detach().cpu().reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return {"size": list(mask.shape), "values": [], "lengths": []}
    changes = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), changes])
    ends = torch.cat([changes, torch.tensor([flat.numel()])])
    return {
        "size": list(mask.shape),
        "values": flat[starts].tolist(),
        "lengths": (ends - starts).tolist(),
    }


def decode_run_length(encoded: Mapping[str, Any]) -> torch.Tensor:
    """The mask `run_length` encoded (for readers of JSONL predictions)."""
    values = torch.tensor(encoded["values"], dtype=torch.int64)
    lengths = torch.tensor(encoded["lengths"], dtype=torch.int64)
    return torch.repeat_interleave(values, lengths).reshape(encoded["size"])


def as_array(value: Any) -> np.ndarray | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    return None


def png_bytes(array: np.ndarray, key: str, name: str) -> bytes:
    """A 2-D integer array as a lossless greyscale PNG (8 bits, or 16 for ids above 255)."""
    from PIL import Image

    if array.ndim != 2 or array.dtype.kind not in "ui":
        raise TypeError(
            f"predict output {name!r} of sample {key!r}: a .png field must be a 2-D integer "
            f"array, got {array.dtype} {list(array.shape)}"
        )
    if array.size and (array.min() < 0 or array.max() > 65535):
        raise TypeError(f"predict output {name!r} of sample {key!r}: values outside 0..65535")
    fits_8_bits = not array.size or array.max() <= 255
    image = Image.fromarray(array.astype(np.uint8 if fits_8_bits else np.uint16))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def json_value(value: Any, key: str, name: str) -> Any:
    array = as_array(value)
    if array is None:
        return value
    if name.endswith(".png"):
        return run_length(torch.from_numpy(np.ascontiguousarray(array)))
    return array.tolist()


def jsonl_line(key: str, outputs: Mapping[str, Any], source: str = "") -> bytes:
    """One sample's JSON line: `{"key": key, "source": source (when known), <outputs>}`."""
    for own in ("key", "source") if source else ("key",):
        if own in outputs:
            raise TypeError(
                f"predict output of sample {key!r} has a field {own!r}: it is hpctrain's"
            )
    named = {"key": key, "source": source} if source else {"key": key}
    record = {**named, **{n: json_value(v, key, n) for n, v in outputs.items()}}
    try:
        return (json.dumps(record) + "\n").encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"predict output of sample {key!r} is not JSON-able: {exc}") from None


def shard_members(
    key: str, outputs: Mapping[str, Any], source: str = ""
) -> list[tuple[str, bytes]]:
    """One sample's tar members: arrays as `.npy`/`.png`, everything else in `KEY.json`, and
    the source path (when known) in `KEY.__source__`, as `hpctrain convert` writes it."""
    members: list[tuple[str, bytes]] = []
    plain: dict[str, Any] = {}
    for name, value in outputs.items():
        array = as_array(value)
        if array is None:
            plain[name] = value
        elif name.endswith(".png"):
            members.append((f"{key}.{name}", png_bytes(array, key, name)))
        else:
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
            member = name if name.endswith(".npy") else f"{name}.npy"
            members.append((f"{key}.{member}", buffer.getvalue()))
    if plain:
        try:
            members.insert(0, (f"{key}.json", json.dumps(plain).encode()))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"predict output of sample {key!r} is not JSON-able: {exc}") from None
    if source:
        members.append((f"{key}.{SOURCE_FIELD}", source.encode()))
    return members


class PartWriter:
    """One rank's part, written under a temporary name and renamed by `commit`."""

    def __init__(self, fs: Any, root: str, name: str, fmt: str) -> None:
        self.fs, self.fmt = fs, fmt
        self.path = f"{root}/{name}"
        self.tmp_path = f"{root}/{TMP_PREFIX}{name}"
        self.file = fs.open(self.tmp_path, "wb")
        self.tar = ShardTarWriter(self.file) if fmt == "shards" else None
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0
        self.num_samples = 0

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A write that fails (a full disk, a quota) is one line naming the part and why."""
        try:
            yield
        except OSError as exc:
            raise UsageError(
                f"{redact_url(self.path)}: cannot write the predictions: {exc.strerror or exc}"
            ) from None

    def add(self, key: str, outputs: Mapping[str, Any], source: str = "") -> None:
        with self.writing():
            if self.tar is not None:
                for name, data in shard_members(key, outputs, source):
                    self.tar.add(name, data)
            else:
                line = jsonl_line(key, outputs, source)
                self.file.write(line)
                self.sha256.update(line)
                self.num_bytes += len(line)
        self.num_samples += 1

    def commit(self) -> dict[str, Any]:
        """Finish the part and give it its final name; returns its manifest entry."""
        with self.writing():
            if self.tar is not None:
                digest = self.tar.finish()
                self.num_bytes = self.tar.num_bytes
            else:
                digest = self.sha256.hexdigest()
            self.file.close()
            self.fs.mv(self.tmp_path, self.path)
        return {
            "url": self.path.rsplit("/", 1)[1],
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "sha256": digest,
        }

    def discard(self) -> None:
        # Closing flushes what is buffered, which fails again on a full disk: the part goes
        # all the same (left, it would keep the disk full).
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        with contextlib.suppress(OSError, ValueError):  # gone, or the store is unreachable
            self.fs.rm(self.tmp_path)


def data_folder(data: str) -> str:
    """The folder a data spec reads from: an index's or a shard pattern's folder, or itself."""
    spec = data.rstrip("/")
    leaf = spec.rsplit("/", 1)[-1]
    if leaf.endswith((".json", ".tar")) or "{" in leaf or "*" in leaf:
        return spec.rsplit("/", 1)[0] if "/" in spec else "."
    return spec


def same_or_nested(a: str, b: str) -> bool:
    """Whether one of two paths/URLs is the other or lies inside it."""
    if "://" not in a and "://" not in b:
        first, second = Path(a).resolve(), Path(b).resolve()
        return first.is_relative_to(second) or second.is_relative_to(first)
    x, y = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return x.startswith(y) or y.startswith(x)


def check_destination(fs: Any, root: str, out: str, data: str) -> None:
    """Refuse an `--out` that would overwrite what a prediction did not write.

    Raises:
        UsageError: `out` is, holds or lies inside the data read, holds a data index (not a
            previous prediction's), or a `manifest.json` that is not a prediction's.
    """
    where = f"--out {redact_url(out)}"
    if data and same_or_nested(out, data_folder(data)):
        raise UsageError(
            f"{where}: is, contains or lies inside --data {redact_url(data)}; "
            "write predictions to a folder of their own"
        )
    manifest_path = f"{root}/{MANIFEST_NAME}"
    manifest: Any = None
    if fs.exists(manifest_path):
        try:
            manifest = json.loads(fs.cat_file(manifest_path))
        except (OSError, ValueError):
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise UsageError(
                f"{where}: holds a {MANIFEST_NAME} that is not a prediction's; "
                "choose another folder"
            )
    if fs.exists(f"{root}/{INDEX_NAME}") and manifest is None:
        raise UsageError(
            f"{where}: holds a data index ({INDEX_NAME}) that no prediction wrote; "
            "choose another folder"
        )


def open_destination(out: str, data: str) -> tuple[Any, str]:
    """(filesystem, root) of `--out`, checked by `check_destination`.

    Raises:
        UsageError: see `check_destination`; or `out` cannot be read.
    """
    try:
        fs, root = fsspec.core.url_to_fs(out)
        root = root.rstrip("/") or "/"
        check_destination(fs, root, out, data)
    except OSError as exc:
        raise UsageError(f"--out {redact_url(out)}: cannot read there: {exc}") from None
    return fs, root


def clear_destination(fs: Any, root: str) -> None:
    """Remove a previous prediction's manifest (first: it would vouch for old parts), index
    and parts from `root`; nothing else there is touched (`check_destination` has made sure
    the manifest and index there are a prediction's)."""
    fs.makedirs(root, exist_ok=True)
    for name in (MANIFEST_NAME, INDEX_NAME):
        if fs.exists(f"{root}/{name}"):
            fs.rm(f"{root}/{name}")
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:  # an object store prefix with nothing under it yet
        entries = []
    for entry in entries:
        leaf = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if PART_NAME.fullmatch(leaf.removeprefix(TMP_PREFIX)):
            fs.rm(entry)


def run_predict(
    cfg: Config,
    *,
    checkpoint: str = "latest",
    data: str,
    out: str,
    fmt: str = "jsonl",
    data_name: str = "",
) -> int:
    """`hpctrain predict` in this process, as one rank of the job; returns the exit code.

    `data_name`: what the manifest names as the data when not `data` (the folder of images
    `data` was converted from, `hpctrain.inference.inputs`).

    Raises:
        UsageError: a bad `--format` or `--out`; ConfigError: a task without `predict`.
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: must be one of {'|'.join(FORMATS)}")
    if not out:
        raise UsageError("--out is empty: give a folder or fsspec URL for the predictions")
    fs, root = open_destination(out, data)  # before any work: nothing of the user's lost
    dest = out.rstrip("/")
    with inference_session(cfg, checkpoint, data, key="--data", predict=True) as run:
        predict = getattr(run.task, "predict", None)
        if not callable(predict):
            raise ConfigError(
                f"task={cfg.task!r}: {type(run.task).__name__} has no predict(model, batch) method"
            )
        env = run.env
        try:
            if env.is_main:
                clear_destination(fs, root)
        except OSError as exc:
            raise UsageError(f"--out {redact_url(out)}: cannot write there: {exc}") from None
        if env.is_distributed:
            dist.barrier()  # the old manifest and parts are gone before any rank writes
        writer = PartWriter(fs, root, part_name(env.rank, env.world_size, fmt), fmt)
        try:
            entry = predict_part(run, predict, writer)
        except BaseException:
            writer.discard()
            raise
        assert run.loader is not None  # a session over the data to predict on
        lost = loss_counters(run.loader, run.device)
        entries: list[Any] = [entry]
        if env.is_distributed:
            entries = [None] * env.world_size
            dist.all_gather_object(entries, entry)  # also: every rank's part is in place
        if not env.is_main:
            return 0
        total = sum(e["num_samples"] for e in entries)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "output": fmt,
            "task": cfg.task,
            "checkpoint": run.checkpoint,
            "weights": run.weights,
            **({"lora_base": run.lora_base} if run.lora_base else {}),
            "step": run.step,
            "data": redact_url(data_name) if data_name else run.data,
            "data_num_samples": run.loader.index.num_samples,
            "num_samples": total,
            **lost,
            "world_size": env.world_size,
            "parts": entries,
        }
        if fmt == "shards":
            shards = tuple(
                ShardInfo(e["url"], e["num_samples"], e["num_bytes"], e["sha256"])
                for e in entries
                if e["num_samples"]
            )
            if shards:
                write_atomic(
                    f"{dest}/{INDEX_NAME}",
                    index_to_bytes(ShardIndex(shards=shards)),
                    what="the predictions' index",
                )
        write_atomic(
            f"{dest}/{MANIFEST_NAME}",
            (json.dumps(manifest, indent=1) + "\n").encode(),
            what="the predictions' manifest",
        )
        # A line to read, not the manifest's JSON again: manifest.json holds all of it.
        print(
            f"predicted {total} samples of {manifest['data']} with {run.checkpoint} (step "
            f"{run.step}, {run.weights} weights) on {env.world_size} rank(s) -> "
            f"{redact_url(out).rstrip('/')}/{MANIFEST_NAME} ({fmt}, {len(entries)} part(s))",
            flush=True,
        )
        if any(lost.values()):
            log.warning(
                "prediction lost data under data.on_error=skip: %s (not in the predictions)",
                ", ".join(f"{k} {v}" for k, v in lost.items() if v),
            )
        return 0


@torch.no_grad()
def predict_part(run: Any, predict: Any, writer: PartWriter) -> dict[str, Any]:
    """This rank's batches through `predict`; valid samples into `writer`, then committed."""
    run.model.eval()
    run.loader.set_epoch(0)
    ticker = Ticker(f"prediction with {run.checkpoint}", len(run.loader), enabled=run.env.is_main)
    if run.env.is_main:
        log.info("%s: %d batches per rank", ticker.label, len(run.loader))
    for batch in run.loader:
        ticker.update()
        keys = batch["key"]
        sources = batch.pop(SOURCE_FIELD, None) or [""] * len(keys)  # not the task's to see
        with run.precision.autocast():
            outputs = predict(run.model, to_device(batch, run.device))
        if not isinstance(outputs, list) or len(outputs) != len(keys):
            got = f"{len(outputs)} items" if isinstance(outputs, list) else type(outputs).__name__
            raise TypeError(
                f"{type(run.task).__name__}.predict returned {got} for a batch of {len(keys)} "
                "samples: it must return a list with one dict per sample, in batch order"
            )
        rows = zip(keys, sources, batch["valid"].tolist(), outputs, strict=True)
        for key, source, valid, sample_outputs in rows:
            if valid:  # padding and fillers for lost samples are copies: each sample once
                writer.add(key, sample_outputs, source)
    return writer.commit()
