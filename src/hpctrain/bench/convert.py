"""`hpctrain bench convert`: shard writers side by side, interleaved, on one generated source.

Measures images/s (wall clock, median over interleaved rounds, so load from other tenants hits
every writer alike) for:

- copy bytes: a plain `tarfile` writer (baseline), `webdataset.ShardWriter`, and
  `hpctrain convert --workers 1` and `--workers 2`;
- re-encode (`--max-side`, CPU-bound): `hpctrain convert --workers 1` and `--workers 2`;
- read cost: CPU seconds of a raw read pass (webdataset's tar iterator, what loaders run)
  over our shards vs over ShardWriter's shards.

Every writer writes the same members (`<key>.jpg`, `<key>.cls`) in shards of the same count.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpctrain.bench.measure import cpu_seconds

HELP = "images/s of tarfile, webdataset.ShardWriter and hpctrain convert; read cost of their shards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-images", type=int, default=4000, help="source images (default 4000)")
    parser.add_argument(
        "--size", type=int, default=128, help="source image side in px (default 128)"
    )
    parser.add_argument(
        "--max-side", type=int, default=64, help="--max-side of the re-encode runs (default 64)"
    )
    parser.add_argument(
        "--samples-per-shard", type=int, default=250, help="shard size in samples (default 250)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds; medians are reported (default 5)"
    )
    parser.add_argument(
        "--workdir", help="where to write (default: a temporary folder, removed afterwards)"
    )


def make_source(root: Path, num_images: int, size: int) -> tuple[list[Path], list[int]]:
    """An image folder of smooth random JPEGs (photo-like sizes), 10 classes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(num_images):
        label = i % 10
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        small = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC)
        noisy = np.clip(
            np.asarray(image).astype(np.int16) + rng.normal(0, 6, (size, size, 3)), 0, 255
        )
        path = folder / f"{i:06d}.jpg"
        Image.fromarray(noisy.astype(np.uint8)).save(path, quality=90)
        paths.append(path)
        labels.append(label)
    return paths, labels


def write_tarfile(paths: list[Path], labels: list[int], out: Path, per_shard: int) -> None:
    """Baseline: the obvious `tarfile` loop, USTAR members."""
    out.mkdir(parents=True)
    for start in range(0, len(paths), per_shard):
        with tarfile.open(
            out / f"shard-{start // per_shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT
        ) as tar:
            for i in range(start, min(start + per_shard, len(paths))):
                key = f"{i:09d}"
                for name, data in (
                    (f"{key}.jpg", paths[i].read_bytes()),
                    (f"{key}.cls", str(labels[i]).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def write_shardwriter(paths: list[Path], labels: list[int], out: Path, per_shard: int) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, path in enumerate(paths):
            sink.write({"__key__": f"{i:09d}", "jpg": path.read_bytes(), "cls": labels[i]})


def write_ours(
    src: Path, out: Path, per_shard: int, workers: int, max_side: int | None = None
) -> None:
    from hpctrain.convert.options import ConvertOptions
    from hpctrain.convert.run import convert

    convert(
        ConvertOptions(
            src=str(src),
            dest=str(out),
            samples_per_shard=per_shard,
            workers=workers,
            max_side=max_side,
            progress="none",
        )
    )


def read_pass_cpu(folder: Path) -> float:
    """CPU seconds of one raw read pass over every shard in `folder` (webdataset's tar iterator)."""
    from webdataset.tariterators import tar_file_iterator

    start = time.process_time()
    for shard in sorted(folder.glob("*.tar")):
        with open(shard, "rb") as f:
            for _ in tar_file_iterator(f):
                pass
    return time.process_time() - start


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `fn()`."""
    start, start_cpu = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - start, cpu_seconds() - start_cpu


def _webdataset_service(conn: Connection) -> None:
    """Runs in its own process: ShardWriter writes and read passes, timed there.

    webdataset imports torch; keeping it out of the main process keeps the main process as
    light as `hpctrain convert` is (forking pool workers from a process that mapped torch
    costs measurably more).
    """
    import webdataset  # noqa: F401

    while (request := conn.recv()) is not None:
        kind, payload = request
        if kind == "write":
            conn.send(_timed(lambda: write_shardwriter(*payload)))  # noqa: B023
        else:
            conn.send(read_pass_cpu(payload))


def run(args: argparse.Namespace) -> int:
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    service = context.Process(target=_webdataset_service, args=(child_conn,), daemon=True)
    service.start()

    def via_service(kind: str, payload: object) -> Any:
        conn.send((kind, payload))
        return conn.recv()

    work = (
        Path(args.workdir)
        if args.workdir
        else Path(tempfile.mkdtemp(prefix="hpctrain-bench-convert-"))
    )
    try:
        src = work / "source"
        shutil.rmtree(src, ignore_errors=True)
        paths, labels = make_source(src, args.num_images, args.size)
        num_bytes = sum(p.stat().st_size for p in paths)
        per_shard = args.samples_per_shard
        copy_writers: dict[str, Callable[[Path], Any]] = {
            "tarfile": lambda out: write_tarfile(paths, labels, out, per_shard),
            "webdataset.ShardWriter": lambda out: via_service(
                "write", (paths, labels, out, per_shard)
            ),
            "hpctrain --workers 1": lambda out: write_ours(src, out, per_shard, 1),
            "hpctrain --workers 2": lambda out: write_ours(src, out, per_shard, 2),
        }
        encode_writers: dict[str, Callable[[Path], None]] = {
            "hpctrain --workers 1": lambda out: write_ours(src, out, per_shard, 1, args.max_side),
            "hpctrain --workers 2": lambda out: write_ours(src, out, per_shard, 2, args.max_side),
        }
        copy_times: dict[str, list[tuple[float, float]]] = {name: [] for name in copy_writers}
        encode_times: dict[str, list[tuple[float, float]]] = {name: [] for name in encode_writers}
        read_cpu: dict[str, list[float]] = {"webdataset.ShardWriter": [], "hpctrain": []}
        for writer in (
            *copy_writers.values(),
            *encode_writers.values(),
        ):  # warm-up: caches, imports
            writer(work / "warmup")
            shutil.rmtree(work / "warmup")
        for round_index in range(args.rounds):
            # Rotate the starting writer each round so no writer always runs first or last.
            names = list(copy_writers)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in names:
                out = work / f"out-{len(copy_times[name])}-{name.replace(' ', '_')}"
                if name == "webdataset.ShardWriter":  # timed in the service process
                    copy_times[name].append(copy_writers[name](out))
                    read_cpu[name].append(via_service("read", out))
                else:
                    copy_times[name].append(_timed(lambda: copy_writers[name](out)))  # noqa: B023
                if name == "hpctrain --workers 1":
                    read_cpu["hpctrain"].append(via_service("read", out))
                shutil.rmtree(out)
            for name in reversed(list(encode_writers)) if round_index % 2 else encode_writers:
                out = work / f"enc-{name.replace(' ', '_')}"
                encode_times[name].append(_timed(lambda: encode_writers[name](out)))  # noqa: B023
                shutil.rmtree(out)
        print(report(args, num_bytes, copy_times, encode_times, read_cpu))
    finally:
        conn.send(None)
        service.join(timeout=30)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(
    args: argparse.Namespace,
    num_bytes: int,
    copy_times: dict[str, list[tuple[float, float]]],
    encode_times: dict[str, list[tuple[float, float]]],
    read_cpu: dict[str, list[float]],
) -> str:
    n = args.num_images
    lines = [
        f"hpctrain bench convert: {n} JPEGs ({args.size} px, {num_bytes / n / 1e3:.1f} kB avg), "
        f"{args.samples_per_shard} per shard, {args.rounds} interleaved rounds, medians; "
        f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}",
    ]

    def table(title: str, times: dict[str, list[tuple[float, float]]], base_name: str) -> None:
        lines.append(
            f"{title}: images per wall second and that / {base_name}'s; images per CPU second "
            f"and that / {base_name}'s (above 1: better than {base_name}):"
        )
        base_wall = statistics.median(t[0] for t in times[base_name])
        base_cpu = statistics.median(t[1] for t in times[base_name])
        for name, pairs in times.items():
            wall = statistics.median(t[0] for t in pairs)
            cpu = statistics.median(t[1] for t in pairs)
            lines.append(
                f"  {name:<24} {n / wall:>8.0f} img/s {base_wall / wall:5.2f}x {base_name}"
                f"  {n / cpu:>8.0f} img/CPU-s {base_cpu / cpu:5.2f}x {base_name}"
            )

    table("copy bytes", copy_times, "tarfile")
    table(f"re-encode --max-side {args.max_side}", encode_times, "hpctrain --workers 1")
    theirs = statistics.median(read_cpu["webdataset.ShardWriter"])
    ours = statistics.median(read_cpu["hpctrain"])
    lines.append("read cost: CPU seconds of a raw webdataset tar-iterator pass over the shards of")
    lines.append(f"  {'webdataset.ShardWriter':<24} {theirs:9.3f} s")
    lines.append(
        f"  {'hpctrain':<24} {ours:9.3f} s  {ours / theirs:5.2f}x webdataset.ShardWriter's"
        " (below 1: cheaper to read)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
