"""`hpctrain bench index`: a rank's start on `index.json` against the compact index, side by side.

One generated index of `--shards` shards (default a million: 153 MB of JSON, shard names that
follow one pattern, a sha256 each) and its compact companion (`hpctrain.data.compact`), then:

- per rank, each form in a fresh process (`--rounds` times, medians): CPU seconds and private
  memory (anonymous pages: what the process allocated itself; the mapped node-local copy is
  shared by the node's ranks and not counted) from `open_index` to the URL of the first shard
  its plan reads (`ShardedLoader` of rank `--rank` in `--world-size` ranks x `--workers` loader
  workers, no worker started);
- per node: bytes read from the shared filesystem while `--processes` local processes (16)
  open the index at once, each counted by `CountingFileSystem`, an fsspec wrapper over the
  local filesystem (`countfs://`) that counts the bytes its files hand out. With the compact
  form, one of them copies it to node-local memory and the others map that copy.

Goals (issue #42): per rank <= 0.3 s of CPU and <= 64 MB of private memory; per node about
one compact index read, whatever the processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

HELP = "per-rank CPU and memory, and per-node bytes read, of index.json vs the compact index"
PROTOCOL = "countfs"
GOAL_CPU_S = 0.3
GOAL_PRIVATE_MB = 64.0


class _CountingFile:
    """A file whose reads are added to `CountingFileSystem.bytes_read`."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def read(self, *args: Any) -> Any:
        data = self._f.read(*args)
        CountingFileSystem.bytes_read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = int(self._f.readinto(buffer))
        CountingFileSystem.bytes_read += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class CountingFileSystem(LocalFileSystem):
    """The local filesystem as `countfs:///path`, counting the bytes read through it (the
    "shared filesystem" of the node case): `CountingFileSystem.bytes_read`, per process."""

    protocol = PROTOCOL
    bytes_read = 0

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = super()._open(path, mode, *args, **kwargs)
        return _CountingFile(f) if "r" in mode else f

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        with self._open(self._strip_protocol(path), "rb") as f:
            if start:
                f.seek(start)
            return bytes(f.read(None if end is None else end - (start or 0)))


def register() -> None:
    """Make `countfs://` known to fsspec in this process."""
    fsspec.register_implementation(PROTOCOL, CountingFileSystem, clobber=True)


register()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=1_000_000, help="shards (default 1e6)")
    parser.add_argument(
        "--samples-per-shard", type=int, default=100, help="samples per shard (default 100)"
    )
    parser.add_argument("--world-size", type=int, default=16384, help="ranks (default 16384)")
    parser.add_argument("--workers", type=int, default=8, help="loader workers per rank (8)")
    parser.add_argument("--rank", type=int, default=12345, help="the rank measured (12345)")
    parser.add_argument("--rounds", type=int, default=3, help="per-rank rounds (default 3)")
    parser.add_argument(
        "--processes", type=int, default=16, help="local processes of the node case (16)"
    )
    parser.add_argument(
        "--json-parallel",
        type=int,
        default=2,
        help="of them at once on the JSON form (each needs ~0.8 GB at 1e6 shards; default 2)",
    )
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def make_index(folder: Path, num_shards: int, samples_per_shard: int) -> Path:
    """`folder/index.json` (shards `train-000000.tar`...; no shard files) and its companion."""
    from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
    from hpctrain.data.node_index import write_companion

    folder.mkdir(parents=True, exist_ok=True)
    digests = os.urandom(32 * num_shards).hex()
    size = samples_per_shard * 4096
    shards = tuple(
        ShardInfo(f"train-{i:06d}.tar", samples_per_shard, size, digests[64 * i : 64 * i + 64])
        for i in range(num_shards)
    )
    path = folder / "index.json"
    path.write_bytes(index_to_bytes(ShardIndex(shards=shards, command="hpctrain bench index")))
    del shards
    write_companion(str(path))
    return path


def _memory_kb() -> dict[str, int]:
    """This process's /proc/self/smaps_rollup fields, in kB."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0])
    return out


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _start_rank(spec: str, form: str, node_dir: str, args: dict[str, int]) -> dict[str, Any]:
    """A rank's start: index -> loader -> plan -> its first shard's URL (what is measured)."""
    CountingFileSystem.bytes_read = 0
    os.environ["HPCTRAIN_INDEX_FORM"] = form
    os.environ["HPCTRAIN_NODE_LOCAL_DIR"] = node_dir
    register()
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index

    cfg = DataConfig(batch_size=8, workers_per_rank=args["workers"], shuffle_buffer=0)
    before, cpu, wall = _memory_kb(), _cpu(), time.perf_counter()
    index = open_index(spec)
    loader = ShardedLoader(index, cfg, rank=args["rank"], world_size=args["world_size"], seed=0)
    first = loader.plan().stream_segments(args["rank"], 0)[0]
    url = index.shard_url(first.shard)
    cpu, wall, after = _cpu() - cpu, time.perf_counter() - wall, _memory_kb()
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "private_mb": (after["Anonymous"] - before["Anonymous"]) / 1024,
        "rss_mb": (after["Rss"] - before["Rss"]) / 1024,
        "first_shard": url.rsplit("/", 1)[-1],
        "bytes_read": CountingFileSystem.bytes_read,
        "compact": type(index.shards).__name__ == "CompactShards",
    }


def _child(
    conn: Connection, start: Any, spec: str, form: str, node_dir: str, args: dict[str, int]
) -> None:
    try:
        # imports first, outside what is measured (torch: seconds)
        import hpctrain.data.loader  # noqa: F401

        if start is not None:
            start.wait()  # the node case: every process opens the index at once
        conn.send(_start_rank(spec, form, node_dir, args))
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def run_processes(
    spec: str,
    form: str,
    node_dir: str,
    args: dict[str, int],
    count: int,
    parallel: int,
    *,
    method: str = "spawn",
) -> list[dict[str, Any]]:
    """`count` processes starting a rank on `spec`, `parallel` at once (spawned: fresh, with
    nothing inherited from this one; "fork" where the imports may be shared, as in tests)."""
    ctx: Any = multiprocessing.get_context(method)  # typeshed: BaseContext lacks Process
    results: list[dict[str, Any]] = []
    for first in range(0, count, parallel):
        wave = range(first, min(first + parallel, count))
        start = ctx.Event() if len(wave) > 1 else None
        procs, pipes = [], []
        for _ in wave:
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(child, start, spec, form, node_dir, args))
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        if start is not None:
            if method == "spawn":
                time.sleep(1.0 + 0.5 * len(wave))  # imports done (torch) before the gun
            start.set()
        for p, pipe in zip(procs, pipes, strict=True):
            result = pipe.recv()
            p.join()
            if "error" in result:
                raise RuntimeError(f"bench index: a rank failed: {result['error']}")
            results.append(result)
    return results


def run_bench(workdir: Path, ns: argparse.Namespace) -> dict[str, Any]:
    path = make_index(workdir / "index", ns.shards, ns.samples_per_shard)
    spec = f"{PROTOCOL}://{path}"
    args = {"rank": ns.rank, "world_size": ns.world_size, "workers": ns.workers}
    out: dict[str, Any] = {
        "shards": ns.shards,
        "json_mb": path.stat().st_size / 1e6,
        "compact_mb": path.with_suffix(".compact").stat().st_size / 1e6,
        "world_size": ns.world_size,
        "workers_per_rank": ns.workers,
        "per_rank": {},
        "per_node": {},
    }
    for form in ("json", "compact"):
        rounds = []
        for _ in range(ns.rounds):  # interleaved by form would share nothing: each is fresh
            node_dir = tempfile.mkdtemp(prefix="hpctrain-bench-node-", dir=_node_root())
            try:
                rounds += run_processes(spec, form, node_dir, args, 1, 1)
            finally:
                shutil.rmtree(node_dir, ignore_errors=True)
        out["per_rank"][form] = {
            key: statistics.median(r[key] for r in rounds)
            for key in ("cpu_s", "wall_s", "private_mb", "rss_mb")
        }
        out["per_rank"][form]["first_shard"] = rounds[0]["first_shard"]
        out["per_rank"][form]["read_compact"] = rounds[0]["compact"]
    for form in ("json", "compact"):
        node_dir = tempfile.mkdtemp(prefix="hpctrain-bench-node-", dir=_node_root())
        try:
            parallel = ns.processes if form == "compact" else max(ns.json_parallel, 1)
            results = run_processes(spec, form, node_dir, args, ns.processes, parallel)
        finally:
            shutil.rmtree(node_dir, ignore_errors=True)
        total = sum(r["bytes_read"] for r in results)
        out["per_node"][form] = {
            "processes": ns.processes,
            "at_once": parallel,
            "bytes_read_mb": total / 1e6,
            "compact_indexes": total / 1e6 / out["compact_mb"],
            "max_cpu_s": max(r["cpu_s"] for r in results),
        }
    return out


def _node_root() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def format_results(r: dict[str, Any]) -> str:
    j, c = r["per_rank"]["json"], r["per_rank"]["compact"]
    nj, nc = r["per_node"]["json"], r["per_node"]["compact"]
    lines = [
        f"index of {r['shards']:,} shards: index.json {r['json_mb']:.1f} MB, index.compact "
        f"{r['compact_mb']:.1f} MB; plan of {r['world_size']} ranks x {r['workers_per_rank']} "
        "workers",
        "",
        "per rank, open_index -> first planned shard   index.json   compact   json/compact",
        f"  CPU s                                       {j['cpu_s']:10.3f}  {c['cpu_s']:8.3f}"
        f"   {j['cpu_s'] / max(c['cpu_s'], 1e-9):8.1f}x",
        f"  wall s                                      {j['wall_s']:10.3f}  {c['wall_s']:8.3f}"
        f"   {j['wall_s'] / max(c['wall_s'], 1e-9):8.1f}x",
        f"  private memory MB (anonymous)               {j['private_mb']:10.1f}  "
        f"{c['private_mb']:8.1f}   {j['private_mb'] / max(c['private_mb'], 1e-9):8.1f}x",
        f"  first shard                                 {j['first_shard']:>10}  "
        f"{c['first_shard']:>8}",
        "",
        f"per node, {nc['processes']} local processes: bytes read from the shared filesystem",
        f"  index.json: {nj['bytes_read_mb']:.1f} MB ({nj['at_once']} at once); compact: "
        f"{nc['bytes_read_mb']:.1f} MB ({nc['at_once']} at once) = "
        f"{nc['compact_indexes']:.3f} compact index",
        "",
        f"goal: per rank CPU <= {GOAL_CPU_S} s: {_met(c['cpu_s'] <= GOAL_CPU_S)}; private "
        f"memory <= {GOAL_PRIVATE_MB:.0f} MB: {_met(c['private_mb'] <= GOAL_PRIVATE_MB)}; per "
        f"node ~ one compact index: {_met(nc['compact_indexes'] <= 1.05)}",
    ]
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hpctrain-"))
    try:
        results = run_bench(workdir, args)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(results, indent=1) if args.json else format_results(results))
    return 0
