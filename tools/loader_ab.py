"""Paired A/B of the loader: this checkout against another git revision, in one process.

    .venv/bin/python tools/loader_ab.py REV [--workers K] [--epochs N] [--images N] [--no-decode]

The other revision's `src/hpctrain` is exported to a temporary folder as package
`hpctrain_ab`; both loaders read the same shards with persistent workers, epoch by epoch in
alternating order, with the limit's loop (decode + transform in this process) between them.
Prints the medians and the per-epoch ratios of images per CPU-second (training process +
workers, from /proc), which a shared machine's drift affects far less than two separate runs.

`--no-decode`: both loaders' default decoding is replaced by a stub that returns one fixed
224x224 image (and no transform runs), so what is measured is the loader's own cost per image:
reading, tar parsing, shuffling, per-sample seeding, batching, transport.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export(rev: str, dest: Path) -> None:
    """`rev`'s src/hpctrain as dest/hpctrain_ab, its imports renamed."""
    archive = dest / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "src/hpctrain"], stdout=f, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    package = dest / "hpctrain_ab"
    (dest / "src" / "hpctrain").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\bhpctrain(?=[. ]|$)", "hpctrain_ab", text, flags=re.M))


class EitherTransform:
    """The bench's crop + flip over a sample of either revision: `jpg`/`cls` fields (the
    general sample of issue #12) or the older `image`/`label`; the key is kept for the older
    loader, which reads it from the transformed sample."""

    def __init__(self, crop: int) -> None:
        from hpctrain.bench import loader_setup as bench

        self.inner = bench.HpctrainTransform(crop)

    def __call__(self, sample: dict) -> dict:
        if "jpg" not in sample:
            sample = {"jpg": sample["image"], "cls": sample["label"], "key": sample["key"]}
        return {**self.inner(sample), "key": sample["key"]}


def stub_decoders(data_b: object) -> None:
    """Replace both revisions' default decoding by one fixed 224x224 image (workers fork,
    so they inherit the stubs)."""
    import torch

    import hpctrain.data.samples as samples

    image = torch.zeros(3, 224, 224, dtype=torch.uint8)

    def new(key: str, members: dict, **kw: object) -> dict:
        return {"key": key, "image": image, "label": 0}

    def old(key: str, members: dict) -> dict:
        return {"image": image, "label": 0, "key": key, "meta": {}}

    samples.decode_sample = new  # type: ignore[assignment]
    try:  # the general sample path: decoding is called from data/samples.py
        importlib.import_module(f"{data_b.__name__}.samples").decode_sample = new
    except ModuleNotFoundError:  # before it: data/loader.py, with the older sample dict
        importlib.import_module(f"{data_b.__name__}.loader").decode_sample = old


def children() -> list[int]:
    """This process's live children: the loaders' workers (pids from /proc)."""
    me, pids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rev", help="the git revision to compare this checkout with")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--images", type=int, default=960)
    parser.add_argument("--no-decode", action="store_true", help="measure the loader's own cost")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="hpctrain-ab-"))
    export(args.rev, tmp)
    sys.path.insert(0, str(tmp))
    import hpctrain_ab.config.schema as schema_b  # type: ignore[import-not-found]
    import hpctrain_ab.data as data_b  # type: ignore[import-not-found]

    from hpctrain.bench import loader_setup as bench
    from hpctrain.bench.measure import process_cpu_seconds, self_cpu_seconds
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index
    from hpctrain.data.decode import decode_image

    images = bench.synthetic_images(args.images, tmp)
    bench.write_layouts(images, tmp)
    shards = str(tmp / "shards")
    kw = dict(batch_size=32, workers_per_rank=args.workers, shuffle_buffer=0)
    transform = None if args.no_decode else EitherTransform(224)
    if args.no_decode:
        stub_decoders(data_b)
    loaders = {
        "this checkout": ShardedLoader(
            open_index(shards), DataConfig(**kw), rank=0, world_size=1, seed=0, transform=transform
        ),
        args.rev: data_b.ShardedLoader(
            data_b.open_index(shards),
            schema_b.DataConfig(**kw),
            rank=0,
            world_size=1,
            seed=0,
            transform=transform,
        ),
    }
    for loader in loaders.values():
        bench.count_images(loader)  # starts the persistent workers

    workers = children()  # persistent: the same processes in every epoch

    def cpu_seconds() -> float:
        return self_cpu_seconds() + sum(process_cpu_seconds(p) for p in workers)

    def epoch(loader: object, number: int) -> tuple[float, float]:
        loader.set_epoch(number)  # type: ignore[attr-defined]
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        n = bench.count_images(loader)
        return n / (cpu_seconds() - cpu0), n / (time.perf_counter() - t0)

    def limit() -> float:
        if transform is None:
            return float("inf")
        cpu0 = self_cpu_seconds()
        for data, label in images:
            transform({"jpg": decode_image(data), "cls": label, "key": ""})
        return len(images) / (self_cpu_seconds() - cpu0)

    names = list(loaders)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    limits = []
    for number in range(1, args.epochs + 1):
        limits.append(limit())
        for name in names if number % 2 else names[::-1]:
            results[name].append(epoch(loaders[name], number))
    for loader in loaders.values():
        loader.close()  # type: ignore[attr-defined]

    lim = statistics.median(limits)
    if args.no_decode:
        for name in names:
            cpu = statistics.median(r[0] for r in results[name])
            print(f"{name:>20}: {1e6 / cpu:.1f} us of CPU per image (decoding stubbed)")
    print(
        f"{args.images} images, {args.workers} workers, {args.epochs} epochs; limit {lim:.0f} img/CPU-s"
    )
    for name in names:
        cpu = statistics.median(r[0] for r in results[name])
        wall = statistics.median(r[1] for r in results[name])
        print(f"{name:>20}: {cpu:.0f} img/CPU-s ({cpu / lim:.3f} x limit), {wall:.0f} img/s")
    paired = [a[0] / b[0] for a, b in zip(*results.values(), strict=True)]
    print(
        f"this checkout / {args.rev}, images per CPU-s, paired by epoch: median "
        f"{statistics.median(paired):.3f} (range {min(paired):.3f}-{max(paired):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
