"""`hpctrain bench mesh`: HSDP's training step against flat FSDP2's, on 4 gloo CPU ranks.

Four processes pretend to be two nodes of two (`LOCAL_WORLD_SIZE=2`). Each builds Trainers
for gpt-tiny (`hpctrain.bench.trainer`'s config and in-memory batches; the loader is never
iterated): FSDP2 over the 4 ranks twice (A, and B for the A/A control), HSDP 2 x 2 and, with
`--tp`, FSDP2 2 x TP 2. Segments of a few steps alternate in a rotating order over many
pairs; a segment is timed on rank 0 between two barriers, so it lasts as long as the slowest
rank. The report is the median of the paired ratios case / FSDP2-A and the A/A control
B / A (beyond 1.00 +- 0.03 the machine is too loud to read a few per cent from).

On one machine every collective is a local copy, so this measures the cost of HSDP's mesh
and its extra all-reduce on the CPU, not the network it saves between nodes (for that see
docs/training.md's strategy table).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "HSDP (and TP) step vs flat FSDP2 on 4 gloo CPU ranks (paired ratios, A/A control)"
NOISE_LIMIT = 0.03
RANKS, PER_NODE = 4, 2
CASES = {
    "fsdp_a": ["train.strategy=fsdp"],
    "fsdp_b": ["train.strategy=fsdp"],
    "hsdp": ["train.strategy=hsdp"],
}
TP_CASE = {"fsdp_tp": ["train.strategy=fsdp", "train.tp_degree=2"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=12, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed segment")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--tp", action="store_true", help="also FSDP2 2 x TP 2")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)


def worker(work: Path, pairs: int, steps: int, seq_len: int, tp: bool) -> None:
    """One rank: build every case, time the segments, rank 0 writes `work/result.json`."""
    import torch
    import torch.distributed as dist

    from hpctrain.bench.trainer import TrainerLoop, bench_config, make_batches
    from hpctrain.config import with_overrides
    from hpctrain.distributed import choose_device, process_group, resolve_env
    from hpctrain.train.trainer import Trainer

    torch.set_num_threads(1)
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    cases = {**CASES, **(TP_CASE if tp else {})}
    with process_group(env, device):
        base = bench_config("gpt-tiny", work, seq_len)
        loops, streams = {}, {}
        for name, overrides in cases.items():
            cfg = with_overrides(base, [f"run_dir={work / name}", *overrides])
            loops[name] = TrainerLoop(Trainer(cfg, env, device))
            batches = make_batches("gpt-tiny", 4, cfg.data.batch_size, seq_len)
            streams[name] = itertools.cycle(batches)
        for name, loop in loops.items():  # warm-up
            loop.run(streams[name], 1)
        times: dict[str, list[float]] = {name: [] for name in loops}
        names = list(loops)
        for i in range(pairs):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                loops[name].run(streams[name], steps)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        if env.is_main:
            (work / "result.json").write_text(json.dumps(times))


def summarize(times: dict[str, list[float]], steps: int) -> dict[str, Any]:
    base = times["fsdp_a"]
    out: dict[str, Any] = {"fsdp_step_ms": statistics.median(base) / steps * 1000}
    for name, values in times.items():
        if name == "fsdp_a":
            continue
        ratios = [v / a for v, a in zip(values, base, strict=True)]
        out[name] = {
            "ratio": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "step_ms": statistics.median(values) / steps * 1000,
        }
    out["noisy"] = abs(out["fsdp_b"]["ratio"] - 1.0) > NOISE_LIMIT
    return out


def format_results(result: dict[str, Any], pairs: int) -> str:
    verdict = "TOO NOISY (A/A outside 1.00 ± 0.03)" if result["noisy"] else "ok"
    aa = result["fsdp_b"]
    lines = [
        f"4 gloo ranks (2 pretended nodes of 2), gpt-tiny: FSDP2 step {result['fsdp_step_ms']:.1f} ms "
        f"(median); A/A control FSDP2-B / FSDP2-A = {aa['ratio']:.3f} "
        f"({aa['min']:.3f}..{aa['max']:.3f}) [{verdict}]"
    ]
    labels = {"hsdp": "HSDP 2 x 2", "fsdp_tp": "FSDP2 2 x TP 2"}
    for name, label in labels.items():
        if name in result:
            r = result[name]
            lines.append(
                f"{label} / FSDP2 = {r['ratio']:.3f} (median of {pairs} paired segments, "
                f"{r['min']:.3f}..{r['max']:.3f}; step {r['step_ms']:.1f} ms; goal for HSDP <= 1.05)"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        worker(Path(args.worker), args.pairs, args.steps, args.seq_len, args.tp)
        return 0
    from hpctrain.launch.local import run_local

    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-mesh-") as tmp:
        argv = ["mesh", "--worker", tmp, "--pairs", str(args.pairs), "--steps", str(args.steps)]
        argv += ["--seq-len", str(args.seq_len)] + (["--tp"] if args.tp else [])
        if run_local(argv, RANKS, verb="bench", per_node=PER_NODE):
            return 1  # run_local named the rank that failed
        times = json.loads((Path(tmp) / "result.json").read_text())
    result = summarize(times, args.steps)
    print(json.dumps(result, indent=2) if args.json else format_results(result, args.pairs))
    return 0
