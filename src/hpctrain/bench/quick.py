"""`make bench-quick` (`python -m hpctrain.bench.quick`): every goal of BENCHMARKS.md that a
few minutes on a development machine can check, one line each: `goal | ratio | verdict`.

Run it before a change that touches the training loop, the loader or the checkpoint path. It
reuses the benchmarks, each in a process of its own and at a small size: `hpctrain bench
trainer` (MLP and resnet18, paired, A/A control; then the demo config's data wait, trained
for real), `hpctrain bench loader` (limit and hpctrain
cases, no peers), `tools/loader_floor.py` (the loader's own cost against the floors),
`tools/plan_bench.py` (the plan at W=4096, K=8, 100k shards) and `hpctrain bench checkpoint`
(a small state against `dd`).

A verdict is `met` or `missed` by the median, or `noisy` when the machine is too loud to tell:
the A/A control (two identical loops) strays beyond 1.00 +- 0.03, or the rounds' range
straddles the goal and is wider than a quarter of the median. Not in CI: a shared machine
makes wall-clock figures move; the ratios are taken side by side in the same minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
AA_LIMIT = 0.03  # the A/A control's allowed distance from 1 (as `hpctrain bench trainer`)
SPREAD_LIMIT = 0.25  # a range straddling the goal and wider than this share of the median
DD_SPREAD_LIMIT = 1.5  # slowest / fastest `dd` of the same bytes: the disk too loud to tell
PLAN_GOAL_S = 2.0


def verdict(
    ratio: float,
    goal: float,
    *,
    higher_is_better: bool,
    aa: float | None = None,
    low: float | None = None,
    high: float | None = None,
    loud: bool = False,
) -> str:
    """`met`, `missed` or `noisy` for a median `ratio` against `goal`.

    `aa`: the A/A control of the same run (noisy beyond 1 +- AA_LIMIT); `low`/`high`: the
    range over rounds (noisy when it straddles the goal and spans more than SPREAD_LIMIT of
    the median); `loud`: the baseline itself varied too much between rounds (noisy).
    """
    if loud or (aa is not None and abs(aa - 1.0) > AA_LIMIT):
        return "noisy"
    straddles = low is not None and high is not None and low <= goal <= high
    if straddles and ratio > 0 and (float(high or 0) - float(low or 0)) / ratio > SPREAD_LIMIT:
        return "noisy"
    met = ratio >= goal if higher_is_better else ratio <= goal
    return "met" if met else "missed"


def report_line(goal: str, ratio: str, result: str) -> str:
    """One line of the report: `goal | ratio | verdict`."""
    return f"{goal} | {ratio} | {result}"


def ratio_text(
    ratio: float, low: float | None = None, high: float | None = None, aa: float | None = None
) -> str:
    text = f"{ratio:.3f}"
    if low is not None and high is not None:
        text += f" ({low:.3f}-{high:.3f})"
    if aa is not None:
        text += f", A/A {aa:.3f}"
    return text


def trainer_lines(results: dict[str, Any]) -> list[str]:
    """The Trainer's goals from `hpctrain bench trainer --json` (CPU time)."""
    lines = []
    for case in results["compare"]:
        r = case["cpu"]
        if case["model"] == "resnet18":
            lines.append(
                report_line(
                    "trainer: resnet18 step <= 1.02x a hand-written loop (CPU)",
                    ratio_text(r["ratio"], r["ratio_min"], r["ratio_max"], r["aa_ratio"]),
                    verdict(r["ratio"], 1.02, higher_is_better=False, aa=r["aa_ratio"]),
                )
            )
        elif case["model"] == "mlp":
            overhead = r["overhead_ms"]
            lines.append(
                report_line(
                    "trainer: fixed overhead per step <= 0.1 ms (MLP, CPU)",
                    f"{overhead:.3f} ms / 0.1 ms = {overhead / 0.1:.2f}, A/A {r['aa_ratio']:.3f}",
                    verdict(overhead, 0.1, higher_is_better=False, aa=r["aa_ratio"]),
                )
            )
    return lines


DATA_WAIT_GOAL = 0.05


def data_wait_lines(results: dict[str, Any]) -> list[str]:
    """The demo config's data wait from `hpctrain bench trainer --json` (2 loader workers)."""
    wait = results["data_wait"]["data_wait_fraction"]
    return [
        report_line(
            f"trainer: data wait of the demo config (2 workers, CPU) <= {DATA_WAIT_GOAL:.0%} "
            "of step time",
            f"{wait:.1%} / {DATA_WAIT_GOAL:.0%} = {wait / DATA_WAIT_GOAL:.2f}",
            verdict(wait, DATA_WAIT_GOAL, higher_is_better=False),
        )
    ]


def _case_ratio(cases: dict[str, Any], a: str, b: str) -> tuple[float, float, float]:
    """Images per CPU-s of case a / case b: the ratio of medians and the widest range."""
    ra, rb = cases[a], cases[b]
    alo, ahi = ra["images_per_cpu_s_range"]
    blo, bhi = rb["images_per_cpu_s_range"]
    return ra["images_per_cpu_s"] / rb["images_per_cpu_s"], alo / bhi, ahi / blo


def loader_lines(results: dict[str, Any]) -> list[str]:
    """The loader's goals from `hpctrain bench loader --cases limit,hpctrain --json`."""
    cases = results["cases"]
    steady = next(name for name in cases if name.startswith("hpctrain") and "persistent" in name)
    limit = next(name for name in cases if name.startswith("limit") and "side by side" not in name)
    side = next(name for name in cases if "side by side" in name)
    workers = results["meta"]["workers"]
    lines = []
    for goal, other, text in (
        (0.92, limit, "the one-process decode limit"),
        (0.95, side, f"the side-by-side decode limit ({workers} workers)"),
    ):
        ratio, low, high = _case_ratio(cases, steady, other)
        lines.append(
            report_line(
                f"loader: steady-state images per CPU-s >= {goal}x {text}",
                ratio_text(ratio, low, high),
                verdict(ratio, goal, higher_is_better=True, low=low, high=high),
            )
        )
    return lines


def floor_lines(results: dict[str, Any]) -> list[str]:
    """The loader's own cost against the floors, from `tools/loader_floor.py --json`."""
    ratio = results["own_cost_over_floors"]
    return [
        report_line(
            "loader: own cost (decode stubbed, 2 workers) <= 1.5x the floors "
            "(pixel copy side by side + bare tar read)",
            f"{results['own_cost_us']:.1f} us / {results['floors_us']:.1f} us = {ratio:.2f}",
            verdict(ratio, 1.5, higher_is_better=False),
        )
    ]


def plan_lines(results: dict[str, Any]) -> list[str]:
    """The plan's goal from `tools/plan_bench.py --json` (CPU seconds, best of the repeats)."""
    case = results["5-source mixture --json"]
    ratio = case["cpu_s"] / PLAN_GOAL_S
    return [
        report_line(
            f"plan: --json of a 5-source mixture, 100k shards, W=4096, K=8, B=64 < {PLAN_GOAL_S:g} s "
            "(in process, CPU)",
            f"{case['cpu_s']:.2f} s / {PLAN_GOAL_S:g} s = {ratio:.2f} (wall {case['wall_s']:.2f} s)",
            verdict(ratio, 1.0, higher_is_better=False),
        )
    ]


def checkpoint_lines(results: dict[str, Any]) -> list[str]:
    """The checkpoint goals from `hpctrain bench checkpoint --json`."""
    sync = results["methods"]["hpctrain sync"]
    asynchronous = results["methods"]["hpctrain async"]
    checksums = results["checksums"]
    dd_low, dd_high = results["methods"]["dd"]["seconds_range"]
    loud = dd_high / dd_low > DD_SPREAD_LIMIT  # the disk's own time for the same bytes
    size = f"{results['bytes'] / 1e6:.0f} MB, dd {dd_low:.2f}-{dd_high:.2f} s"
    lines = []
    low, high = sync["ratio_to_dd_range"]
    lines.append(
        report_line(
            f"checkpoint: sync save >= 0.85x dd of the same bytes ({size})",
            ratio_text(sync["ratio_to_dd"], low, high),
            verdict(
                sync["ratio_to_dd"], 0.85, higher_is_better=True, low=low, high=high, loud=loud
            ),
        )
    )
    low, high = asynchronous["blocked_ratio_range"]
    blocked = asynchronous["blocked_ratio_to_sync"]
    lines.append(
        report_line(
            "checkpoint: async save blocks training <= 0.2x a sync save",
            ratio_text(blocked, low, high),
            verdict(blocked, 0.2, higher_is_better=False, low=low, high=high, loud=loud),
        )
    )
    ratio = checksums["sync_save_throughput_ratio"]
    low, high = checksums["sync_save_throughput_ratio_range"]
    lines.append(
        report_line(
            "checkpoint: verify crc32c save throughput >= 0.9x of size",
            ratio_text(ratio, low, high),
            verdict(ratio, 0.9, higher_is_better=True, low=low, high=high, loud=loud),
        )
    )
    return lines


def run_json(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run a benchmark printing JSON on stdout; its JSON, or SystemExit with its stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {tail}")
    return json.loads(proc.stdout)


CASES: list[tuple[str, list[str], Callable[[dict[str, Any]], list[str]]]] = [
    (
        "trainer",
        [
            *("-m", "hpctrain", "bench", "trainer", "--json", "--pairs", "24"),
            *("--resnet-steps", "4", "--mlp-pairs", "8", "--demo-steps", "0"),
        ],
        trainer_lines,
    ),
    (
        # The demo config as shipped (configs/demo.yaml), trained for real: a change of it
        # that breaks the benchmark shows here.
        "demo data wait",
        [
            *("-m", "hpctrain", "bench", "trainer", "--json", "--pairs", "0"),
            *("--mlp-pairs", "0", "--demo-steps", "30"),
        ],
        data_wait_lines,
    ),
    (
        "loader",
        [
            *("-m", "hpctrain", "bench", "loader", "--json", "--images", "480"),
            *("--rounds", "5", "--cases", "limit,hpctrain"),
        ],
        loader_lines,
    ),
    (
        "loader floors",
        ["tools/loader_floor.py", "--json", "--images", "512", "--rounds", "5", "--epochs", "5"],
        floor_lines,
    ),
    ("plan", ["tools/plan_bench.py", "--json", "--repeat", "2"], plan_lines),
    (
        "checkpoint",
        ["-m", "hpctrain", "bench", "checkpoint", "--json", "--params", "2e7", "--rounds", "5"],
        checkpoint_lines,
    ),
]


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name for name, _, _ in CASES]
    parser.add_argument(
        "--only", default=",".join(names), help=f"comma-separated cases (of {','.join(names)})"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"bench-quick {now}, commit {commit()}, load average {os.getloadavg()[0]:.1f}")
    print(report_line("goal", "ratio", "verdict"), flush=True)
    failed = 0
    for name, bench_argv, lines in CASES:
        if name not in chosen:
            continue
        start = time.perf_counter()
        try:
            out = lines(run_json(bench_argv, args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
            failed += 1
            out = [report_line(name, "not measured", f"failed: {exc}")]
        for line in out:
            print(line, flush=True)
        print(f"  ({name}: {time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
