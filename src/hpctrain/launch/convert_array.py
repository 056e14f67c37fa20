"""`hpctrain convert ... --slurm --parts N`: a conversion as SLURM job arrays, then a merge job.

Each stage of the conversion (`hpctrain.convert.parts`: `tokenize` or `list`, then `write`)
is one job array of its missing parts, `--array=...%K` throttled like a training sweep; the
next stage starts after it (`--dependency=afterok`), and one merge job after the last writes
the index and checks it. A part that fails leaves its array, and so the jobs after it,
unfinished: every job after the first has `--kill-on-invalid-dep=yes`, so a failed tokenize
(or Arrow list) stage cancels the write array and the merge instead of leaving them pending
forever (`DependencyNeverSatisfied`); the same command with `--resume` submits only the parts
that did not finish.

Rendering is a pure function of its inputs (`render_stage`, `render_merge`); `--dry-run` prints
the scripts. The job takes the profile's account notation, partition, QoS limits and setup
lines (`launch/profiles.py`), one node and one task with `--workers` CPUs, and no GPU.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import Config, with_overrides
from hpctrain.convert.options import ConvertOptions
from hpctrain.convert.parts import (
    check_parts,
    missing_parts,
    part_words,
    prepare_parts,
    stages_of,
)
from hpctrain.launch.profiles import JobSpec, LaunchError, load_profile, resolve_job
from hpctrain.launch.sbatch import environment_lines
from hpctrain.launch.script_values import (
    check_argument,
    check_path,
    check_setup_line,
    check_token,
)


@dataclass(frozen=True)
class ArrayJob:
    """How a conversion's jobs are submitted: the resolved job and where logs go."""

    job: JobSpec
    python: str  # the interpreter of the environment the jobs use
    log_dir: str  # the jobs' logs: %x-%A_%a.out (arrays), %x-%j.out (the merge)
    max_parallel: int = 0  # array tasks at once (%K); 0: no limit


def array_job(
    options: ConvertOptions,
    *,
    profile: str,
    account: str = "",
    partition: str = "",
    qos: str = "",
    time: str = "",
    log_dir: str = "",
    max_parallel: int = 0,
    python: str = "",
) -> ArrayJob:
    """The job every part runs as, from the cluster profile and these choices."""
    overrides = [f"slurm.profile={profile}", "run_dir=convert"]
    for key, value in (("account", account), ("partition", partition), ("qos", qos)):
        if value:
            overrides.append(f"slurm.{key}={value}")
    if time:
        overrides.append(f"slurm.time={time}")
    cfg = with_overrides(Config(), overrides)
    job = resolve_job(cfg, load_profile(profile))
    return ArrayJob(
        job=job,
        python=python or sys.executable,
        log_dir=log_dir or str(Path.cwd()),
        max_parallel=max_parallel,
    )


# A job whose dependency can no longer be met is cancelled (SLURM's default leaves it
# pending for ever, "DependencyNeverSatisfied"): every job of the chain after the first.
KILL_ON_INVALID_DEP = "#SBATCH --kill-on-invalid-dep=yes"


def _header(aj: ArrayJob, name: str, cpus: int, output: str, description: str) -> list[str]:
    job = aj.job
    lines = ["#!/bin/bash", f"# {check_setup_line(description, 'description')}"]
    opts = [("job-name", check_token(name, "job name"))]
    if job.account:
        opts.append(("account", check_token(job.account, "--account")))
    if job.partition:
        opts.append(("partition", check_token(job.partition, "--partition")))
    if job.constraint:
        opts.append(("constraint", check_token(job.constraint, "constraint", constraint=True)))
    if job.qos:
        opts.append(("qos", check_token(job.qos, "--qos")))
    opts += [
        ("nodes", "1"),
        ("ntasks", "1"),
        ("cpus-per-task", str(cpus)),
        ("time", job.time),
        ("output", check_path(f"{aj.log_dir.rstrip('/')}/{output}", "--log-dir")),
    ]
    lines += [f"#SBATCH --{key}={value}" for key, value in opts]
    return lines


def _body(aj: ArrayJob, words: Sequence[str], tail: str = "") -> list[str]:
    """The script's commands: `hpctrain convert WORDS` (each checked and quoted) + `tail`."""
    for i, word in enumerate(words):
        check_argument(word, f"argument {i}")
    # offline, and the profile's caches: the training job's environment (launch/sbatch.py)
    lines = ["", "set -euo pipefail", *environment_lines(aj.job, tasks=False)]
    for i, line in enumerate(aj.job.setup):
        lines.append(check_setup_line(line, f"setup[{i}]"))
    python = check_path(aj.python, "python")
    lines.append(f'exec "{python}" -m hpctrain convert {shlex.join(words)}{tail}')
    return lines


def array_option(parts: Sequence[int], max_parallel: int) -> str:
    """SLURM's --array value: the parts (ranges where consecutive), `%K` at most at once."""
    spans: list[str] = []
    for k in parts:
        if spans and spans[-1].split("-")[-1] == str(k - 1):
            spans[-1] = f"{spans[-1].split('-')[0]}-{k}"
        else:
            spans.append(str(k))
    return ",".join(spans) + (f"%{max_parallel}" if max_parallel else "")


def render_stage(
    aj: ArrayJob,
    options: ConvertOptions,
    num_parts: int,
    stage: str,
    parts: Sequence[int],
    *,
    after_another: bool = False,
) -> str:
    """The array job script of `stage` for `parts` (a pure function of its inputs).

    `after_another`: it waits for an earlier job of the chain (`--dependency=afterok`), and
    is cancelled when that one fails (`--kill-on-invalid-dep=yes`), not left pending.
    """
    lines = _header(
        aj,
        f"hpctrain-convert-{stage}",
        max(options.workers, 1),
        "%x-%A_%a.out",
        f"hpctrain convert, stage {stage} of a conversion in {num_parts} parts "
        f"(cluster profile {aj.job.profile}); one array task per part",
    )
    lines.append(f"#SBATCH --array={array_option(parts, aj.max_parallel)}")
    if after_another:
        lines.append(KILL_ON_INVALID_DEP)
    tail = f' --run-part "$SLURM_ARRAY_TASK_ID" --stage {stage}'
    return "\n".join([*lines, *_body(aj, part_words(options, num_parts), tail), ""])


def render_merge(aj: ArrayJob, options: ConvertOptions, num_parts: int) -> str:
    """The merge job script: every part's record into the index, checked."""
    lines = _header(
        aj,
        "hpctrain-convert-merge",
        1,
        "%x-%j.out",
        f"hpctrain convert, the merge of a conversion in {num_parts} parts (cluster profile "
        f"{aj.job.profile}): submitted after the parts (--dependency=afterok)",
    )
    lines.append(KILL_ON_INVALID_DEP)
    return "\n".join([*lines, *_body(aj, [*part_words(options, num_parts), "--merge"]), ""])


@dataclass(frozen=True)
class Submitted:
    """What `submit_conversion` did (or, with `dry_run`, would do)."""

    scripts: list[tuple[str, str]]  # (what, script) in submission order
    job_ids: list[str]  # empty with dry_run
    finished: bool = False  # `--resume` found the conversion done: nothing submitted


def submit_conversion(
    options: ConvertOptions, num_parts: int, aj: ArrayJob, *, dry_run: bool = False
) -> Submitted:
    """Prepare DEST, then submit each stage's missing parts and the merge, chained."""
    check_parts(options, num_parts, aj.max_parallel)
    if not dry_run and prepare_parts(options, num_parts) is not None:
        return Submitted([], [], finished=True)
    scripts: list[tuple[str, str]] = []
    for stage in stages_of(options):
        todo = list(range(num_parts)) if dry_run else missing_parts(options, num_parts, stage)
        if todo:
            script = render_stage(aj, options, num_parts, stage, todo, after_another=bool(scripts))
            scripts.append((f"stage {stage}", script))
    scripts.append(("merge", render_merge(aj, options, num_parts)))
    if dry_run:
        return Submitted(scripts, [])
    job_ids: list[str] = []
    for _what, script in scripts:
        extra = [f"--dependency=afterok:{job_ids[-1]}"] if job_ids else []
        job_ids.append(_sbatch(script, extra))
    return Submitted(scripts, job_ids)


def _sbatch(script: str, extra: list[str]) -> str:
    try:
        proc = subprocess.run(
            ["sbatch", "--parsable", *extra],
            input=script,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        raise LaunchError("sbatch: not found (is this a SLURM login node?)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError("sbatch did not answer within 60 s") from None
    if proc.returncode != 0:
        message = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"sbatch refused the conversion's job: {message}")
    return proc.stdout.strip().split(";", 1)[0]
