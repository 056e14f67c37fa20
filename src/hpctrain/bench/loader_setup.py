"""What every case of `hpctrain bench loader` reads: the images, their layouts, the transforms.

The same JPEGs (synthetic, or taken from shards) are written once per run as an image
folder, as USTAR shards and as segmentation shards (`img.jpg` + a palette-PNG `mask.png`);
every case decodes them with the decoder hpctrain's loader applies, and crops and flips them
with the same torchvision transform. `Setup` holds what the cases share; `timed_epoch` is
how the steady-state cases (persistent workers, second epoch) measure one epoch.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from hpctrain.bench.measure import process_cpu_seconds, self_cpu_seconds

if TYPE_CHECKING:  # the loader itself is imported when a case runs, not by `hpctrain --help`
    from hpctrain.config.schema import DataConfig
    from hpctrain.data.index import ShardIndex


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


class PeerTransform(_Sample):
    """A peer's stored sample {"jpg": bytes, "cls": int} -> (uint8 crop, label), with the
    decoder and transform that the hpctrain cases use."""

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        return self._transform()(decode_jpeg(sample["jpg"])), int(sample["cls"])


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

    def dataloader(
        self, dataset: Any, loader_class: type[DataLoader] = DataLoader, **kwargs: Any
    ) -> DataLoader:
        """`loader_class` (a torch `DataLoader`, or a peer's subclass) over `dataset` with
        the setup's batch size, K workers and their start method."""
        return loader_class(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.workers,
            multiprocessing_context=self.start_method,
            **kwargs,
        )


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


def timed_epoch(loader: Any, pids: list[int]) -> tuple[int, float, float]:
    """One epoch of `loader`: the images, wall seconds and CPU seconds of this process and of
    the live processes `pids` (from /proc: getrusage sees workers only once they exit)."""
    cpu0 = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    count = count_images(loader)
    wall = time.perf_counter() - t0
    cpu = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids) - cpu0
    return count, wall, cpu
