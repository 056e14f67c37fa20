"""What only a GPU can show, checked by `tools/gpu_bench.sh` before its benchmarks: one line
per check, `check NAME: ok ...` or `check NAME: FAILED ...` (issue #38, "The GPU script").

    python -m hpctrain.bench.gpu_checks WORK [--device cuda|cpu] [--dry-run] [--only a,b]

- `signals`: SLURM signals every process of a job step (`--signal`'s USR2 before the time
  limit, TERM, `scancel --signal=USR1`). On a GPU the loader's workers come from a
  forkserver (CUDA is up): a live run of 2 processes (1 on a one-GPU machine) gets USR1 on
  its whole process group and must train on to more logged steps, then USR2 and must save
  and exit for requeue (75), never fail with a dead worker.
- `flex`: a `causal_lm` run with per-document attention (`data.document_mask`, the default)
  compiles flex attention on Ampere and newer: it must train with finite losses (or fall
  back to SDPA with its log line, where no C toolchain is found).
- `deterministic`: `train.deterministic=true` on a ResNet, whose backward has CUDA ops
  without deterministic kernels: refused up front in one line (exit 2) or trained with a
  warning, never a crash at the first backward.

Each check is a small function of (work folder, device, number of GPUs) returning its line:
what it expects is written once, in its `judge_*` function. With `--device cpu` the same runs
happen on the CPU (gloo, fork-started workers): how a test exercises the machinery here.
`--dry-run` builds each check's Trainer on the CPU instead (`hpctrain.train.dry_run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.bench.gpu_report import usable_cpus

REQUEUE_EXIT = 75  # hpctrain.train.preemption.REQUEUE_EXIT_CODE, without importing torch
WAIT_S = 240.0  # the most a check waits for a run to reach a point (start-up and compile)


@dataclass(frozen=True)
class Run:
    """A finished (or stopped) run of a check: its exit code, output and folder."""

    returncode: int
    output: str
    run_dir: Path

    def losses(self) -> list[float]:
        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.exists():
            return []
        return [
            json.loads(line)["loss"]
            for line in metrics.read_text().splitlines()
            if '"kind": "train"' in line
        ]


def command(config: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "hpctrain", "train", str(config), "--nproc", str(nproc)]


def write_config(work: Path, name: str, overrides: list[str]) -> Path:
    """`work/NAME.yaml`: the default config with `overrides` (every key the check needs)."""
    from hpctrain.config import config_to_yaml, load_config

    path = work / f"{name}.yaml"
    path.write_text(config_to_yaml(load_config(None, overrides)))
    return path


def common_overrides(run_dir: Path, device: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "data.val=",
        "train.max_epochs=0",
        "train.eval_every=0",
        "train.log_every=1",
        "train.warmup_steps=0",
        f"train.precision={'bf16' if device == 'cuda' else 'fp32'}",
        "checkpoint.every_steps=0",
        "checkpoint.final=false",
        "checkpoint.resume=none",
        "logging.progress=lines",
    ]


def run_to_end(config: Path, nproc: int, run_dir: Path, timeout_s: float = WAIT_S) -> Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        proc = subprocess.run(
            command(config, nproc), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Run(-1, f"timed out after {timeout_s:.0f} s\n{out}", run_dir)
    return Run(proc.returncode, proc.stdout + proc.stderr, run_dir)


# -- signals ---------------------------------------------------------------------------------


def signals_overrides(shards: Path, run_dir: Path, device: str) -> list[str]:
    """A small CNN fed by loader workers, long enough to be signalled twice."""
    return [
        *common_overrides(run_dir, device),
        "task=image_classification",
        "model.name=small_cnn",
        "model.image_size=64",
        f"data.train={shards / 'index.json'}",
        "data.batch_size=32",
        f"data.workers_per_rank={max(1, min(4, usable_cpus() // 2 - 1))}",
        "data.shuffle_buffer=64",
        "train.max_steps=100000",
    ]


def check_signals(work: Path, shards: Path, device: str, num_gpus: int) -> str:
    """USR1 to the whole process group of a live run (trains on), then USR2 (saves, 75)."""
    nproc = 2 if device == "cpu" else max(1, min(2, num_gpus))
    run_dir = work / "signals"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = write_config(work, "signals", signals_overrides(shards, run_dir, device))
    log = (work / "signals.log").open("w")
    proc = subprocess.Popen(
        command(config, nproc), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: dict[str, int] = {}
    try:
        seen["before"] = wait_for_steps(run_dir, proc, 2)
        os.killpg(proc.pid, signal.SIGUSR1)  # scancel --signal=USR1: dump stacks, train on
        seen["after_usr1"] = wait_for_steps(run_dir, proc, seen["before"] + 3)
        os.killpg(proc.pid, signal.SIGUSR2)  # --signal=USR2@90: save and requeue
        returncode = proc.wait(timeout=WAIT_S)
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        code = proc.poll()
        returncode = -1 if code is None else code
        seen["timeout"] = 1
        log.write(f"\ngpu_checks: {exc}\n")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    output = (work / "signals.log").read_text()
    return judge_signals(returncode, output, run_dir, seen, nproc)


def wait_for_steps(run_dir: Path, proc: subprocess.Popen[Any], count: int) -> int:
    """Wait until `count` training records are logged; their number. TimeoutError when the
    run ends or takes longer than WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        logged = len(Run(0, "", run_dir).losses())
        if logged >= count:
            return logged
        if proc.poll() is not None:
            raise TimeoutError(f"the run ended (exit {proc.returncode}) at {logged} steps")
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} steps logged in {WAIT_S:.0f} s")


def judge_signals(
    returncode: int, output: str, run_dir: Path, seen: dict[str, int], nproc: int
) -> str:
    steps = f"{seen.get('before', 0)} steps, USR1, {seen.get('after_usr1', 0)} steps, USR2"
    if "timeout" in seen or "after_usr1" not in seen:
        return f"FAILED: {nproc} process(es) did not train on after USR1 ({steps}); " + _tail(
            output
        )
    if "loader worker" in output and ("exited unexpectedly" in output or "died" in output):
        return f"FAILED: a loader worker died ({steps}): " + _tail(output)
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    if returncode != REQUEUE_EXIT or not saved:
        return (
            f"FAILED: exit {returncode} after USR2 (expected {REQUEUE_EXIT} with a saved "
            f"checkpoint; saved: {saved or 'none'}); " + _tail(output)
        )
    return f"ok ({nproc} process(es): {steps} -> saved {saved[-1]}, exit {REQUEUE_EXIT})"


# -- flex attention ----------------------------------------------------------------------------


def flex_overrides(index: Path, run_dir: Path, device: str) -> list[str]:
    return [
        *common_overrides(run_dir, device),
        "task=causal_lm",
        "model.name=gpt-tiny",
        f"data.train={index}",
        "data.seq_len=256",
        "data.batch_size=8",
        "data.workers_per_rank=1",
        "data.shuffle_buffer=16",
        "data.document_mask=true",
        "train.max_steps=4",
        "train.compile=false",  # flex attention compiles itself, whatever this says
    ]


def token_index(work: Path) -> Path:
    from hpctrain.bench.gpu_lm import write_token_shards

    return write_token_shards(work / "tokens", 200_000, 512, num_shards=2)


def check_flex(work: Path, device: str, num_gpus: int) -> str:
    """A few steps of a GPT on packed documents (per-document attention)."""
    run_dir = work / "flex"
    config = write_config(work, "flex", flex_overrides(token_index(work), run_dir, device))
    return judge_flex(run_to_end(config, 1, run_dir))


def judge_flex(run: Run) -> str:
    losses = run.losses()
    if run.returncode != 0:
        return f"FAILED: exit {run.returncode}: " + _tail(run.output)
    if not losses or not all(math.isfinite(x) for x in losses):
        return f"FAILED: losses {losses}"
    fallback = [line for line in run.output.splitlines() if "sdpa" in line.lower()]
    how = f"fell back: {fallback[-1].strip()}" if fallback else "per-document attention"
    return f"ok ({len(losses)} steps, {how}, final loss {losses[-1]:.3f})"


# -- deterministic -----------------------------------------------------------------------------


def deterministic_overrides(shards: Path, run_dir: Path, device: str) -> list[str]:
    return [
        *common_overrides(run_dir, device),
        "task=image_classification",
        "model.name=resnet18",
        "model.image_size=64",
        f"data.train={shards / 'index.json'}",
        "data.batch_size=16",
        "data.workers_per_rank=1",
        "data.shuffle_buffer=16",
        "train.max_steps=2",
        "train.deterministic=true",
    ]


def check_deterministic(work: Path, shards: Path, device: str, num_gpus: int) -> str:
    run_dir = work / "deterministic"
    overrides = deterministic_overrides(shards, run_dir, device)
    return judge_deterministic(
        run_to_end(write_config(work, "deterministic", overrides), 1, run_dir), device
    )


def judge_deterministic(run: Run, device: str) -> str:
    """Refused in one line naming the key (exit 2), or trained with a warning naming it."""
    lines = [line for line in run.output.splitlines() if "deterministic" in line]
    if run.returncode == 2 and lines:
        return f"ok (refused: {lines[-1].strip()})"
    if run.returncode == 0 and run.losses():
        if device != "cuda":
            return f"ok (trained, {device}: deterministic kernels exist)"
        if lines:
            return f"ok (warned and trained: {lines[-1].strip()})"
        return "FAILED: trained on CUDA without a word about train.deterministic"
    return f"FAILED: exit {run.returncode}: " + _tail(run.output)


def _tail(output: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-lines:])


# -- the command -------------------------------------------------------------------------------


def dry_run(work: Path, shards: Path, num_gpus: int) -> dict[str, str]:
    """Each check's config, its Trainer built on the CPU for this node's GPUs."""
    from hpctrain.bench.gpu_vision import dry_check
    from hpctrain.config import load_config

    index = token_index(work)
    configs = {
        "signals": signals_overrides(shards, work / "signals", "cuda"),
        "flex": flex_overrides(index, work / "flex", "cuda"),
        "deterministic": deterministic_overrides(shards, work / "deterministic", "cuda"),
    }
    return {
        name: "dry run: " + dry_check(load_config(None, overrides), num_gpus)
        for name, overrides in configs.items()
    }


CHECKS: dict[str, Callable[[Path, Path, str, int], str]] = {
    "signals": check_signals,
    "flex": lambda work, shards, device, gpus: check_flex(work, device, gpus),
    "deterministic": check_deterministic,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.bench.gpu_checks")
    parser.add_argument("work", type=Path, help="work folder (WORK/shards: the image shards)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--num-gpus", type=int, default=-1, help="default: those visible")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--dry-run", action="store_true", help="build the Trainers only")
    args = parser.parse_args(argv)
    num_gpus = args.num_gpus
    if num_gpus < 0:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    work = args.work / "checks"
    work.mkdir(parents=True, exist_ok=True)
    shards = args.work / "shards"
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    if args.dry_run:
        lines = dry_run(work, shards, num_gpus)
        results = {name: lines[name] for name in chosen}
        for name, line in results.items():
            print(f"check {name:13s} {line}", flush=True)
    else:
        results = {}
        for name in chosen:
            results[name] = CHECKS[name](work, shards, args.device, num_gpus)
            print(f"check {name:13s} {results[name]}", flush=True)
    return 1 if any("FAILED" in line for line in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
