"""The report both GPU cases print: steady-state throughput, data wait, peak memory and MFU.

`gpu_vision` (ResNet-50, images) and `gpu_lm` (GPT, tokens) train with hpctrain and read
their run's `metrics.jsonl` the same way: the first intervals hold compilation and loader
start-up, the rest is steady state; MFU is the achieved FLOP/s per GPU (throughput per GPU x
the model's training FLOPs per image or token) against the GPU's published dense peak
(`hpctrain.models.flops.PEAK_FLOPS`). Each case adds its own header line and plan.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpctrain.models.flops import peak_flops


def peak_tflops(gpu_name: str) -> float | None:
    """The published peak of `gpu_name` (`hpctrain.models.flops.PEAK_FLOPS`) in TFLOP/s, or
    None; `HPCTRAIN_PEAK_TFLOPS` overrides."""
    override = os.environ.get("HPCTRAIN_PEAK_TFLOPS")
    if override:
        return float(override)
    peak = peak_flops(gpu_name)
    return None if peak is None else peak / 1e12


def usable_cpus() -> int:
    """CPUs this process may run on (the job's allocation under SLURM, cgroup-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    """The training records of `run_dir/metrics.jsonl`.

    Raises:
        ValueError: the run logged none.
    """
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl: no training records")
    return train


def steady_report(
    train: list[dict[str, Any]],
    plan: Any,
    *,
    unit: str,
    rate: Callable[[dict[str, Any]], float],
    flops_per_unit: float,
    extra: dict[str, Any] | None = None,
    skip_intervals: int = 2,
) -> dict[str, Any]:
    """Steady-state figures of `train` records, the first `skip_intervals` left out (all but
    the last at most).

    `plan`: a dataclass with `num_gpus` and `peak_tflops`; `unit`: `image` or `token`, what
    `rate(record)` counts per second (all ranks) and `flops_per_unit` trains; `extra`: the
    case's own figures, placed before the FLOPs.
    """
    skipped = min(skip_intervals, len(train) - 1)
    steady = train[skipped:]
    first_step = train[skipped - 1]["step"] if skipped else 0
    ranks = max(1, plan.num_gpus)
    per_s = statistics.median(rate(r) for r in steady)
    out: dict[str, Any] = {
        "plan": asdict(plan),
        "steps_measured": steady[-1]["step"] - first_step,
        f"{unit}s_per_s": per_s,
        f"{unit}s_per_s_per_gpu": per_s / ranks,
        "step_time_ms": statistics.median(r["step_time_s"] for r in steady) * 1000,
        "data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in steady),
        "data_wait_fraction_worst": max(r["data_wait_fraction_worst"] for r in steady),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in train),
        **(extra or {}),
        f"train_gflops_per_{unit}": flops_per_unit / 1e9,
        "mfu": None,
    }
    if plan.peak_tflops:
        achieved = per_s / ranks * flops_per_unit
        out["achieved_tflops_per_gpu"] = achieved / 1e12
        out["mfu"] = achieved / (plan.peak_tflops * 1e12)
    return out


def report_lines(
    r: dict[str, Any],
    *,
    unit: str,
    memory: str,
    no_mfu: str,
    step_extra: str = "",
    gflops_format: str = ".1f",
) -> list[str]:
    """The figure lines under a case's header: throughput, data wait, peak memory, MFU.

    `memory`: the peak memory line's text; `no_mfu`: what the MFU line says without a peak;
    `step_extra`: appended to the throughput line.
    """
    plan = r["plan"]
    mfu = (
        f"{r['mfu']:.1%} = achieved / peak TFLOP/s per GPU ({r['achieved_tflops_per_gpu']:.0f} / "
        f"{plan['peak_tflops']:.0f}, {plan['precision']})"
        if r["mfu"] is not None
        else no_mfu
    )
    gflops = format(r[f"train_gflops_per_{unit}"], gflops_format)
    return [
        f"{unit + 's/s:':<17}{r[f'{unit}s_per_s']:.0f} ({r[f'{unit}s_per_s_per_gpu']:.0f} per GPU), "
        f"step {r['step_time_ms']:.1f} ms{step_extra}",
        f"data wait:       data wait / step time = {r['data_wait_fraction']:.2%} "
        f"(worst rank {r['data_wait_fraction_worst']:.2%})",
        f"peak memory:     {memory}",
        f"MFU:             {mfu}; {gflops} GFLOP per trained {unit}",
    ]
