"""The peer libraries' cases of `hpctrain bench loader`: LitData and MosaicML Streaming.

Each peer (the `bench` extra; skipped with a line saying so when not installed) gets the
setup's JPEGs converted once to its own format, outside the timing, in chunks of as many
bytes as hpctrain's largest shard, and reads them with its own loader: K persistent
workers, the same decoder, transform and batch size as the hpctrain cases; its second
epoch is measured, like hpctrain's persistent case.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from hpctrain.bench.loader_setup import PeerTransform, Setup, count_images, timed_epoch
from hpctrain.compat_torch import dataloader_worker_pids, shutdown_dataloader_workers
from hpctrain.errors import install_hint


def dataloader_steady(loader: DataLoader) -> tuple[int, float, float]:
    """Second epoch of a torch `DataLoader` (or subclass) with persistent workers, measured
    like `hpctrain_steady`: the process's CPU plus its live workers' from /proc."""
    count_images(loader)  # warm-up epoch: starts the workers
    count, wall, cpu = timed_epoch(loader, dataloader_worker_pids(loader))
    shutdown_dataloader_workers(loader)  # now, so that no later case counts their exit
    return count, wall, cpu


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
    loader = setup.dataloader(dataset, StreamingDataLoader, persistent_workers=setup.workers > 0)
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
    loader = setup.dataloader(dataset, StreamingDataLoader, persistent_workers=setup.workers > 0)
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


def missing_peers() -> dict[str, str]:
    """Peer case name -> why it is skipped, for every peer whose library does not import."""
    skipped = {}
    for peer in PEERS:
        try:
            importlib.import_module(peer.module)
        except ImportError as exc:
            skipped[peer.name] = f"{peer.module} is not installed ({exc}); {install_hint('bench')}"
    return skipped


def convert_for_peer(setup: Setup, peer: Peer) -> Path:
    """The setup's images in `peer`'s own format (once, outside the timing), in chunks of as
    many bytes as our largest shard; returns the folder that `peer.read` reads."""
    out = setup.root / peer.folder
    peer.write(setup.images, out, max(shard.num_bytes for shard in setup.shard_index.shards))
    return out
