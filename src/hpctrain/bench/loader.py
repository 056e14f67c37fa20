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

What the cases read (images, layouts, transforms, `Setup`) is in `loader_setup`; the peer
libraries' cases are in `loader_peers`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from hpctrain.bench.loader_peers import PEERS, Peer, convert_for_peer, missing_peers
from hpctrain.bench.loader_setup import (
    HpctrainTransform,
    PilTransform,
    SegmentationTransform,
    Setup,
    count_images,
    decode_jpeg,
    images_from_shards,
    prepare,
    synthetic_images,
    timed_epoch,
)
from hpctrain.bench.measure import cpu_seconds, process_cpu_seconds
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
    count, wall, cpu = timed_epoch(loader, pids)
    loader.close()  # join the workers now, so that no later case counts their exit
    return count, wall, cpu


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
