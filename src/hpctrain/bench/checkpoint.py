"""`hpctrain bench checkpoint`: save throughput against `dd`, time blocked per save, and
what content verification costs.

The same state (`--params` parameters plus AdamW's two moments, float32, in 16M-element
tensors like a model's layers) is saved by each method, interleaved round by round so that
disk and neighbour load drift hit every method alike:

- `dd`: `dd if=<random file> of=<file> bs=16M conv=fsync` of the same byte count (the floor),
- `torch.save+fsync`: one file, flushed and fsynced,
- `dcp.save` / `dcp.async_save`: DCP with its defaults,
- `hpctrain sync` / `hpctrain async`: `CheckpointManager.save` with the full commit protocol
  and the default verification (a CRC32C per item, computed while writing),
- `hpctrain sync size`: the same without checksums (`checkpoint.verify: size`, the default
  before checksums),
- `hpctrain load` / `hpctrain load size`: `CheckpointManager.load` of one saved checkpoint,
  checking every item's CRC32C while reading, or sizes only (files in the page cache: the
  checksum's share of the time is the largest it gets).

Reported per method (medians over rounds, each round's ratio against that round's `dd`):
throughput as a ratio to `dd` (higher is better), and for async methods the time `save`
blocked the caller as a ratio to the matching sync save (lower is better). The cost of
checksums: the median over rounds of each round's sync save throughput with checksums over
without (higher is better, 1.0 is free) and of its load time with over without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint.manager import CheckpointManager, step_dir_name

HELP = (
    "checkpoint save throughput vs dd (random data, conv=fsync), time blocked per save, "
    "and what checksums cost on save and load"
)
CHUNK = 16 * 1024 * 1024  # elements per tensor: a 4096x4096 layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", type=float, default=100e6, help="model parameters (default 1e8)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--dir", default="", help="folder to write in (default: a temporary folder in /tmp)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def make_state(num_params: int) -> dict[str, Any]:
    """A model-and-AdamW-like state: params, exp_avg and exp_avg_sq, float32."""
    gen = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    left, i = num_params, 0
    while left > 0:
        n = min(CHUNK, left)
        model[f"layer{i}.weight"] = torch.randn(n, generator=gen)
        left -= n
        i += 1
    optim = {
        f"{name}.{moment}": torch.randn(t.numel(), generator=gen)
        for name, t in model.items()
        for moment in ("exp_avg", "exp_avg_sq")
    }
    return {"model": model, "optim": optim, "step": 1000}


def state_bytes(state: dict[str, Any]) -> int:
    return sum(
        t.numel() * t.element_size() for part in ("model", "optim") for t in state[part].values()
    )


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Bench:
    def __init__(self, folder: str, state: dict[str, Any]) -> None:
        self.folder = folder
        self.state = state
        self.num_bytes = state_bytes(state)
        self.source = os.path.join(folder, "random.bin")
        with open(self.source, "wb") as f:  # random bytes: no compression/dedup shortcut
            left = self.num_bytes
            while left > 0:
                n = min(CHUNK * 4, left)
                f.write(os.urandom(n))
                left -= n
        self.sync_manager = CheckpointManager(os.path.join(folder, "hp-sync"), keep_last=100)
        self.size_manager = CheckpointManager(
            os.path.join(folder, "hp-sync-size"), keep_last=100, verify="size"
        )
        self.async_manager = CheckpointManager(
            os.path.join(folder, "hp-async"), keep_last=100, async_save=True
        )
        self.step = 0
        # One checkpoint per verification mode to load, and a state of the same shapes.
        self.load_managers = {}
        for verify in ("crc32c", "size"):
            manager = CheckpointManager(
                os.path.join(folder, f"hp-load-{verify}"), keep_last=1, verify=verify
            )
            manager.save(1, {"state": self.state})
            self.load_managers[verify] = manager
        self.load_target = {
            "state": {
                "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                "optim": {k: torch.empty_like(v) for k, v in state["optim"].items()},
                "step": 0,
            }
        }

    def _scratch(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(path):
            os.remove(path)
        return path

    def dd(self) -> dict[str, float]:
        target = self._scratch("dd.bin")
        cmd = ["dd", f"if={self.source}", f"of={target}", "bs=16M", "conv=fsync", "status=none"]
        seconds = _timed(lambda: subprocess.run(cmd, check=True))
        os.remove(target)
        return {"total": seconds}

    def torch_save(self) -> dict[str, float]:
        target = self._scratch("torch.pt")

        def save() -> None:
            with open(target, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())

        seconds = _timed(save)
        os.remove(target)
        return {"total": seconds}

    def dcp_save(self) -> dict[str, float]:
        target = self._scratch("dcp-sync")
        seconds = _timed(lambda: dcp.save(self.state, checkpoint_id=target))
        shutil.rmtree(target)
        return {"total": seconds}

    def dcp_async_save(self) -> dict[str, float]:
        target = self._scratch("dcp-async")
        start = time.perf_counter()
        future = dcp.async_save(self.state, checkpoint_id=target)
        blocked = time.perf_counter() - start
        future.result()  # type: ignore[union-attr]
        total = time.perf_counter() - start
        shutil.rmtree(target)
        return {"total": total, "blocked": blocked}

    def _hp(self, manager: CheckpointManager) -> dict[str, float]:
        self.step += 1
        start = time.perf_counter()
        manager.save(self.step, {"state": self.state})
        blocked = time.perf_counter() - start
        manager.wait()
        total = time.perf_counter() - start
        shutil.rmtree(os.path.join(manager.root, step_dir_name(self.step)))
        return {"total": total, "blocked": blocked}

    def hp_sync(self) -> dict[str, float]:
        return self._hp(self.sync_manager)

    def hp_async(self) -> dict[str, float]:
        return self._hp(self.async_manager)

    def hp_sync_size(self) -> dict[str, float]:
        return self._hp(self.size_manager)

    def _load(self, verify: str) -> dict[str, float]:
        seconds = _timed(lambda: self.load_managers[verify].load(self.load_target))
        assert self.load_target["state"]["step"] == self.state["step"]
        return {"total": seconds}

    def hp_load(self) -> dict[str, float]:
        return self._load("crc32c")

    def hp_load_size(self) -> dict[str, float]:
        return self._load("size")

    def close(self) -> None:
        for manager in (self.sync_manager, self.size_manager, self.async_manager):
            manager.close()
        for manager in self.load_managers.values():
            manager.close()


METHODS = {
    "dd": "dd",
    "torch.save+fsync": "torch_save",
    "dcp.save": "dcp_save",
    "dcp.async_save": "dcp_async_save",
    "hpctrain sync": "hp_sync",
    "hpctrain async": "hp_async",
    "hpctrain sync size": "hp_sync_size",
    "hpctrain load": "hp_load",
    "hpctrain load size": "hp_load_size",
}
SYNC_OF = {"dcp.async_save": "dcp.save", "hpctrain async": "hpctrain sync"}
# (with checksums, without): the cost of content verification, compared round by round.
CHECKSUM_PAIRS = {
    "save": ("hpctrain sync", "hpctrain sync size"),
    "load": ("hpctrain load", "hpctrain load size"),
}


def run_bench(num_params: int, rounds: int, folder: str) -> dict[str, Any]:
    state = make_state(num_params)
    bench = _Bench(folder, state)
    names = list(METHODS)
    per_round: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            times = {name: getattr(bench, METHODS[name])() for name in order}
            per_round.append(times)
    finally:
        bench.close()
    results: dict[str, Any] = {
        "bytes": bench.num_bytes,
        "params": num_params,
        "rounds": rounds,
        "methods": {},
    }
    for name in names:
        ratios = [rt["dd"]["total"] / rt[name]["total"] for rt in per_round]
        entry: dict[str, Any] = {
            "seconds": statistics.median(rt[name]["total"] for rt in per_round),
            "seconds_range": [
                min(rt[name]["total"] for rt in per_round),
                max(rt[name]["total"] for rt in per_round),
            ],
            "mb_per_s": statistics.median(
                bench.num_bytes / rt[name]["total"] / 1e6 for rt in per_round
            ),
            "ratio_to_dd": statistics.median(ratios),
            "ratio_to_dd_range": [min(ratios), max(ratios)],
        }
        if name in SYNC_OF:
            blocked = [rt[name]["blocked"] / rt[SYNC_OF[name]]["total"] for rt in per_round]
            entry["blocked_s"] = statistics.median(rt[name]["blocked"] for rt in per_round)
            entry["blocked_ratio_to_sync"] = statistics.median(blocked)
            entry["blocked_ratio_range"] = [min(blocked), max(blocked)]
        results["methods"][name] = entry
    save = [
        rt[CHECKSUM_PAIRS["save"][1]]["total"] / rt[CHECKSUM_PAIRS["save"][0]]["total"]
        for rt in per_round
    ]
    load = [
        rt[CHECKSUM_PAIRS["load"][0]]["total"] / rt[CHECKSUM_PAIRS["load"][1]]["total"]
        for rt in per_round
    ]
    results["checksums"] = {
        "sync_save_throughput_ratio": statistics.median(save),
        "sync_save_throughput_ratio_range": [min(save), max(save)],
        "load_time_ratio": statistics.median(load),
        "load_time_ratio_range": [min(load), max(load)],
    }
    return results


def format_results(results: dict[str, Any]) -> str:
    lines = [
        f"state: {results['params']:.3g} params + AdamW moments = {results['bytes'] / 1e9:.2f} GB, "
        f"{results['rounds']} interleaved rounds (medians; ranges over rounds)",
        "columns: s/op = seconds per save (per load for the loads); MB/s = state bytes / s/op; "
        "/dd = dd's time / the method's = the method's throughput / dd's (above 1: faster "
        "than dd); blocked = seconds the save held the caller; /sync = blocked / the matching "
        "sync save's s/op",
        f"{'method':<18} {'s/op':>7} {'MB/s':>7} {'/dd':>6} {'/dd range':>13} {'blocked':>8} {'/sync':>7}",
    ]
    for name, e in results["methods"].items():
        low, high = e["ratio_to_dd_range"]
        line = f"{name:<18} {e['seconds']:>7.2f} {e['mb_per_s']:>7.0f} {e['ratio_to_dd']:>6.2f} {f'{low:.2f}-{high:.2f}':>13}"
        if "blocked_s" in e:
            line += f" {e['blocked_s']:>7.2f}s {e['blocked_ratio_to_sync']:>7.2f}"
        lines.append(line)
    c = results["checksums"]
    save_low, save_high = c["sync_save_throughput_ratio_range"]
    load_low, load_high = c["load_time_ratio_range"]
    lines.append(
        f"checksums: sync save throughput, crc32c / size = {c['sync_save_throughput_ratio']:.2f} "
        f"({save_low:.2f}-{save_high:.2f}; 1.00: free); "
        f"load time, crc32c / size = {c['load_time_ratio']:.2f} ({load_low:.2f}-{load_high:.2f})"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    num_params = int(args.params)
    if num_params < 1 or args.rounds < 1:
        raise SystemExit("hpctrain bench checkpoint: --params and --rounds must be positive")
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir)
    else:
        folder = tempfile.mkdtemp(prefix="hpctrain-bench-checkpoint-")
    try:
        results = run_bench(num_params, args.rounds, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else format_results(results))
    return 0
