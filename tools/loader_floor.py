"""Where the loader's CPU per image goes, against what this machine allows: floors side by side.

    PYTHONPATH=src .venv/bin/python tools/loader_floor.py [--images N] [--rounds N]

Prints, each a median over interleaved rounds, in CPU microseconds per image:

1. the pixel copy: one 224x224x3 uint8 image into a batch slot of rotating shared-memory
   buffers (what batching must write for each image), in one process and in two processes side
   by side (as two loader workers run), and into one buffer that stays in cache;
2. tar reading: a bare Python loop (one unbuffered read per header and per member) against
   hpctrain's reader (`iter_samples`: checksums, every tar format, skip by seeking);
3. decoding in workers: the decode + transform loop of this process (the limit) against the
   loader with 1 and with 2 workers, paired by epoch, with the loader's own cost (decoding
   stubbed) for scale;
4. the ratio the loader's goal is about: its own cost with 2 workers / the floors (the pixel
   copy side by side + the bare tar read), goal <= 1.5. `--json`: the figures as JSON on
   stdout, the lines on stderr (`make bench-quick` reads them).

What it showed here: the copy alone takes about the 25 us the loader overhead goal allows,
and with two workers the decoder itself runs slower per image than alone (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

COPY_BUFFERS = 5  # a worker's buffers in rotation with the default prefetch (prefetch + 3)
OUT = sys.stdout  # where the lines go (stderr under --json)


def say(line: str) -> None:
    print(line, file=OUT, flush=True)


def median_us(fn: Callable[[], int], rounds: int) -> float:
    """Median CPU microseconds per item of `fn()` (which returns its item count)."""
    out = []
    for _ in range(rounds):
        start = time.process_time()
        n = fn()
        out.append((time.process_time() - start) / n * 1e6)
    return statistics.median(out)


def copy_case(buffers: int, rounds: int) -> float:
    import torch

    image = torch.zeros(3, 224, 224, dtype=torch.uint8)
    flat = [torch.empty(32, 3, 224, 224, dtype=torch.uint8).share_memory_() for _ in range(buffers)]
    rows = [row for b in flat for row in b.unbind(0)]
    for row in rows:
        row.fill_(1)  # faulted in: reused buffers, as the loader's

    def run() -> int:
        for row in rows * 4:
            row.copy_(image)
        return len(rows) * 4

    return median_us(run, rounds)


def side_by_side(fn: Callable[[], float]) -> list[float]:
    """`fn()` in two forked processes at once; their results."""
    pipes, pids = [], []
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, repr(fn()).encode())
            os._exit(0)
        os.close(w)
        pipes.append(r)
        pids.append(pid)
    out = []
    for r, pid in zip(pipes, pids, strict=True):
        out.append(float(os.read(r, 64)))
        os.waitpid(pid, 0)
    return out


def reading_case(shards: list[str], rounds: int) -> tuple[float, float]:
    from hpctrain.data.stream import open_shard
    from hpctrain.data.tar import iter_samples

    def bare() -> int:
        n = 0
        for path in shards:
            with open(path, "rb", buffering=0) as f:
                while True:
                    header = f.read(512)
                    if len(header) < 512 or header[0] == 0:
                        break
                    size = int(header[124:135], 8)
                    f.read(-(-size // 512) * 512)
                    n += 1
        return n // 2  # two members per sample

    def ours() -> int:
        n = 0
        for path in shards:
            with open_shard(path) as f:
                for _sample in iter_samples(f, views=True):
                    n += 1
        return n

    a, b = [], []
    for i in range(rounds):
        for fn, out in ((bare, a), (ours, b)) if i % 2 else ((ours, b), (bare, a)):
            out.append(median_us(fn, 1))
    return statistics.median(a), statistics.median(b)


def workers_case(root: Path, images: list, epochs: int) -> dict[str, float]:
    """Prints the paired limit/loader ratios and the stubbed own cost per worker count;
    returns `own_cost_us_<workers>`."""
    import torch

    import hpctrain.data.samples as samples
    from hpctrain.bench import loader_setup as bench
    from hpctrain.bench.measure import process_cpu_seconds, self_cpu_seconds
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index
    from hpctrain.data.decode import decode_image
    from loader_ab import children

    transform = bench.HpctrainTransform(224)
    index = open_index(str(root / "shards"))

    def limit() -> float:
        start = self_cpu_seconds()
        for data, label in images:
            transform({"jpg": decode_image(data), "cls": label, "key": ""})
        return (self_cpu_seconds() - start) / len(images) * 1e6

    def loader_us(workers: int, stub: bool) -> list[tuple[float, float]]:
        real = samples.decode_sample
        if stub:
            image = torch.zeros(3, 224, 224, dtype=torch.uint8)
            samples.decode_sample = lambda key, m, **kw: {"key": key, "image": image, "cls": 0}  # type: ignore[assignment]
        cfg = DataConfig(batch_size=32, workers_per_rank=workers, shuffle_buffer=0)
        loader = ShardedLoader(
            index, cfg, rank=0, world_size=1, seed=0, transform=None if stub else transform
        )
        bench.count_images(loader)
        pids = children()
        samples.decode_sample = real  # the workers keep what they forked with

        def cpu() -> float:
            return self_cpu_seconds() + sum(process_cpu_seconds(p) for p in pids)

        out = []
        for epoch in range(1, epochs + 1):
            lim = limit() if not stub else 0.0
            loader.set_epoch(epoch)
            start = cpu()
            n = bench.count_images(loader)
            out.append(((cpu() - start) / n * 1e6, lim))
        loader.close()
        return out

    for workers in (1, 2):
        pairs = loader_us(workers, stub=False)
        ratio = statistics.median(lim / us for us, lim in pairs)
        say(
            f"decode + transform, {workers} worker(s): loader "
            f"{statistics.median(us for us, _ in pairs):.0f} us/image, limit "
            f"{statistics.median(lim for _, lim in pairs):.0f}: limit/loader paired {ratio:.3f}"
        )
    out = {}
    for workers in (1, 2):
        stubbed = statistics.median(us for us, _ in loader_us(workers, stub=True))
        say(f"loader's own cost (decoding stubbed), {workers} worker(s): {stubbed:.1f} us/image")
        out[f"own_cost_us_{workers}"] = stubbed
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="figures as JSON on stdout")
    args = parser.parse_args()
    global OUT
    OUT = sys.stderr if args.json else sys.stdout

    import torch

    torch.set_num_threads(1)
    from hpctrain.bench import loader_setup as bench

    with tempfile.TemporaryDirectory(prefix="hpctrain-floor-") as tmp:
        root = Path(tmp)
        images = bench.synthetic_images(args.images, root)
        bench.write_layouts(images, root)
        shards = sorted(glob.glob(str(root / "shards" / "*.tar")))
        load = os.getloadavg()[0]
        say(f"{args.images} 400x300 JPEGs in {len(shards)} shards; load {load:.1f}")

        alone = copy_case(COPY_BUFFERS, args.rounds)
        pair = side_by_side(lambda: copy_case(COPY_BUFFERS, args.rounds))
        hot = copy_case(1, args.rounds)
        say(
            f"pixel copy (150 KB into {COPY_BUFFERS} rotating shared buffers): {alone:.1f} us "
            f"alone, {statistics.mean(pair):.1f} us two processes side by side; one cached "
            f"buffer {hot:.1f} us"
        )
        import gc

        gc.freeze()  # as loader workers do with what they inherit (data/transport.py)
        bare, ours = reading_case(shards, args.rounds)
        say(f"tar reading per sample: bare loop {bare:.1f} us, hpctrain iter_samples {ours:.1f} us")
        results = workers_case(root, images, args.epochs)
        copy_pair = statistics.mean(pair)
        floors = copy_pair + bare
        own = results["own_cost_us_2"]
        say(
            f"loader's own cost, 2 workers / floors (pixel copy side by side {copy_pair:.1f} us + "
            f"bare tar read {bare:.1f} us) = {own:.1f} / {floors:.1f} = {own / floors:.2f} "
            "(goal <= 1.5)"
        )
    if args.json:
        results.update(
            copy_alone_us=alone,
            copy_side_by_side_us=copy_pair,
            copy_cached_us=hot,
            tar_bare_us=bare,
            tar_hpctrain_us=ours,
            own_cost_us=own,
            floors_us=floors,
            own_cost_over_floors=own / floors,
        )
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
