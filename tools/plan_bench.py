"""Time `hpctrain plan` at scale: one source vs a 5-source mixture, 100k shards in all.

    PYTHONPATH=src .venv/bin/python tools/plan_bench.py [--repeat 3] [--world-size 4096]
    PYTHONPATH=OTHER/src .venv/bin/python tools/plan_bench.py --one-source-only   # before

Writes the indexes (no shard files: the plan reads only the index) into a temporary folder,
then times `main(["plan", ...])` in this process (imports excluded; stdout to /dev/null),
with and without `--json`, the best of `--repeat` runs, side by side. `--json`: the times as
JSON on stdout too (`make bench-quick` reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from hpctrain.cli.main import main
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes


def write_index(folder: Path, first: int, count: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    shards = tuple(
        ShardInfo(url=f"train-{i:06d}.tar", num_samples=1000 + (i % 7), num_bytes=1 << 20)
        for i in range(first, first + count)
    )
    (folder / "index.json").write_bytes(index_to_bytes(ShardIndex(shards=shards)))
    return str(folder / "index.json")


def best_of(argv: list[str], repeat: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the best run: CPU time is what a shared machine cannot
    inflate (the command is single-threaded), wall time what a quiet one shows."""
    times = []
    for _ in range(repeat):
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            cpu, wall = time.process_time(), time.perf_counter()
            code = main(argv)
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        if code != 0:
            raise SystemExit(f"hpctrain {' '.join(argv)} failed with exit code {code}")
    return min(times)


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4096)
    parser.add_argument("--workers-per-rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument(
        "--one-source-only",
        action="store_true",
        help="only the one-source cases (to time a revision without mixtures)",
    )
    parser.add_argument("--json", action="store_true", help="the times as JSON on stdout")
    args = parser.parse_args()
    geometry = [
        "--world-size",
        str(args.world_size),
        "--workers-per-rank",
        str(args.workers_per_rank),
        "--batch-size",
        str(args.batch_size),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        one = write_index(Path(tmp, "one"), 0, args.shards)
        per = args.shards // 5
        parts = [write_index(Path(tmp, f"s{i}"), i * per, per) for i in range(5)]
        mixed = [*parts, "--weights", "0.4,0.25,0.15,0.1,0.1"]
        cases = {
            "one source": ["plan", one, *geometry],
            "one source --json": ["plan", one, *geometry, "--json"],
        }
        if not args.one_source_only:
            cases["5-source mixture"] = ["plan", *mixed, *geometry]
            cases["5-source mixture --json"] = ["plan", *mixed, *geometry, "--json"]
        print(
            f"{args.shards} shards, W={args.world_size}, K={args.workers_per_rank}, "
            f"B={args.batch_size}; best of {args.repeat}",
            file=sys.stderr,
        )
        times = {}
        for name, argv in cases.items():
            cpu, wall = best_of(argv, args.repeat)
            print(f"{name:28s} {cpu:6.2f} s CPU {wall:6.2f} s wall", file=sys.stderr)
            times[name] = {"cpu_s": cpu, "wall_s": wall}
        if args.json:
            print(json.dumps(times))


if __name__ == "__main__":
    run()
