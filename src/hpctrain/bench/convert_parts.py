"""`hpctrain bench convert-parts`: a token conversion as SLURM job arrays against one process.

A generated text corpus (`--mb`, default 200 MB: files of `--file-kb` of words, each file a
document) is converted to byte-token shards twice, side by side:

- on one node: `hpctrain convert CORPUS A --tokenizer bytes --workers W`;
- as job arrays on a SLURM cluster (`SLURM_CONF`, e.g. `tools/dev-cluster`):
  `hpctrain convert CORPUS B --tokenizer bytes --slurm --parts N --profile P` (a tokenize
  array, a write array, the merge job), timed from the submission to the merge job's end.

Reported: both wall times and their ratio, the sum of the array tasks' elapsed times, and the
merge's own cost (the time `--merge` spends merging, as it prints, and its job's elapsed time
in `sacct`) against the conversion's wall time (goal: <= 5 %). The two outputs are checked
equal (indexes but their command line, and every shard's bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "a token conversion as SLURM job arrays (--parts N) against one process (--workers W)"
GOAL_MERGE_SHARE = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    parser.add_argument("--file-kb", type=int, default=100, help="file size in kB (default 100)")
    parser.add_argument("--parts", type=int, default=4, help="array tasks (default 4)")
    parser.add_argument(
        "--workers", type=int, default=2, help="--workers of the one-node run (default 2)"
    )
    parser.add_argument("--profile", default="local-dev", help="cluster profile (local-dev)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait (3600)")
    parser.add_argument("--workdir", help="where to write (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def make_corpus(folder: Path, mb: int, file_kb: int) -> int:
    """`folder/NNNNNN.txt`: words drawn from a fixed vocabulary, seeded (kept when there)."""
    import numpy as np

    done = folder / ".complete"
    if done.exists() and done.read_text() == f"{mb} {file_kb}":
        return len(list(folder.glob("*.txt")))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    vocab = np.array([f"w{i}".encode() + b" " for i in range(5000)] + [b"\n"], dtype=object)
    num_files = max(1, mb * 1000 // file_kb)
    per_word = sum(len(v) for v in vocab) / len(vocab)
    for i in range(num_files):
        words = rng.integers(0, len(vocab), int(file_kb * 1000 / per_word))
        (folder / f"{i:06d}.txt").write_bytes(b"".join(vocab[words]))
    done.write_text(f"{mb} {file_kb}")
    return num_files


def _hpctrain(*args: str, timeout: float) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode:
        raise RuntimeError(f"hpctrain {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
    return time.perf_counter() - started, proc.stdout


def _sacct(job_id: str) -> list[dict[str, str]]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,Elapsed"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return [{"id": r[0], "state": r[1].split()[0], "elapsed": r[2]} for r in rows]


def _seconds(elapsed: str) -> float:
    days, _, clock = elapsed.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def _fingerprint(dest: Path) -> dict[str, Any]:
    """The output with the command lines left out: indexes and every file's sha256."""
    out: dict[str, Any] = {}
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        name = str(path.relative_to(dest))
        if name.endswith("index.json"):
            index = json.loads(path.read_text())
            index.pop("command")
            out[name] = index
        elif not name.endswith("index.compact"):  # holds the JSON's digest: the command
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_bench(work: Path, ns: argparse.Namespace) -> dict[str, Any]:
    corpus = work / "corpus"
    num_files = make_corpus(corpus, ns.mb, ns.file_kb)
    common = [str(corpus), "--tokenizer", "bytes", "--progress", "none"]
    one, parts, logs = work / "one", work / "parts", work / "logs"
    for folder in (one, parts, logs):
        shutil.rmtree(folder, ignore_errors=True)
    logs.mkdir()
    single_s, _ = _hpctrain(
        "convert", *common[:1], str(one), *common[1:], "--workers", str(ns.workers),
        timeout=ns.timeout,
    )  # fmt: skip
    started = time.perf_counter()
    _, out = _hpctrain(
        "convert", *common[:1], str(parts), *common[1:], "--slurm", "--parts", str(ns.parts),
        "--profile", ns.profile, "--log-dir", str(logs), timeout=ns.timeout,
    )  # fmt: skip
    job_ids = re.findall(r"^job (\S+):", out, re.MULTILINE)
    merge_id = job_ids[-1]
    deadline = time.monotonic() + ns.timeout
    while True:
        states = {row["state"] for row in _sacct(merge_id)}
        if states & {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"merge job {merge_id} not finished after {ns.timeout:.0f} s")
        time.sleep(0.5)
    array_s = time.perf_counter() - started
    if states != {"COMPLETED"}:
        raise RuntimeError(f"merge job {merge_id}: {states}; logs in {logs}")
    merge_log = next(logs.glob(f"*-{merge_id}.out")).read_text()
    merge_own = float(re.search(r"merged \d+ parts in ([0-9.]+) s", merge_log).group(1))  # type: ignore[union-attr]
    tasks = {job: _sacct(job) for job in job_ids}
    task_s = sum(_seconds(r["elapsed"]) for job in job_ids[:-1] for r in tasks[job])
    merge_job_s = _seconds(tasks[merge_id][0]["elapsed"])
    same = _fingerprint(one) == _fingerprint(parts)
    return {
        "corpus_mb": sum(p.stat().st_size for p in corpus.glob("*.txt")) / 1e6,
        "files": num_files,
        "parts": ns.parts,
        "workers": ns.workers,
        "single_s": single_s,
        "array_s": array_s,
        "array_tasks_s": task_s,
        "merge_own_s": merge_own,
        "merge_job_s": merge_job_s,
        "merge_share": merge_own / array_s,
        "merge_job_share": merge_job_s / array_s,
        "identical": same,
        "jobs": job_ids,
    }


def format_results(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"token conversion of {r['corpus_mb']:.0f} MB of text ({r['files']} files), bytes "
            "tokenizer",
            f"  one node, --workers {r['workers']}:           {r['single_s']:8.1f} s wall",
            f"  SLURM, {r['parts']} array tasks + merge:      {r['array_s']:8.1f} s wall "
            f"(submit to merge end; array tasks {r['array_tasks_s']:.0f} s elapsed in all)",
            f"  ratio one node / arrays:            {r['single_s'] / r['array_s']:8.2f}x",
            f"  merge: {r['merge_own_s']:.2f} s merging ({r['merge_share']:.1%} of the "
            f"conversion), its job {r['merge_job_s']:.0f} s ({r['merge_job_share']:.1%})",
            f"  outputs identical: {r['identical']}",
            f"goal: merge <= {GOAL_MERGE_SHARE:.0%} of the conversion: "
            + ("met" if r["merge_share"] <= GOAL_MERGE_SHARE else "missed"),
        ]
    )


def run(args: argparse.Namespace) -> int:
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hpctrain-"))
    try:
        results = run_bench(work, args)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=1) if args.json else format_results(results))
    return 0 if results["identical"] else 1
