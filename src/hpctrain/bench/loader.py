"""`hpctrain bench loader`: hpctrain's loader against the decode limit and its peers.

Cases, interleaved round by round on the same images (rotating order), medians reported:

1. limit: decode + the transform in a tight loop, one process, one thread; beside it, the
   same loop in K processes at once (what K processes sharing the machine can reach);
2. ImageFolder + DataLoader (K workers, default collate, uint8 batches);
3. plain webdataset `WebDataset(urls).decode("pil")` + DataLoader (what a stock user writes);
4. hpctrain's `ShardedLoader` (workers started for the epoch, and persistent workers);
5. LitData and MosaicML Streaming (the `bench` extra; skipped with a line saying so when not
   installed): the same JPEGs converted once to each one's own format (outside the timing),
   read by each one's loader with K persistent workers, the same decoder, transform and batch
   size; their second epoch is measured, like hpctrain's persistent case;
6. segmentation: the same images with a palette-PNG mask each (`img.jpg` + `mask.png`),
   decoded both and cropped + flipped together (`tv_tensors`), batched as image and mask:
   hpctrain's loader (persistent workers, 2nd epoch) against this case's own limit, the
   decoding of both and the paired transform in one loop;
and with `--remote`, over an HTTP server on loopback adding `--latency-ms` to every request:
7. hpctrain's loader streaming the shards (and the same without the added latency);
8. per-file reads of the image folder (one request per image: the small-files problem).

Figures: wall images/s and images per CPU-second (main process + workers, from getrusage; in
the remote cases the loopback server's too: it runs in a process of its own, from /proc).
CPU efficiency is stable on a shared machine, wall time is not.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import resource
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset

from hpctrain.bench.measure import cpu_seconds, process_cpu_seconds, self_cpu_seconds
from hpctrain.errors import UsageError

if TYPE_CHECKING:  # the loader itself is imported when a case runs, not by `hpctrain --help`
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader
    from hpctrain.data.index import ShardIndex

Transform = Callable[[dict[str, Any]], dict[str, Any]]
HELP = (
    "loader throughput: decode limit vs ImageFolder, webdataset, LitData, Streaming and "
    "hpctrain; segmentation batches vs their limit (images/CPU-s)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "data",
        nargs="?",
        default="",
        help="shards (index.json, folder or pattern); empty: synthetic JPEGs (--images)",
    )
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--images", type=int, default=800, help="images per case per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--crop", type=int, default=224, help="RandomResizedCrop size")
    parser.add_argument("--remote", action="store_true", help="add the loopback HTTP cases")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added per HTTP request")
    parser.add_argument(
        "--cases",
        default=",".join(CASE_GROUPS),
        help=f"comma-separated groups of cases to run (default: all of {','.join(CASE_GROUPS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def synthetic_images(n: int, root: Path | None = None) -> list[tuple[bytes, int]]:
    """`n` 400x300 JPEGs (a gradient under noise, quality 90) with labels 0-9, in memory
    (`root` is unused; kept for tools/loader_ab.py)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    base = np.linspace(0, 255, 400, dtype=np.float32)[None, :, None]
    for i in range(n):
        noise = rng.normal(0, 20, (300, 400, 3)).astype(np.float32)
        pixels = np.clip(base + noise + (i * 37) % 100, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append((buf.getvalue(), i % 10))
    return out


def images_from_shards(spec: str, n: int) -> list[tuple[bytes, int]]:
    from hpctrain.data import open_index
    from hpctrain.data.stream import open_shard
    from hpctrain.data.tar import iter_samples

    index = open_index(spec)
    out: list[tuple[bytes, int]] = []
    for i in range(len(index.shards)):
        with open_shard(index.shard_url(i)) as f:
            for _idx, _key, members in iter_samples(f):
                image = members.get("jpg") or members.get("jpeg") or members.get("png")
                if image is not None:
                    out.append((image, int(members.get("cls", b"0").strip() or 0)))
                if len(out) >= n:
                    return out
    return out


def write_layouts(images: list[tuple[bytes, int]], root: Path, per_shard: int = 100) -> None:
    """The same images as an ImageFolder (root/folder/<cls>/<i>.jpg) and as USTAR shards."""
    for i, (data, label) in enumerate(images):
        d = root / "folder" / f"c{label:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(data)
    samples = [{"jpg": data, "cls": str(label).encode()} for data, label in images]
    write_shards(samples, root / "shards", per_shard)


def write_shards(samples: list[dict[str, bytes]], shard_dir: Path, per_shard: int = 100) -> None:
    """Samples (field name -> bytes) as USTAR shards `KEY.FIELD` + index.json in `shard_dir`."""
    from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes

    shard_dir.mkdir()
    infos = []
    for s, lo in enumerate(range(0, len(samples), per_shard)):
        name = f"bench-{s:06d}.tar"
        with tarfile.open(shard_dir / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(lo, min(lo + per_shard, len(samples))):
                for field, payload in samples[i].items():
                    info = tarfile.TarInfo(f"{i:06d}.{field}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        size = (shard_dir / name).stat().st_size
        infos.append(
            ShardInfo(url=name, num_samples=min(per_shard, len(samples) - lo), num_bytes=size)
        )
    (shard_dir / "index.json").write_bytes(index_to_bytes(ShardIndex(shards=tuple(infos))))


def segmentation_samples(images: list[tuple[bytes, int]]) -> list[dict[str, bytes]]:
    """The images beside a palette-PNG mask each (`img.jpg` + `mask.png`, the WebDataset
    names of a segmentation sample): blocks of 21 classes (Pascal VOC's count) shifted per
    image (under a kB each as PNG)."""
    import numpy as np
    from PIL import Image

    out = []
    for i, (data, _label) in enumerate(images):
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
        rows = np.arange(height)[:, None] // 37
        cols = np.arange(width)[None, :] // 53
        mask = Image.fromarray(((rows + cols + i) % 21).astype(np.uint8))
        # an L image given a palette becomes a P image whose indices are these class ids
        mask.putpalette([(c * 12) % 256 for c in range(21 * 3)])
        buf = io.BytesIO()
        mask.save(buf, format="PNG")
        out.append({"img.jpg": data, "mask.png": buf.getvalue()})
    return out


def decode_jpeg(data: bytes | memoryview) -> Any:
    """The decoder of every case: the one hpctrain's loader applies to a `jpg` field."""
    from hpctrain.data.decode import decode_field

    return decode_field("jpg", data)


def _tensor_transform(crop: int) -> Callable[..., Any]:
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])


class _Sample:  # picklable transform wrappers (DataLoader workers may be spawned)
    def __init__(self, crop: int) -> None:
        self.crop = crop
        self.t: Callable[..., Any] | None = None

    def _transform(self) -> Callable[..., Any]:
        if self.t is None:
            self.t = _tensor_transform(self.crop)
        return self.t


class HpctrainTransform(_Sample):
    """A decoded sample (`jpg`, `cls` fields) -> {"image": cropped and flipped, "label"},
    as the image_classification task's transform returns it."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {"image": self._transform()(sample["jpg"]), "label": sample["cls"]}


class SegmentationTransform(_Sample):
    """One RandomResizedCrop + flip for an image and its mask alike (`tv_tensors`: the mask
    is resized with nearest neighbours, class ids stay class ids)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        import torch
        from torchvision import tv_tensors

        image, mask = self._transform()(
            tv_tensors.Image(sample["img.jpg"]), tv_tensors.Mask(sample["mask.png"])
        )
        # plain tensors again: the batch holds tensors, not the transforms' subclasses
        return {
            "key": sample["key"],
            "image": image.as_subclass(torch.Tensor),
            "mask": mask.as_subclass(torch.Tensor),
        }


class PilTransform(_Sample):
    """PIL image -> uint8 tensor -> crop + flip (tensor-first, the faster order here)."""

    def __call__(self, image: Any) -> Any:
        from torchvision.transforms.v2 import functional as F

        return self._transform()(F.pil_to_tensor(image.convert("RGB")))


class _HttpFiles(Dataset):
    """Map-style dataset reading each image with its own HTTP request (fsspec)."""

    def __init__(self, urls: list[str], labels: list[int], crop: int) -> None:
        self.urls, self.labels, self.t = urls, labels, HpctrainTransform(crop)

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import fsspec

        data = fsspec.filesystem("http").cat_file(self.urls[i])
        return self.t({"jpg": decode_jpeg(data), "cls": self.labels[i]})["image"], self.labels[i]


def count_images(loader: Any) -> int:
    """Images in every batch `loader` yields (dict batches or (images, labels) tuples)."""
    n = 0
    for batch in loader:
        images = batch["image"] if isinstance(batch, dict) else batch[0]
        n += len(images)
    return n


@dataclass(frozen=True)
class Setup:
    """What every case reads: the same images (as an image folder and as shards under `root`)
    and the settings they share."""

    root: Path
    images: list[tuple[bytes, int]]  # whole batches: every case reads all
    segmentation: list[dict[str, bytes]]  # the same images with a mask each (`img.jpg`, `mask.png`)
    segmentation_index: ShardIndex
    batch_size: int
    workers: int
    crop: int
    shard_index: ShardIndex
    data: DataConfig
    start_method: str | None  # the DataLoader cases' multiprocessing context

    @property
    def num_images(self) -> int:
        return len(self.images)

    def dataloader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.workers,
            multiprocessing_context=self.start_method,
            **kwargs,
        )


@dataclass(frozen=True)
class Remote:
    """The loopback HTTP servers of the `--remote` cases and what they serve."""

    index: ShardIndex  # with the added latency
    fast_index: ShardIndex  # without it
    file_urls: list[str]
    labels: list[int]
    pids: list[int]  # the servers' processes, whose CPU counts with the case they serve


# The cases. Each returns the images it read, or (images, wall s, CPU s) when it measures itself.


def limit(setup: Setup) -> int:
    """Decode + the transform in a tight loop, in this process."""
    transform = HpctrainTransform(setup.crop)
    for data, label in setup.images:
        transform({"jpg": decode_jpeg(data), "cls": label})
    return setup.num_images


def segmentation_limit(setup: Setup) -> int:
    """Decode image and mask + the paired transform in a tight loop, in this process: the
    segmentation case's own limit (same decoders as the loader's workers)."""
    from hpctrain.data.decode import decode_sample

    transform = SegmentationTransform(setup.crop)
    for i, members in enumerate(setup.segmentation):
        transform(decode_sample(f"{i:06d}", members))
    return len(setup.segmentation)


def limit_side_by_side(setup: Setup) -> tuple[int, float, float]:
    """The limit's loop in K forked processes at once: what K processes sharing this
    machine's caches and memory bandwidth can reach, before any loader cost."""
    kids = max(setup.workers, 1)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    pids = []
    for _ in range(kids):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                limit(setup)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    if any(os.waitpid(pid, 0)[1] for pid in pids):
        raise RuntimeError("a side-by-side limit process failed")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    return setup.num_images * kids, wall, cpu


def image_folder(setup: Setup) -> int:
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(setup.root / "folder"), transform=PilTransform(setup.crop))
    return count_images(setup.dataloader(dataset, shuffle=False))


def webdataset(setup: Setup) -> int:
    import webdataset as wds

    index = setup.shard_index
    urls = [index.shard_url(i) for i in range(len(index.shards))]
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(PilTransform(setup.crop), lambda x: x)
    )
    return count_images(setup.dataloader(dataset))


def _sharded_loader(
    setup: Setup, index: ShardIndex, data: DataConfig, transform: Transform | None = None
) -> ShardedLoader:
    """hpctrain's loader over `index`; default transform: the classification one."""
    from hpctrain.data import ShardedLoader

    if transform is None:
        transform = HpctrainTransform(setup.crop)
    return ShardedLoader(index, data, rank=0, world_size=1, seed=0, transform=transform)


def hpctrain_loader(setup: Setup, index: ShardIndex) -> int:
    """One epoch of `ShardedLoader` over `index` (local shards, or over HTTP)."""
    return count_images(_sharded_loader(setup, index, setup.data))


def hpctrain_steady(
    setup: Setup, index: ShardIndex | None = None, transform: Transform | None = None
) -> tuple[int, float, float]:
    """Second epoch with persistent workers: no fork or start-up in the figures.

    Workers' CPU comes from /proc (getrusage sees workers only once they exit).
    Default: the classification shards and transform."""
    index = setup.shard_index if index is None else index
    loader = _sharded_loader(setup, index, replace(setup.data, persistent_workers=True), transform)
    count_images(loader)  # warm-up epoch: starts the workers
    pids = loader.worker_pids
    loader.set_epoch(1)
    cpu0 = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    count = count_images(loader)
    wall = time.perf_counter() - t0
    cpu = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids) - cpu0
    loader.close()  # join the workers now, so that no later case counts their exit
    return count, wall, cpu


def dataloader_steady(loader: DataLoader) -> tuple[int, float, float]:
    """Second epoch of a torch `DataLoader` (or subclass) with persistent workers, measured
    like `hpctrain_steady`: the process's CPU plus its live workers' from /proc."""
    count_images(loader)  # warm-up epoch: starts the workers
    # torch keeps the persistent workers' iterator here (no public handle on the processes)
    iterator = loader._iterator
    pids = [w.pid for w in iterator._workers] if iterator is not None else []  # type: ignore[attr-defined]
    cpu0 = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    count = count_images(loader)
    wall = time.perf_counter() - t0
    cpu = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids) - cpu0
    if iterator is not None:  # join the workers now, so that no later case counts their exit
        iterator._shutdown_workers()  # type: ignore[attr-defined]
    return count, wall, cpu


class PeerTransform(_Sample):
    """A peer's stored sample {"jpg": bytes, "cls": int} -> (uint8 crop, label), with the
    decoder and transform that the hpctrain cases use."""

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        return self._transform()(decode_jpeg(sample["jpg"])), int(sample["cls"])


def write_litdata(images: list[tuple[bytes, int]], out: Path, chunk_bytes: int) -> None:
    """The images as LitData chunks (its `optimize` format, written in this process)."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_bytes=chunk_bytes)
    for i, (data, label) in enumerate(images):
        writer.add_item(i, {"jpg": data, "cls": label})
    writer.done()
    writer.merge()


def litdata_steady(setup: Setup, path: Path) -> tuple[int, float, float]:
    """LitData's `StreamingDataset` + `StreamingDataLoader` (its recommended pair), K
    persistent workers, second epoch."""
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(str(path), transform=PeerTransform(setup.crop))
    loader = StreamingDataLoader(
        dataset,
        batch_size=setup.batch_size,
        num_workers=setup.workers,
        persistent_workers=setup.workers > 0,
        multiprocessing_context=setup.start_method,
    )
    return dataloader_steady(loader)


def write_mds(images: list[tuple[bytes, int]], out: Path, chunk_bytes: int) -> None:
    """The images as MosaicML Streaming MDS shards."""
    from streaming import MDSWriter

    with MDSWriter(
        out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit=chunk_bytes
    ) as w:
        for data, label in images:
            w.write({"jpg": data, "cls": label})


def streaming_steady(setup: Setup, path: Path) -> tuple[int, float, float]:
    """MosaicML Streaming's `StreamingDataset` (subclassed to decode in `__getitem__`, as its
    documentation does) + its `StreamingDataLoader`, K persistent workers, second epoch."""
    from streaming import StreamingDataLoader, StreamingDataset

    transform = PeerTransform(setup.crop)

    # defined here so that importing this module does not import streaming; the workers are
    # forked (`worker_start_method`), so the class need not be importable by name
    class Decoded(StreamingDataset):
        def __getitem__(self, index: int) -> tuple[Any, int]:
            return transform(super().__getitem__(index))

    dataset = Decoded(local=str(path), remote=None, shuffle=False, batch_size=setup.batch_size)
    loader = StreamingDataLoader(
        dataset,
        batch_size=setup.batch_size,
        num_workers=setup.workers,
        persistent_workers=setup.workers > 0,
        multiprocessing_context=setup.start_method,
    )
    try:
        return dataloader_steady(loader)
    finally:
        # Streaming leaves its lock files in the system's temporary folder, two per dataset
        for lock in (dataset._shared_barrier.filelock_path, dataset._cache_filelock_path):
            Path(lock).unlink(missing_ok=True)


@dataclass(frozen=True)
class Peer:
    """A peer library's case: the module that must import, how to convert, how to read."""

    name: str
    module: str
    folder: str  # under the setup's root
    write: Callable[[list[tuple[bytes, int]], Path, int], None]
    read: Callable[[Setup, Path], tuple[int, float, float]]


LITDATA = "LitData, persistent workers, 2nd epoch"
STREAMING = "MosaicML Streaming, persistent workers, 2nd epoch"
PEERS = (
    Peer(LITDATA, "litdata", "litdata", write_litdata, litdata_steady),
    Peer(STREAMING, "streaming", "mds", write_mds, streaming_steady),
)
BENCH_EXTRA = "pip install 'hpctrain[bench]'"


def missing_peers() -> dict[str, str]:
    """Peer case name -> why it is skipped, for every peer whose library does not import."""
    skipped = {}
    for peer in PEERS:
        try:
            importlib.import_module(peer.module)
        except ImportError as exc:
            skipped[peer.name] = f"{peer.module} is not installed ({exc}); {BENCH_EXTRA}"
    return skipped


def per_file_http(setup: Setup, remote: Remote) -> int:
    """One HTTP request per image of the folder: the small-files problem."""
    dataset = _HttpFiles(remote.file_urls, remote.labels, setup.crop)
    return count_images(setup.dataloader(dataset))


LIMIT = "limit (decode+transform, 1 thread)"
IMAGE_FOLDER = "ImageFolder + DataLoader"
WEBDATASET = "webdataset + DataLoader"
HPCTRAIN = "hpctrain ShardedLoader"
STEADY = "hpctrain, persistent workers, 2nd epoch"
HTTP_NO_DELAY = "hpctrain over HTTP (no added latency)"
SEGMENTATION_LIMIT = "segmentation limit (decode image+mask+transform)"
SEGMENTATION = "hpctrain segmentation, persistent, 2nd epoch"


def side_by_side_name(workers: int) -> str:
    return f"limit x{max(workers, 1)}, forked, side by side"


def http_names(latency_ms: float) -> tuple[str, str]:
    """Names of the cases with added latency: hpctrain over HTTP, per-file HTTP reads."""
    return (
        f"hpctrain over HTTP (+{latency_ms:g} ms/request)",
        f"per-file HTTP reads (+{latency_ms:g} ms/request)",
    )


# `--cases`: the groups of cases a run may choose (the remote cases come with `--remote`)
CASE_GROUPS = ("limit", "imagefolder", "webdataset", "hpctrain", "peers", "segmentation")


def make_cases(
    setup: Setup,
    remote: Remote | None,
    latency_ms: float,
    peers: tuple[Peer, ...] = (),
    groups: tuple[str, ...] = CASE_GROUPS,
) -> dict[str, Callable[[], Any]]:
    """The cases of `groups` in their first round's order; `peers`: those installed and
    converted."""
    cases: dict[str, Callable[[], Any]] = {}
    if "limit" in groups:
        cases[LIMIT] = partial(limit, setup)
        cases[side_by_side_name(setup.workers)] = partial(limit_side_by_side, setup)
    if "imagefolder" in groups:
        cases[IMAGE_FOLDER] = partial(image_folder, setup)
    if "webdataset" in groups:
        cases[WEBDATASET] = partial(webdataset, setup)
    if "hpctrain" in groups:
        cases[HPCTRAIN] = partial(hpctrain_loader, setup, setup.shard_index)
        cases[STEADY] = partial(hpctrain_steady, setup)
    if "segmentation" in groups:
        cases[SEGMENTATION_LIMIT] = partial(segmentation_limit, setup)
        transform = SegmentationTransform(setup.crop)
        cases[SEGMENTATION] = partial(hpctrain_steady, setup, setup.segmentation_index, transform)
    if "peers" in groups:
        for peer in peers:
            cases[peer.name] = partial(peer.read, setup, setup.root / peer.folder)
    if remote is not None:
        # without the added latency: what HTTP itself costs here (the server shares this
        # machine's CPUs), apart from the latency to hide
        http, per_file = http_names(latency_ms)
        cases[HTTP_NO_DELAY] = partial(hpctrain_loader, setup, remote.fast_index)
        cases[http] = partial(hpctrain_loader, setup, remote.index)
        cases[per_file] = partial(per_file_http, setup, remote)
    return cases


def start_servers(root: Path, latency_ms: float, stack: ExitStack) -> Remote:
    """Two HTTP servers of `root` (with and without the added latency), closed with `stack`.

    Each server runs in a process of its own, as storage does: run inside this process, its
    threads and this process's forked workers slowed each other (~3x the server's CPU per
    image here). Its CPU is counted with the case it serves.
    """
    from hpctrain.bench.loopback import serve_http_process
    from hpctrain.data import open_index

    url, pid = stack.enter_context(serve_http_process(root, delay_s=latency_ms / 1000))
    fast_url, fast_pid = stack.enter_context(serve_http_process(root))
    files = sorted((root / "folder").rglob("*.jpg"))
    return Remote(
        index=open_index(f"{url}/shards/index.json"),
        fast_index=open_index(f"{fast_url}/shards/index.json"),
        file_urls=[f"{url}/{p.relative_to(root).as_posix()}" for p in files],
        labels=[int(p.parent.name[1:]) for p in files],
        pids=[pid, fast_pid],
    )


def measure(
    cases: dict[str, Callable[[], Any]], rounds: int, num_images: int, server_pids: list[int]
) -> dict[str, dict[str, list[float]]]:
    """Images per wall second and per CPU second of every case, round by round; the order
    rotates each round so that no case always runs first."""
    results: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in cases}
    names = list(cases)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            cpu0 = cpu_seconds() + sum(process_cpu_seconds(p) for p in server_pids)
            t0 = time.perf_counter()
            count = cases[name]()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds() + sum(process_cpu_seconds(p) for p in server_pids) - cpu0
            if isinstance(count, tuple):  # a case that measures itself
                count, wall, cpu = count
            if count % num_images and not name.startswith("limit"):
                print(f"warning: {name} gave {count} of {num_images} images", file=sys.stderr)
            results[name]["wall"].append(count / wall)
            results[name]["cpu"].append(count / cpu)
    return results


def summarize(results: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "images_per_s": statistics.median(v["wall"]),
            "images_per_cpu_s": statistics.median(v["cpu"]),
            "images_per_s_range": [min(v["wall"]), max(v["wall"])],
            "images_per_cpu_s_range": [min(v["cpu"]), max(v["cpu"])],
        }
        for name, v in results.items()
    }


def ratios(
    summary: dict[str, dict[str, Any]], workers: int, latency_ms: float | None
) -> dict[str, float]:
    """The comparisons the report prints, each where both its cases ran; `latency_ms` None:
    no remote cases."""
    out: dict[str, float] = {}

    def add(label: str, a: str, b: str, unit: str = "cpu", times: int = 1) -> None:
        """`label (unit)`: case a / (case b x `times`), in images per CPU-s or wall second."""
        if a in summary and b in summary:
            key, words = (
                ("images_per_cpu_s", "CPU-s") if unit == "cpu" else ("images_per_s", "wall second")
            )
            out[f"{label} (images per {words})"] = summary[a][key] / (summary[b][key] * times)

    k = workers
    side_by_side = side_by_side_name(k)
    add("hpctrain / limit", HPCTRAIN, LIMIT)
    add("hpctrain steady state / limit", STEADY, LIMIT)
    add(f"{side_by_side} / limit", side_by_side, LIMIT)
    add(f"hpctrain steady state / {side_by_side}", STEADY, side_by_side)
    add("hpctrain / ImageFolder", HPCTRAIN, IMAGE_FOLDER)
    add("hpctrain / webdataset", HPCTRAIN, WEBDATASET)
    add(f"hpctrain / (limit x {k})", HPCTRAIN, LIMIT, "wall", max(k, 1))
    add(f"hpctrain steady state / (limit x {k})", STEADY, LIMIT, "wall", max(k, 1))
    for peer in PEERS:  # side by side in the same state: persistent workers, second epoch
        short = peer.name.split(",")[0]
        add(f"hpctrain steady state / {short} steady state", STEADY, peer.name)
        add(f"{short} steady state / limit", peer.name, LIMIT)
    add(
        "hpctrain segmentation steady state / segmentation limit",
        SEGMENTATION,
        SEGMENTATION_LIMIT,
    )
    if latency_ms is not None:
        http, per_file = http_names(latency_ms)
        added = f"+{latency_ms:g} ms/request"
        add(f"hpctrain over HTTP ({added}) / hpctrain local", http, HPCTRAIN, "wall")
        add(f"hpctrain over HTTP, {added} / no added latency", http, HTTP_NO_DELAY, "wall")
        add(f"per-file HTTP reads / hpctrain over HTTP, both {added}", per_file, http, "wall")
    return out


def format_report(
    meta: dict[str, Any], summary: dict[str, dict[str, Any]], comparisons: dict[str, float]
) -> str:
    lines = [
        f"{meta['images']} images, {meta['workers']} workers, batch {meta['batch_size']}, "
        f"RandomResizedCrop({meta['crop']}) + flip, uint8 batches; medians of {meta['rounds']} "
        f"interleaved rounds; load average {meta['load_average']:.1f}",
        f"{'case':<52} {'images/s (range)':>18} {'images/CPU-s (range)':>22}",
    ]
    for name, v in summary.items():
        lo, hi = v["images_per_s_range"]
        clo, chi = v["images_per_cpu_s_range"]
        lines.append(
            f"{name:<52} {v['images_per_s']:>6.0f} ({lo:.0f}-{hi:.0f}) "
            f"{v['images_per_cpu_s']:>9.0f} ({clo:.0f}-{chi:.0f})"
        )
    lines += [f"{name}: skipped, {reason}" for name, reason in meta.get("skipped", {}).items()]
    lines += [f"{name}: {value:.2f}" for name, value in comparisons.items()]  # A / B (figure)
    return "\n".join(lines)


def prepare(
    root: Path, images: list[tuple[bytes, int]], *, batch_size: int, workers: int, crop: int
) -> Setup:
    """Whole batches of `images` written under `root` in every layout hpctrain's cases read
    (image folder, shards, segmentation shards), and the settings the cases share."""
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import open_index
    from hpctrain.data.transport import worker_start_method

    images = images[: max(len(images) // batch_size, 1) * batch_size]
    write_layouts(images, root)
    segmentation = segmentation_samples(images)
    write_shards(segmentation, root / "segmentation")
    return Setup(
        root=root,
        images=images,
        segmentation=segmentation,
        segmentation_index=open_index(str(root / "segmentation")),
        batch_size=batch_size,
        workers=workers,
        crop=crop,
        shard_index=open_index(str(root / "shards")),
        data=DataConfig(
            batch_size=batch_size,
            workers_per_rank=workers,
            shuffle_buffer=0,
            persistent_workers=False,
        ),
        start_method=worker_start_method() if workers else None,
    )


def convert_for_peer(setup: Setup, peer: Peer) -> Path:
    """The setup's images in `peer`'s own format (once, outside the timing), in chunks of as
    many bytes as our largest shard; returns the folder that `peer.read` reads."""
    out = setup.root / peer.folder
    peer.write(setup.images, out, max(shard.num_bytes for shard in setup.shard_index.shards))
    return out


def run(args: argparse.Namespace) -> int:
    groups = tuple(group.strip() for group in args.cases.split(",") if group.strip())
    unknown = sorted(set(groups) - set(CASE_GROUPS))
    if unknown or not groups:
        what = f"unknown group(s) {', '.join(unknown)}" if unknown else "no group given"
        raise UsageError(f"--cases {args.cases!r}: {what}; choose from {','.join(CASE_GROUPS)}")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as tmp, ExitStack() as servers:
        root = Path(tmp)
        if args.data:
            images = images_from_shards(args.data, args.images)
        else:
            images = synthetic_images(args.images)
        b, k = args.batch_size, args.workers
        setup = prepare(root, images, batch_size=b, workers=k, crop=args.crop)
        skipped = missing_peers() if "peers" in groups else {}
        peers = tuple(peer for peer in PEERS if peer.name not in skipped and "peers" in groups)
        for peer in peers:
            convert_for_peer(setup, peer)
        remote = start_servers(root, args.latency_ms, servers) if args.remote else None
        cases = make_cases(setup, remote, args.latency_ms, peers, groups)
        server_pids = remote.pids if remote is not None else []
        results = measure(cases, args.rounds, setup.num_images, server_pids)

    summary = summarize(results)
    comparisons = ratios(summary, k, args.latency_ms if args.remote else None)
    meta = {
        "images": setup.num_images,
        "workers": k,
        "batch_size": b,
        "rounds": args.rounds,
        "crop": args.crop,
        "load_average": os.getloadavg()[0],
        "skipped": skipped,
    }
    if args.json:
        print(json.dumps({"meta": meta, "cases": summary, "ratios": comparisons}, indent=1))
        for name, reason in skipped.items():  # the JSON on stdout stays parseable
            print(f"{name}: skipped, {reason}", file=sys.stderr)
    else:
        print(format_report(meta, summary, comparisons))
    return 0
