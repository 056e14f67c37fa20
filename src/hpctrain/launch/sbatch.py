"""Render a readable sbatch script for a training run (a pure function of its inputs).

The script trains in *attempts* inside its allocation (docs/clusters.md, "When a rank dies or
a node goes bad"): before each, a health probe on every node (`resilience/probe.py`) and the
choice of nodes; then one task per GPU under `srun`, each `hpctrain train` under a watcher
that records how it ended (`resilience/watch.py`); after it, `python -m hpctrain.resilience.attempts
end` decides: done, restart here from the newest committed checkpoint, requeue (with the bad
node excluded), or stop (`resilience/restart_policy.py`). SLURM sends USR2 `signal_margin_s`
before the time limit (to job steps, i.e. the trainers; USR1 clashes with NCCL); the trainers
checkpoint together and exit with `REQUEUE_EXIT_CODE`, and the script then requeues its own
job with `scontrol requeue`, so requeueing works with plain `sbatch` and without submitit.
`#SBATCH --requeue` lets SLURM requeue it on preemption too. The submitit job runs this same
script (`launch/submit.py`): the loop exists once.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hpctrain.config import Config, with_overrides
from hpctrain.launch.container import bind_source, exec_words
from hpctrain.launch.profiles import ClusterProfile, JobSpec, resolve_job
from hpctrain.launch.script_values import check_argument, check_path, check_setup_line, check_token

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
    spares = f"{job.nodes} to train on + {job.spare_nodes} spare" if job.spare_nodes else ""
    opts += [
        ("nodes", str(job.allocated_nodes), spares),
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
        (
            "no-kill",
            None,
            "a failed node does not end the job: the next attempt goes on without it",
        ),
        ("open-mode", "append", "a requeued job appends to its log"),
        ("output", check_path(log_path, "log path"), "stdout and stderr of all tasks"),
    ]
    return opts


@dataclass(frozen=True)
class SweepPoint:
    """One task of a job array: its overrides and its own run folder."""

    overrides: tuple[str, ...]
    run_dir: str


def render_sbatch(
    job: JobSpec,
    *,
    config_path: str,
    overrides: Sequence[str],
    run_dir: str,
    python: str,
    log_dir: str = "",
    description: str = "",
    sweep: Sequence[SweepPoint] = (),
    max_parallel: int = 0,
) -> str:
    """The sbatch script for `job` training `config_path` with `overrides` into `run_dir`.

    Args:
        job: the resolved job (see `resolve_job`); with `job.container` the tasks run in it.
        config_path: the config file the tasks load (absolute, or relative to the submit dir).
        overrides: `key=value` arguments passed to every `hpctrain train` task.
        run_dir: the run folder; may use `$SCRATCH`-style variables (expanded on the node).
        python: the interpreter of the environment the job uses (unused with a container).
        log_dir: a literal folder for the job log; empty: `%x-%j.out` in the submit dir
            (`#SBATCH` lines cannot expand variables).
        description: a comment line naming where the job comes from.
        sweep: with two or more points, a job array: task i trains with `sweep[i]`'s
            overrides (after `overrides`) into its own run folder.
        max_parallel: at most this many array tasks at once (SLURM's `%N`); 0: no limit.

    Raises:
        LaunchError: a value that cannot be written into a script safely.
    """
    log_dir = _check_inputs(job, config_path, overrides, run_dir, python, log_dir, sweep)
    log_path = f"{log_dir.rstrip('/')}/%j.out" if log_dir else "%x-%j.out"
    array = _array_option(len(sweep), max_parallel) if len(sweep) > 1 else ""
    return "\n".join(
        [
            *_header_lines(job, log_path, description, array),
            *_environment_lines(job, config_path, run_dir, python),
            *_sweep_lines(sweep if array else ()),
            *_start_lines(job),
            *_launch_lines(job, config_path, run_dir, overrides, with_sweep=bool(array)),
            *attempt_loop_lines(job),
            *_requeue_lines(),
        ]
    )


def _check_inputs(
    job: JobSpec,
    config_path: str,
    overrides: Sequence[str],
    run_dir: str,
    python: str,
    log_dir: str,
    sweep: Sequence[SweepPoint],
) -> str:
    """Refuse what cannot be written into a script safely; the log folder #SBATCH can use."""
    check_path(config_path, "config path")
    check_path(run_dir, "run_dir")
    check_path(python, "python")
    for i, arg in enumerate(overrides):
        check_argument(arg, f"override[{i}]")
    for i, line in enumerate(job.setup):
        check_setup_line(line, f"slurm.setup[{i}]")
    if job.container:
        check_path(job.container, "slurm.container")
        for i, bind in enumerate(job.container_binds):
            check_path(bind, f"container bind[{i}]")
    for i, point in enumerate(sweep):
        check_path(point.run_dir, f"sweep[{i}] run_dir")
        for arg in point.overrides:
            check_argument(arg, f"sweep[{i}]")
    if log_dir:
        check_path(log_dir, "log_dir")
        if "$" in log_dir:
            return ""  # #SBATCH cannot expand it; fall back to the submit dir
    return log_dir


def _array_option(num_tasks: int, max_parallel: int) -> str:
    """SLURM's --array value: every sweep point, at most `max_parallel` running at once."""
    return f"0-{num_tasks - 1}" + (f"%{max_parallel}" if max_parallel else "")


def _header_lines(job: JobSpec, log_path: str, description: str, array: str) -> list[str]:
    lines = ["#!/bin/bash", f"# hpctrain training job, cluster profile {job.profile}."]
    if description:
        lines.append(f"# {check_setup_line(description, 'description')}")
    lines.append("# Edit freely; submit with: sbatch THIS_FILE")
    if job.spare_reason:  # how many spares slurm.spare_nodes=auto chose, and why
        lines.append(f"# {' '.join(job.spare_reason.split())}")
    options = sbatch_options(job, log_path=log_path)
    if array:
        options.append(("array", array, "one task per sweep point, %N: at most N at once"))
    width = max(len(f"#SBATCH --{k}" + (f"={v}" if v is not None else "")) for k, v, _ in options)
    for key, value, comment in options:
        text = f"#SBATCH --{key}" + (f"={value}" if value is not None else "")
        lines.append(f"{text:<{width}}  # {comment}" if comment else text)
    return lines


def _environment_lines(job: JobSpec, config_path: str, run_dir: str, python: str) -> list[str]:
    lines = [
        "",
        "set -uo pipefail",
        "",
        "# Paths: runs and caches on $SCRATCH (fast, purged when unused), code and env on $WORK.",
        f'RUN_DIR="{run_dir}"',
        f'CONFIG="{config_path}"',
    ]
    if job.container:
        lines.append(f'CONTAINER="{job.container}"  # the trainer runs inside this image')
    else:
        lines.append(f'PYTHON="{python}"')
    lines += ["", *environment_lines(job)]
    if job.setup:
        lines += ["", "# Environment", *job.setup]
    return lines


def environment_lines(job: JobSpec, *, tasks: bool = True) -> list[str]:
    """The variables every job of `job` exports, before the site's setup lines.

    The one source of the job's environment: the script `hpctrain sbatch` renders, both
    scripts of a submitit job (its batch step's and the loop it runs) and an eval/predict
    job's, and a conversion's job arrays (`tasks=False`: one process, no srun, no GPU:
    only the offline switches and the caches).
    """
    lines = [
        "# Compute nodes have no internet: nothing may try to download.",
        "export " + " ".join(f"{k}={v}" for k, v in OFFLINE_ENV),
    ]
    if job.cache_root:
        root = check_path(job.cache_root, "cache_root")
        lines += [
            "# torch hub and Hugging Face caches under the profile's cache_root, unless you set",
            "# them where you submit (download there on the login node: docs/clusters.md).",
            f'export TORCH_HOME="${{TORCH_HOME:-{root}/torch}}" HF_HOME="${{HF_HOME:-{root}/huggingface}}"',
        ]
    if not tasks:
        return lines
    lines += [
        "# srun from SLURM 22.05 to 23.11 ignores the job's --cpus-per-task: without this a rank",
        "# and all its loader workers share one CPU. (Every srun below passes it too.)",
        'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
        "# CUDA's caching allocator grows its segments instead of fragmenting (unless you chose).",
        'export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"',
    ]
    if job.fabric:
        lines.append(
            f"export HPCTRAIN_FABRIC={job.fabric}  # NCCL must use it, not sockets (slurm.require_fabric)"
        )
    if job.fabric_interface:
        lines.append(
            f"export HPCTRAIN_FABRIC_INTERFACE={job.fabric_interface}  # the store, gloo and the probe use it"
        )
    return lines


def _sweep_lines(sweep: Sequence[SweepPoint]) -> list[str]:
    """A `case` on the array task id choosing the point's overrides and run folder."""
    if not sweep:
        return []
    lines = ["", "# The sweep point of this array task: its overrides and its own run folder."]
    lines.append('case "$SLURM_ARRAY_TASK_ID" in')
    for i, point in enumerate(sweep):
        words = " ".join(shlex.quote(a) for a in point.overrides)
        lines.append(f'    {i}) POINT=({words}); RUN_DIR="{point.run_dir}" ;;')
    lines += [
        '    *) echo "hpctrain: no sweep point $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
        "esac",
    ]
    return lines


def _start_lines(job: JobSpec) -> list[str]:
    lines = [
        "",
        'mkdir -p "$RUN_DIR/slurm" && chmod 700 "$RUN_DIR/slurm"',
        'echo "$SLURM_JOB_ID" > "$RUN_DIR/slurm/job_id"',
        "# Every job (and requeue) of this run folder, for `hpctrain status`.",
        'echo "$SLURM_JOB_ID" >> "$RUN_DIR/slurm/jobs"',
        'echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
    ]
    if job.container:
        # A bind whose source is missing makes the runtime refuse to start.
        sources = " ".join(f'"{bind_source(b)}"' for b in job.container_binds)
        if sources:
            lines.append(f"mkdir -p {sources}")
    return [
        *lines,
        "# SLURM before 23.02 does not export the end time the trainer's deadline check reads.",
        *END_TIME_LINES,
    ]


def _launch_lines(
    job: JobSpec, config_path: str, run_dir: str, overrides: Sequence[str], *, with_sweep: bool
) -> list[str]:
    """The trainer's arguments (the same for every attempt) and, with a container, its command."""
    args = " ".join(shlex.quote(a) for a in overrides)
    train_args = '"$CONFIG" "run_dir=$RUN_DIR"' + (f" {args}" if args else "")
    train_args += ' "${POINT[@]}"' if with_sweep else ""
    lines = [
        "",
        "# The arguments of `hpctrain train`, the same for every attempt of the job.",
        f"TRAIN_ARGS=({train_args})",
    ]
    if job.container:
        # $RUN_DIR, not the literal folder: an array task's run folder is its sweep point's
        others = [b for b in job.container_binds if b.rstrip("/") != run_dir.rstrip("/")]
        binds = ["$RUN_DIR", os.path.dirname(config_path) or ".", *others]
        words = exec_words(
            job.container_runtime,
            "$CONTAINER",
            list(dict.fromkeys(binds)),
            gpus=bool(job.gpus_per_node),
        )
        lines += [
            "# Every hpctrain command runs in the image, with these folders bound.",
            f"PYTHON=({' '.join(words)})",
        ]
    return lines


def _python(job: JobSpec) -> str:
    return '"${PYTHON[@]}"' if job.container else '"$PYTHON"'


def attempt_loop_lines(job: JobSpec) -> list[str]:
    """The attempts: probe, place, train, decide; again while the verdict is `restart`."""
    py = _python(job)
    probe = [
        "    # The health probe, one task per node, 3 minutes at most; a node that fails (or never",
        "    # answers) is set aside, its line says why.",
        f'    [ "$NUM_PROBE_NODES" -gt 0 ] && srun --nodelist="$PROBE_NODES" --nodes="$NUM_PROBE_NODES" --ntasks="$NUM_PROBE_NODES" --ntasks-per-node=1 --cpus-per-task=1 --time=3 ${{SLURM_GPUS_ON_NODE:+--gres=gpu:$SLURM_GPUS_ON_NODE}} {py} -m hpctrain.resilience.probe "$ATTEMPT_DIR" --gpus "${{SLURM_GPUS_ON_NODE:-0}}" "${{TRAIN_ARGS[@]}}"',
    ]  # fmt: skip
    forkserver = [
        "# A warm process per node for the whole allocation (slurm.forkserver): it imports torch",
        "# and the trainer once, and each attempt's ranks are forked from it (`attempts begin`",
        "# exports HPCTRAIN_FORKSERVER=1 for their watchers), so that a restart skips the",
        "# interpreter and its imports. A rank it cannot fork starts afresh.",
        f'srun --overlap --quiet --no-kill --kill-on-bad-exit=0 --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --mem=0 ${{SLURM_GPUS_ON_NODE:+--gres=gpu:$SLURM_GPUS_ON_NODE}} {py} -m hpctrain.resilience.forkserver -- train "${{TRAIN_ARGS[@]}}" </dev/null &',
        "FORKSERVER=$!",
        "trap 'kill \"$FORKSERVER\" 2>/dev/null' EXIT",
    ]  # fmt: skip
    return [
        "",
        "# Attempts (docs/clusters.md): train; after a failure that is not yours (a rank killed,",
        "# a lost node, a distributed error) train again in this allocation from the newest",
        "# committed checkpoint, on the nodes that pass the health probe. Each step of",
        "# `hpctrain.resilience.attempts` prints its verdict as shell variables (NEXT, EXIT, ...);",
        "# RUN_DIR/slurm/attempts.jsonl keeps one record per attempt (`hpctrain status` shows them).",
        "step() {",
        "    local out",
        f'    out=$({py} -m hpctrain.resilience.attempts "$@" "${{TRAIN_ARGS[@]}}") || {{ EXIT=$?; NEXT=stop; return 1; }}',
        '    eval "$out"',
        "}",
        "# SLURM's TERM (scancel, preemption) reaches this shell too: finish the attempt, then stop.",
        "STOPPING=",
        "trap 'STOPPING=1' TERM",
        "NEXT=restart EXIT=0 EXCLUDE= BEGUN= PLACED=",
        *(forkserver if job.forkserver else []),
        "# nodes SLURM itself took out of service (down, drained: e.g. a task it could not kill;",
        "# not responding: a node that went away)",
        'down_nodes() { sinfo -h -N -n "$SLURM_JOB_NODELIST" -t down,drain,fail,no_respond -o %N 2>/dev/null | sort -u | paste -sd, -; }',
        'while [ "$NEXT" = restart ] && [ -z "$STOPPING" ]; do',
        '    [ -n "$BEGUN" ] || step begin --down "$(down_nodes)" || break',
        *(probe if job.probe else []),
        "    # (an attempt that runs no probe was placed as it began: PLACED=1)",
        '    if [ -z "$PLACED" ]; then step place || break; [ "$NEXT" = train ] || break; fi',
        "    BEGUN= PLACED=",
        "    # One task per GPU, all running the same command; ranks come from SLURM_PROCID/LOCALID.",
        "    # A task that fails (also one its watcher ended for making no progress) ends them all.",
        "    # srun's own lines (a node failure, how each task ended) are kept for `step end`.",
        f'    {{ srun {SRUN_KILL_ON_BAD_EXIT} --nodelist="$TRAIN_NODES" --nodes="$NUM_NODES" --ntasks="$NUM_TASKS" --ntasks-per-node="$SLURM_NTASKS_PER_NODE" --cpus-per-task="$SLURM_CPUS_PER_TASK" {py} -m hpctrain.resilience.watch "$ATTEMPT_DIR" -- train "${{TRAIN_ARGS[@]}}" "${{RESUME[@]}}" 2>&1 1>&3 3>&- | (trap "" TERM INT HUP; exec awk -v out="$ATTEMPT_DIR/srun.log" \'/^srun: /{{print >> out; fflush(out)}} {{print > "/dev/stderr"; fflush("/dev/stderr")}}\'); status=${{PIPESTATUS[0]}}; }} 3>&1',
        "    # The verdict, with the nodes SLURM took out of service while the step ran (a node",
        "    # that went away); a restart's next attempt begins in the same step (BEGUN=1).",
        '    step end --status "$status" --state "$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)" --down "$(down_nodes)" || break',
        "done",
    ]  # fmt: skip


def _requeue_lines() -> list[str]:
    # What to requeue and when is decided in Python (restart_policy.decide); here only the
    # scontrol calls, which may be missing inside a container.
    return [
        "",
        'if [ "$NEXT" = requeue ] && [ -z "$STOPPING" ]; then',
        "    # Only a running job requeues itself: scancel also sends TERM (the trainers then",
        "    # save and exit 75), and `scontrol requeue` would bring a cancelled job back.",
        '    state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)',
        '    if [ "$state" != RUNNING ]; then',
        '        echo "hpctrain: job $SLURM_JOB_ID is ${state:-gone}, not requeueing" >&2',
        '    elif [ -z "$EXCLUDE" ]; then',
        '        echo "hpctrain: requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    else",
        "        # A running job's ExcNodeList cannot change: requeue it held, add the bad node(s) to",
        "        # the nodes it excludes (yours kept), release it. SLURM's TERM to this shell and its",
        "        # commands must not cut that short: ignored from here (scontrol inherits it).",
        "        mine=$(scontrol show job -o \"$SLURM_JOB_ID\" | sed -n 's/.* ExcNodeList=\\([^ ]*\\).*/\\1/p')",
        '        [ "$mine" = "(null)" ] && mine=""',
        '        echo "hpctrain: requeueing job $SLURM_JOB_ID without $EXCLUDE"',
        "        trap '' TERM",
        '        if scontrol requeuehold "$SLURM_JOB_ID"; then',
        "            for _ in $(seq 10); do",
        '                scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="${mine:+$mine,}$EXCLUDE" && break',
        "                sleep 0.5",
        "            done",
        "            for _ in $(seq 10); do",
        '                scontrol release "$SLURM_JOB_ID" && exit 0',
        "                sleep 0.5",
        "            done",
        '            echo "hpctrain: job $SLURM_JOB_ID is held: check its ExcNodeList, then scontrol release $SLURM_JOB_ID" >&2',
        "        fi",
        "    fi",
        '    echo "hpctrain: scontrol requeue failed; resubmit this script to resume" >&2',
        "fi",
        'exit "$EXIT"',
        "",
    ]


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
        run_dir=f"{profile.run_root}/runs/$SLURM_JOB_NAME",  # as runs/NAME would be placed
        python=f"{work}/hpctrain/.venv/bin/python",
        description=f"{profile.description}; generated from configs/clusters/{profile.name}.yaml",
    )
