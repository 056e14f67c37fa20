"""Paired A/B: the loader over one source vs the same images as a 3-source mixture.

    PYTHONPATH=src .venv/bin/python tools/mixture_bench.py [--images 600] [--rounds 5]
        [--workers 2] [--no-decode]

The same JPEGs are written once as one index and once split 3:2:1 into three indexes mixed
with weights 3, 2, 1 (so the two read the same samples per epoch). Both loaders keep
persistent workers; after a warm-up epoch each, epochs alternate (order rotating by round).
Prints images per CPU-second (training process + workers, from /proc) per case, their
medians and the median of the per-round ratios mixture / one source: a ratio measured side by
side, which a shared machine's drift affects far less than two separate runs.

`--no-decode`: decoding is replaced by one fixed 224x224 image and no transform runs, so what
is measured is the loader's own cost per image (reading, parsing, the mixture's schedule and
interleaving, batching, transport), where a mixture's overhead would show most.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args()

    import torch

    import hpctrain.data.samples as samples
    from hpctrain.bench.loader_setup import HpctrainTransform, synthetic_images, write_shards
    from hpctrain.bench.measure import process_cpu_seconds, self_cpu_seconds
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index
    from hpctrain.data.mixture_index import open_mixture

    transform: Any = HpctrainTransform(160)
    if args.no_decode:
        image = torch.zeros(3, 224, 224, dtype=torch.uint8)

        def stub(key: str, members: Any, **kw: object) -> dict[str, Any]:
            return {"key": key, "image": image, "label": 0}

        samples.decode_sample = stub  # type: ignore[assignment]  # workers fork: inherited
        transform = None

    images = synthetic_images(args.images)
    rows = [{"jpg": data, "cls": str(label).encode()} for data, label in images]
    cfg = DataConfig(
        batch_size=args.batch_size,
        workers_per_rank=args.workers,
        shuffle_buffer=100,
        persistent_workers=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_shards(rows, root / "one", per_shard=50)
        cut = [0, args.images // 2, args.images * 5 // 6, args.images]
        for i in range(3):
            write_shards(rows[cut[i] : cut[i + 1]], root / f"part{i}", per_shard=50)
        one = open_index(str(root / "one"))
        mixed = open_mixture(
            [
                SimpleNamespace(path=str(root / f"part{i}"), weight=w, name="")
                for i, w in enumerate((3.0, 2.0, 1.0))
            ]
        )
        loaders = {
            "one source": ShardedLoader(
                one, cfg, rank=0, world_size=1, seed=0, transform=transform
            ),
            "3-source mixture": ShardedLoader(
                mixed, cfg, rank=0, world_size=1, seed=0, transform=transform
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for loader in loaders.values():  # warm-up: starts the persistent workers
            sum(len(b["key"]) for b in loader)
        names = list(loaders)
        for r in range(args.rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                loader = loaders[name]
                loader.set_epoch(r + 1)
                pids = loader.worker_pids
                cpu0 = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids)
                t0 = time.perf_counter()
                count = sum(len(b["key"]) for b in loader)
                wall = time.perf_counter() - t0
                cpu = self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids) - cpu0
                rates[name].append(count / cpu)
                print(
                    f"round {r} {name:18s} {count} images {wall:6.2f} s wall {count / cpu:8.1f} img/CPU-s",
                    file=sys.stderr,
                )
        for loader in loaders.values():
            loader.close()
    ratio = [m / o for m, o in zip(rates["3-source mixture"], rates["one source"], strict=True)]
    for name, values in rates.items():
        print(f"{name:18s} median {statistics.median(values):8.1f} images/CPU-s")
    print(
        f"mixture / one source: median ratio {statistics.median(ratio):.3f} "
        f"(rounds: {', '.join(f'{x:.3f}' for x in ratio)})"
    )


if __name__ == "__main__":
    main()
