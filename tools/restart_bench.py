"""A restart's seconds by phase on the dev cluster: a `kill -9` of one rank of a 2-node DDP run.

    eval "$(tools/dev-cluster env)"
    .venv/bin/python tools/restart_bench.py [--rounds 3] [--variants before,cold,warm]
        [--before REV] [--work DIR]

Each round submits one job per variant (the demo config, demo-sized model, on tiny generated
shards, `slurm.nodes=2`, one task per node, a checkpoint every 10 steps), waits for step 15,
kills rank 1's trainer with SIGKILL and waits for the restarted attempt's first step; then
cancels the job. The variants of a round run one after another, in alternating order from
round to round, so that a machine's drift touches them alike. Prints every restart's phases
(`resilience/recovery.py`: the same figures `hpctrain status --goodput` shows) and the
medians per variant side by side, with the seconds from the kill (this script's clock) to
the first step, and the machine's load average.

The variants (`--variants`, comma-separated; `NAME=KEY=VALUE;KEY=VALUE` for your own):
  before the code of git revision `--before` (default: where this branch left main), its
         script rendered and run by it (exported to a temporary folder, first on PYTHONPATH):
         it records no phases but its trainer's, so only those and the totals are shown
  cold   this code with the probe before every attempt and each rank a fresh interpreter
         (`slurm.forkserver=false slurm.probe_after_kill=true`)
  warm   this code's defaults: ranks forked from the node's warm process, no probe after a
         SIGKILL, the next attempt begun and placed by the step that decided the restart
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hpctrain.observe.timeline import read_timeline  # noqa: E402
from hpctrain.resilience.goodput_report import running_recovery  # noqa: E402
from hpctrain.resilience.records import read_records  # noqa: E402
from hpctrain.resilience.recovery import PHASE_LABELS, PHASES  # noqa: E402

VARIANTS = {
    "before": (),
    "cold": ("slurm.forkserver=false", "slurm.probe_after_kill=true"),
    "warm": (),
}


def export(rev: str, dest: Path) -> Path:
    """`rev`'s src/ under dest (a PYTHONPATH entry that runs that revision's hpctrain)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src/hpctrain"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src"


def run(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    if done.returncode:
        raise SystemExit(f"restart_bench: {' '.join(args[:4])} ... exited {done.returncode}:\n"
                         f"{done.stderr[-2000:]}")  # fmt: skip
    return done


def make_shards(work: Path) -> Path:
    shards = work / "shards"
    if (shards / "train" / "index.json").exists():
        return shards
    images = work / "images"
    run(sys.executable, str(REPO / "tools" / "make_demo_data.py"), str(images),
        "--num-images", "480", "--size", "32", "--seed", "1")  # fmt: skip
    run(sys.executable, "-m", "hpctrain", "convert", str(images), str(shards),
        "--val-fraction", "0.1", "--samples-per-shard", "48", "--shuffle", "--seed", "0")  # fmt: skip
    return shards


def wait_for(what: str, check, timeout: float, poll: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"restart_bench: timed out after {timeout:.0f} s waiting for {what}")


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines[-5:]:
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue
    return max(steps)


def rank_pid(run_dir: Path, attempt: int, rank: int) -> int | None:
    """The pid of `rank`'s trainer, from its watcher's record (alive, or None)."""
    path = run_dir / "slurm" / "attempts" / str(attempt) / f"rank-{rank}.json"
    try:
        pid = int(json.loads(path.read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid


def one_restart(
    work: Path, shards: Path, name: str, extra: tuple[str, ...], n: int, src: Path | None
) -> dict:
    """One job of variant `name` (`src`: the hpctrain to run, else this checkout's)."""
    run_dir = work / f"run-{name}-{n}"
    env = {**os.environ, "PYTHONPATH": str(src or REPO / "src")}
    shutil.rmtree(run_dir, ignore_errors=True)
    script = work / f"job-{name}-{n}.sbatch"
    overrides = [
        f"run_dir={run_dir}", f"data.train={shards / 'train' / 'index.json'}", "data.val=",
        "checkpoint.monitor=", "checkpoint.keep_best=0", "checkpoint.every_steps=10",
        "train.max_steps=100000", "train.log_every=1", "train.precision=fp32",
        "slurm.profile=local-dev", "slurm.nodes=2", "slurm.gpus_per_node=1", *extra,
    ]  # fmt: skip
    run(sys.executable, "-m", "hpctrain", "sbatch", str(REPO / "configs" / "demo.yaml"),
        *overrides, "-o", str(script), cwd=REPO, env=env)  # fmt: skip
    job = run("sbatch", "--parsable", str(script), cwd=REPO, env=env).stdout.strip()
    try:
        wait_for("step 15", lambda: last_step(run_dir) >= 15, 300)
        pid = wait_for("rank 1's trainer", lambda: rank_pid(run_dir, 1, 1), 30)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)

        def restarted() -> dict | None:
            if src is not None:  # older code: no phases but the trainer's
                return old_recovery(run_dir, killed)
            found = running_recovery(run_dir, read_records(run_dir))
            return found if found and found.get("to") == "first_step" else None

        found = wait_for("the restart's first step", restarted, 300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    first = next(r for r in read_timeline(run_dir) if r.get("kind") == "first_step"
                 and r["time"] > killed) if src is None else found  # fmt: skip
    found["kill_to_first_step_s"] = first["time"] - killed
    found["load"] = os.getloadavg()[0]
    return found


def old_recovery(run_dir: Path, killed: float) -> dict | None:
    """What an older revision's files tell of its restart: the trainer's start-up phases
    (timeline.jsonl) and the end of the first step after the kill (its metrics record)."""
    startups = [r for r in read_timeline(run_dir) if r.get("kind") == "startup"
                and r["time"] > killed]  # fmt: skip
    steps = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "train" and record.get("time", 0) > killed:
                    steps.append(record)
    if not startups or not steps:
        return None
    startup = startups[0]
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    phases.update(startup.get("phases") or {})
    phases["first_step"] = steps[0]["time"] - startup["time"]
    return {"phases": phases, "time": steps[0]["time"], "total_s": None}


def table(results: dict[str, list[dict]]) -> list[str]:
    names = list(results)
    lines = [f"{'phase (median s)':<26}" + "".join(f"{n:>10}" for n in names)]

    def med(name: str, get) -> str:  # type: ignore[no-untyped-def]
        values = [v for v in (get(r) for r in results[name]) if isinstance(v, (int, float))]
        return f"{statistics.median(values):10.2f}" if values else f"{'-':>10}"

    for phase in PHASES:
        lines.append(f"{PHASE_LABELS[phase]:<26}" + "".join(
            med(n, lambda r, p=phase: r["phases"].get(p)) for n in names))  # fmt: skip
    lines.append(f"{'failure to first step':<26}" + "".join(
        med(n, lambda r: r.get("total_s")) for n in names))  # fmt: skip
    lines.append(f"{'kill -9 to first step':<26}" + "".join(
        med(n, lambda r: r.get("kill_to_first_step_s")) for n in names))  # fmt: skip
    lines.append(f"{'load average (1 min)':<26}" + "".join(
        med(n, lambda r: r.get("load")) for n in names))  # fmt: skip
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="before,cold,warm")
    parser.add_argument("--before", default="", help="the revision of `before` (default: "
                        "git merge-base HEAD main)")  # fmt: skip
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit('restart_bench: no SLURM_CONF: eval "$(tools/dev-cluster env)" first')
    variants: dict[str, tuple[str, ...]] = {}
    for item in args.variants.split(","):
        name, _, spec = item.partition("=")
        variants[name] = tuple(spec.split(";")) if spec else VARIANTS[name]
    work = args.work or Path(tempfile.mkdtemp(prefix="restart-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shards = make_shards(work)
    before = args.before or run("git", "-C", str(REPO), "merge-base", "HEAD", "main").stdout.strip()
    old_src = (
        export(before, Path(tempfile.mkdtemp(prefix="restart-bench-src-")))
        if "before" in variants
        else None
    )
    print(f"before: {before}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for n in range(args.rounds):
        order = list(variants) if n % 2 == 0 else list(reversed(variants))
        for name in order:
            found = one_restart(work, shards, name, variants[name], n,
                                old_src if name == "before" else None)  # fmt: skip
            results[name].append(found)
            phases = " ".join(
                f"{p}={v:.2f}" for p, v in found["phases"].items() if isinstance(v, float)
            )
            print(f"round {n} {name}: kill->first step {found['kill_to_first_step_s']:.2f} s "
                  f"(load {found['load']:.1f}): {phases}", flush=True)  # fmt: skip
    print("\n".join(table(results)))
    print(f"runs in {work}")
    if old_src is not None:
        shutil.rmtree(old_src.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
