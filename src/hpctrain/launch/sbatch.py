"""Render a readable sbatch script for a training run (a pure function of its inputs).

The script runs one task per GPU under `srun`, every task running `hpctrain train`. SLURM
sends USR2 `signal_margin_s` before the time limit (to job steps, i.e. the trainers; USR1
clashes with NCCL); the trainers checkpoint together and exit with `REQUEUE_EXIT_CODE`, and
the script then requeues its own job with `scontrol requeue`, so requeueing works with plain
`sbatch` and without submitit. `#SBATCH --requeue` lets SLURM requeue it on node failure or
preemption too.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from hpctrain.config import Config, with_overrides
from hpctrain.launch.profiles import ClusterProfile, JobSpec, resolve_job
from hpctrain.launch.safety import check_argument, check_path, check_setup_line, check_token

# SLURM before 23.02 does not export the job's end time; the trainer's deadline check
# (checkpoint.deadline_margin_s) reads it. Refreshed on every (re)start of the job.
END_TIME_LINES = (
    'if [ -z "${SLURM_JOB_END_TIME:-}" ]; then',
    '    SLURM_JOB_END_TIME=$(date -d "$(squeue -h -j "$SLURM_JOB_ID" -o %e)" +%s 2>/dev/null) && export SLURM_JOB_END_TIME',
    "fi",
)

# srun ends every task of the step as soon as one exits non-zero, instead of letting the others
# wait in a collective until train.collective_timeout_s (or hold the allocation when hung).
SRUN_KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"

# Hugging Face, W&B and friends must never try the network from a compute node.
OFFLINE_ENV = (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("WANDB_MODE", "offline"),
)


def sbatch_options(job: JobSpec, *, log_path: str) -> list[tuple[str, str | None, str]]:
    """(option, value or None for a flag, comment) in script order, every value checked."""
    opts: list[tuple[str, str | None, str]] = [
        ("job-name", check_token(job.job_name, "job name"), ""),
    ]
    if job.account:
        opts.append(("account", check_token(job.account, "slurm.account"), ""))
    if job.partition:
        opts.append(("partition", check_token(job.partition, "slurm.partition"), ""))
    if job.constraint:
        opts.append(
            ("constraint", check_token(job.constraint, "slurm.constraint", constraint=True), "")
        )
    if job.qos:
        opts.append(("qos", check_token(job.qos, "slurm.qos"), ""))
    opts += [
        ("nodes", str(job.nodes), ""),
        ("ntasks-per-node", str(job.tasks_per_node), "one task per GPU"),
    ]
    if job.gpus_per_node:
        opts.append(("gres", f"gpu:{job.gpus_per_node}", ""))
    opts.append(("cpus-per-task", str(job.cpus_per_task), "loader workers of each task"))
    if job.hint:
        opts.append(("hint", check_token(job.hint, "hint"), "physical cores only"))
    opts += [
        ("time", job.time, ""),
        (
            "signal",
            f"USR2@{job.signal_margin_s}",
            "checkpoint this long before the limit (USR1 clashes with NCCL)",
        ),
        ("requeue", None, "the job may be requeued (preemption, node failure, by itself)"),
        ("open-mode", "append", "a requeued job appends to its log"),
        ("output", check_path(log_path, "log path"), "stdout and stderr of all tasks"),
    ]
    return opts


def render_sbatch(
    job: JobSpec,
    *,
    config_path: str,
    overrides: Sequence[str],
    run_dir: str,
    python: str,
    log_dir: str = "",
    description: str = "",
) -> str:
    """The sbatch script for `job` training `config_path` with `overrides` into `run_dir`.

    Args:
        job: the resolved job (see `resolve_job`).
        config_path: the config file the tasks load (absolute, or relative to the submit dir).
        overrides: `key=value` arguments passed to every `hpctrain train` task.
        run_dir: the run folder; may use `$SCRATCH`-style variables (expanded on the node).
        python: the interpreter of the environment the job uses.
        log_dir: a literal folder for the job log; empty: `%x-%j.out` in the submit dir
            (`#SBATCH` lines cannot expand variables).
        description: a comment line naming where the job comes from.

    Raises:
        LaunchError: a value that cannot be written into a script safely.
    """
    # Imported here: hpctrain.train imports torch (seconds), which `--help` need not pay.
    from hpctrain.train.preemption import REQUEUE_EXIT_CODE

    check_path(config_path, "config path")
    check_path(run_dir, "run_dir")
    check_path(python, "python")
    if job.cache_root:
        check_path(job.cache_root, "cache_root")
    for i, arg in enumerate(overrides):
        check_argument(arg, f"override[{i}]")
    for i, line in enumerate(job.setup):
        check_setup_line(line, f"slurm.setup[{i}]")
    if log_dir:
        check_path(log_dir, "log_dir")
        if "$" in log_dir:
            log_dir = ""  # #SBATCH cannot expand it; fall back to the submit dir
    log_path = f"{log_dir.rstrip('/')}/%j.out" if log_dir else "%x-%j.out"

    lines = ["#!/bin/bash"]
    lines.append(f"# hpctrain training job, cluster profile {job.profile}.")
    if description:
        lines.append(f"# {check_setup_line(description, 'description')}")
    lines.append("# Edit freely; submit with: sbatch THIS_FILE")
    options = sbatch_options(job, log_path=log_path)
    width = max(len(f"#SBATCH --{k}" + (f"={v}" if v is not None else "")) for k, v, _ in options)
    for key, value, comment in options:
        text = f"#SBATCH --{key}" + (f"={value}" if value is not None else "")
        lines.append(f"{text:<{width}}  # {comment}" if comment else text)
    lines += [
        "",
        "set -uo pipefail",
        "",
        "# Paths: runs and caches on $SCRATCH (fast, purged when unused), code and env on $WORK.",
        f'RUN_DIR="{run_dir}"',
        f'CONFIG="{config_path}"',
        f'PYTHON="{python}"',
    ]
    if job.cache_root:
        lines.append(f'CACHE_DIR="{job.cache_root}"')
    lines += [
        f"MAX_REQUEUES={job.max_requeues}",
        f"REQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE}  # the trainer checkpointed and asks to be requeued",
        "",
        "# Compute nodes have no internet: nothing may try to download.",
        "export " + " ".join(f"{k}={v}" for k, v in OFFLINE_ENV),
    ]
    if job.cache_root:
        lines.append('export TORCH_HOME="$CACHE_DIR/torch" HF_HOME="$CACHE_DIR/huggingface"')
    if job.setup:
        lines += ["", "# Environment"]
        lines += list(job.setup)
    args = " ".join(shlex.quote(a) for a in overrides)
    lines += [
        "",
        'mkdir -p "$RUN_DIR/slurm" && chmod 700 "$RUN_DIR/slurm"',
        'echo "$SLURM_JOB_ID" > "$RUN_DIR/slurm/job_id"',
        'echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
        "# SLURM before 23.02 does not export the end time the trainer's deadline check reads.",
        *END_TIME_LINES,
        "",
        "# One task per GPU, all running the same command; ranks come from SLURM_PROCID/LOCALID.",
        "# A task that fails (also one whose collective timed out on a hung rank) ends them all.",
        f'srun {SRUN_KILL_ON_BAD_EXIT} "$PYTHON" -m hpctrain train "$CONFIG" "run_dir=$RUN_DIR"'
        + (f" {args}" if args else ""),
        "status=$?",
        "",
        # The requeue policy; its Python twin is launch/submit.py `requeue_this_job` (change
        # both; tests/launch/test_requeue_policy.py checks they agree).
        'if [ "$status" -eq "$REQUEUE_EXIT_CODE" ]; then',
        "    # Only a running job requeues itself: scancel also sends TERM (the trainers then",
        "    # save and exit 75), and `scontrol requeue` would bring a cancelled job back.",
        '    state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)',
        '    if [ "$state" != RUNNING ]; then',
        '        echo "hpctrain: checkpoint saved; job $SLURM_JOB_ID is ${state:-gone}, not requeueing" >&2',
        '    elif [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
        '        echo "hpctrain: checkpoint saved; requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '        echo "hpctrain: scontrol requeue failed; resubmit this script to resume" >&2',
        "    else",
        '        echo "hpctrain: checkpoint saved but $MAX_REQUEUES requeues done (slurm.max_requeues)" >&2',
        "    fi",
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def render_profile_template(profile: ClusterProfile) -> str:
    """The readable starting script in slurm/<profile>.sbatch (demo config, placeholders)."""
    project = f"myproject{profile.account_suffix}" if profile.account_suffix else ""
    cfg = with_overrides(
        Config(),
        [
            "run_dir=demo",
            f"slurm.profile={profile.name}",
            f"slurm.account={project}",
        ],
    )
    job = resolve_job(cfg, profile)
    work = "$WORK" if profile.name.startswith("jean-zay") else "$HOME"
    return render_sbatch(
        job,
        config_path=f"{work}/hpctrain/configs/demo.yaml",
        overrides=[],
        run_dir=f"{profile.run_root}/$SLURM_JOB_NAME",
        python=f"{work}/hpctrain/.venv/bin/python",
        description=f"{profile.description}; generated from configs/clusters/{profile.name}.yaml",
    )
