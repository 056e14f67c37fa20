"""Submission through submitit: the job's one process runs the job script's loop of attempts.

The training job does not run a task per GPU under submitit's own `srun`: its batch step runs
one process (`TrainingJob`, submitit's `use_srun=False`), and that process runs the very
script `hpctrain sbatch` renders for the job (`launch/sbatch.py`): the health probe, the
training step under `srun` (one task per GPU, each `hpctrain train`), and the decisions of
`resilience/attempts.py` between them, restarts inside the allocation and requeues included. So
plain `sbatch` and submitit share one loop. The trainer installs its own USR2/TERM handlers
(they only set a flag), saves with all ranks at a step boundary and exits
`REQUEUE_EXIT_CODE`; the script then requeues the job, and the process leaves without a
result, so submitit's client keeps waiting for the requeued job.

Eval and predict jobs (`InferenceJob`) keep submitit's usual shape: every task one rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import submitit

from hpctrain.compat_submitit import render_submission
from hpctrain.config import Config, config_to_yaml, with_overrides
from hpctrain.errors import HpctrainError, print_error_line, rank_tag
from hpctrain.launch.container import exec_words
from hpctrain.launch.prepare import slurm_folder
from hpctrain.launch.profiles import JobSpec, LaunchError
from hpctrain.launch.sbatch import (
    END_TIME_LINES,
    SRUN_KILL_ON_BAD_EXIT,
    environment_lines,
    render_sbatch,
    sbatch_options,
)
from hpctrain.launch.script_values import check_no_credential, check_path, check_setup_line
from hpctrain.resilience.records import read_records
from hpctrain.resilience.restart_policy import REQUEUE_EXIT_CODE

JOB_FILE = "job.json"
JOBS_FILE = "jobs"  # one job id a line, oldest first


class TrainingJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles: the job script's loop, run in the job's batch step."""

    def __init__(self, cfg: Config, job: JobSpec | None = None) -> None:
        self.cfg = cfg
        self.job = job

    def __call__(self) -> int:
        assert self.job is not None, "a TrainingJob is made with its JobSpec (submit())"
        run_dir = Path(self.cfg.run_dir)
        slurm = private_dir(run_dir / "slurm")
        # The config as the user resolved it at submission: the script's tasks load it.
        config = slurm / "submitted-config.yaml"
        config.write_text(config_to_yaml(self.cfg))
        script = slurm / "submitit-job.sh"
        script.write_text(job_script(self.cfg, self.job, str(config)))
        code = subprocess.run(["bash", str(script)], check=False).returncode
        records = read_records(run_dir)
        if code == 0 and records and records[-1].decision == "requeue":
            # The script requeued the job: no result, submitit's client waits for the next run.
            raise SystemExit(REQUEUE_EXIT_CODE)
        if code != 0:
            # As the tasks of `hpctrain train` do: leave with the job's exit status (sacct
            # shows it), the one line that says why is in the log already.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit's own signal handler: resubmit as is (resume=latest)."""
        return submitit.helpers.DelayedSubmission(TrainingJob(self.cfg, self.job))


def job_script(cfg: Config, job: JobSpec, config_path: str, python: str = sys.executable) -> str:
    """The script the submitit job runs: `hpctrain sbatch`'s, without the setup lines
    submitit ran before this process (module loads) and with the submitted config."""
    return render_sbatch(
        dataclasses.replace(job, setup=()),
        config_path=config_path,
        overrides=[],
        run_dir=cfg.run_dir,
        python=python,
        description="run by the submitit job (hpctrain.launch.submit.TrainingJob)",
    )


def exit_with_one_line(
    exc: HpctrainError,
    environ: Mapping[str, str] | None = None,
    *,
    verb: str = "train",
    now: bool = True,
) -> NoReturn:
    """End this task as `hpctrain <verb>` would: one line on stderr and the kind's exit code.

    A user's mistake (a bad shard, a locked run folder...) then reads in the task's log like
    the CLI's own error, and sacct shows its exit code, instead of a traceback and a pickled
    exception. HPCTRAIN_DEBUG=1 keeps the traceback as well.

    The task leaves at once, without the interpreter's shutdown (`os._exit`, as `python -m
    hpctrain` does after a requeue save): shutdown restores the default signal handlers and
    then takes seconds with torch loaded, and when every rank fails alike the TERM that `srun
    --kill-on-bad-exit=1` sends once the first has exited killed the others there, so sacct
    showed 15 instead of the error's code. `now=False` raises SystemExit instead (a caller
    in a process that goes on, such as a test).
    """
    env = os.environ if environ is None else environ
    if env.get("HPCTRAIN_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    print_error_line(verb, exc, tag=rank_tag(env))
    if not now:
        raise SystemExit(exc.exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exc.exit_code)


def check_submission(cfg: Config, job: JobSpec) -> None:
    """Every value that reaches the script or the pickled job is safe and credential-free."""
    sbatch_options(job, log_path="x")
    # Both end up in submitit's #SBATCH lines and command (the submitit folder is inside).
    check_path(cfg.run_dir, "run_dir")
    check_path(cfg.slurm.folder, "slurm.folder")
    for i, line in enumerate(job.setup):
        check_setup_line(line, f"slurm.setup[{i}]")
    for key, value in (
        *cfg.data.train_paths(),
        ("data.val", cfg.data.val),
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("run_dir", cfg.run_dir),
    ):
        check_no_credential(value, key)
    for key, value in cfg.task_options.items():
        if isinstance(value, str):
            check_no_credential(value, f"task_options.{key}")


def executor_parameters(job: JobSpec) -> dict[str, Any]:
    """AutoExecutor parameters for `job`'s tasks (eval/predict: every task one rank, under
    submitit's srun), with the same #SBATCH lines as the rendered script.

    `job.max_parallel` caps the running tasks of a job array (SLURM's `--array=...%N`).
    """
    params: dict[str, Any] = {
        "name": job.job_name,
        "nodes": job.nodes,
        "tasks_per_node": job.tasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "timeout_min": job.time_minutes,
        "slurm_signal_delay_s": job.signal_margin_s,
        # the environment of `hpctrain sbatch`'s script, from the same lines
        "slurm_setup": [*environment_lines(job), *END_TIME_LINES, *job.setup],
        "slurm_additional_parameters": {"requeue": True},
        # srun from SLURM 22.05 to 23.11 ignores the job's --cpus-per-task (issue #38)
        "slurm_srun_args": [SRUN_KILL_ON_BAD_EXIT, f"--cpus-per-task={job.cpus_per_task}"],
    }
    if job.gpus_per_node:
        params["slurm_gres"] = f"gpu:{job.gpus_per_node}"
    if job.max_parallel:
        params["slurm_array_parallelism"] = job.max_parallel
    if job.hint:
        params["slurm_additional_parameters"]["hint"] = job.hint
    for key, value in (
        ("slurm_partition", job.partition),
        ("slurm_account", job.account),
        ("slurm_qos", job.qos),
        ("slurm_constraint", job.constraint),
    ):
        if value:
            params[key] = value
    return params


def training_parameters(job: JobSpec) -> dict[str, Any]:
    """AutoExecutor parameters of a training job: one process in the batch step runs the
    job script (`TrainingJob`), which starts the tasks itself.

    submitit counts a job's results as nodes x tasks per node: it is told one of each, and
    the allocation's real shape goes to the #SBATCH lines through `additional_parameters`
    (`compat_submitit.check_compatible` checks they still override). The batch step
    exports the job's environment (`environment_lines`) and runs the site's lines (module
    loads); the job script it runs exports the same variables again (the same values).
    """
    params = executor_parameters(job)
    params.update(
        nodes=1,
        tasks_per_node=1,
        slurm_use_srun=False,
        slurm_setup=[*environment_lines(job), *job.setup],
    )
    del params["slurm_srun_args"]
    params["slurm_additional_parameters"] = {
        **params["slurm_additional_parameters"],
        "nodes": job.allocated_nodes,
        "ntasks_per_node": job.tasks_per_node,
        "no_kill": True,  # a failed node does not end the job (launch/sbatch.py)
    }
    return params


def job_python(job: JobSpec, folder: Path, python: str = sys.executable) -> str:
    """The command that starts Python in every task: this interpreter, or the container's.

    With a container, submitit's own folder (where the pickled job and results go) is bound
    too: it may lie outside the run folder (`slurm.folder`).
    """
    if not job.container:
        return shlex.quote(python)
    binds = list(dict.fromkeys([*job.container_binds, str(folder)]))
    for i, bind in enumerate(binds):
        check_path(bind, f"container bind[{i}]")
    check_path(job.container, "slurm.container")
    return " ".join(
        exec_words(job.container_runtime, job.container, binds, gpus=bool(job.gpus_per_node))
    )


def make_executor(job: JobSpec, folder: Path, *, training: bool = False) -> submitit.AutoExecutor:
    """The executor of an eval/predict job (every task one rank, in the container if any), or
    of a training job (`training`: one process on the host runs the job script)."""
    executor = submitit.AutoExecutor(
        folder=folder,
        cluster="slurm",
        slurm_max_num_timeout=job.max_requeues,
        slurm_python=shlex.quote(sys.executable) if training else job_python(job, folder),
    )
    executor.update_parameters(
        **(training_parameters(job) if training else executor_parameters(job))
    )
    return executor


def submission_script(
    job: JobSpec,
    folder: Path,
    python: str = sys.executable,
    *,
    num_tasks: int = 1,
    max_parallel: int = 0,
    training: bool = False,
) -> str:
    """The sbatch script submitit writes for `job` (for --dry-run; needs no SLURM binaries).

    Args:
        num_tasks: sweep points; two or more make a job array.
        max_parallel: at most this many array tasks at once; 0: submitit's default.
        training: a training job (one process runs the job script's loop on the host), not
            an eval/predict job (every task one rank).
    """
    start = shlex.quote(python) if training else job_python(job, folder, python)
    command = " ".join([start, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    if max_parallel:
        job = dataclasses.replace(job, max_parallel=max_parallel)
    script = render_submission(
        training_parameters(job) if training else executor_parameters(job),
        command=command,
        folder=folder,
        map_count=num_tasks if num_tasks > 1 else None,
    )
    if str(folder).startswith("$"):
        # A folder under a variable this machine lacks (`$SCRATCH` off the cluster): submitit
        # anchors it at the current folder (`/here/$SCRATCH/...`), which is no path the job
        # will use; show it as the cluster's shell will name it.
        for anchored in {str(Path.cwd() / folder), str((Path.cwd() / folder).resolve())}:
            script = script.replace(anchored, str(folder))
    return script


def parse_sweep(specs: Sequence[str]) -> list[list[str]]:
    """`["a.b=1,2", "c=x,y"]` → one override list per combination (cartesian product)."""
    axes: list[list[str]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise LaunchError(f"--sweep {spec!r}: expected KEY=V1,V2,...")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key):
            raise LaunchError(f"--sweep {spec!r}: {key!r} is not a dotted config key")
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def sweep_run_dir(run_dir: str, overrides: Sequence[str]) -> str:
    """runs/x + [train.lr=0.1, seed=2] → runs/x/lr-0.1_seed-2."""
    parts = []
    for item in overrides:
        key, _, value = item.partition("=")
        parts.append(f"{key.rsplit('.', 1)[-1]}-{value}")
    name = re.sub(r"[^A-Za-z0-9_.=+-]", "_", "_".join(parts))
    return f"{run_dir.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Submitted:
    """One submitted run."""

    job_id: str
    run_dir: str
    stdout: str
    stderr: str


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) with the leaf readable by the user only."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def log_folder(cfg: Config) -> Path:
    """The folder for job scripts and logs (`slurm_folder`), created; private when created here.

    A `slurm.folder` that already exists keeps its permissions: it may be a shared folder.
    """
    folder = slurm_folder(cfg)
    return folder if folder.is_dir() and cfg.slurm.folder else private_dir(folder)


def require_sbatch(job: JobSpec) -> None:
    """Refuse to submit from a machine without `sbatch` (submitit would fail deep inside).

    Raises:
        LaunchError: naming the profile and what works off the cluster.
    """
    if shutil.which("sbatch") is None:
        raise LaunchError(
            f"sbatch: not found here: submit from a login node of {job.profile} "
            "(off the cluster, --dry-run --no-preflight prints the script)"
        )


def submit(
    cfg: Config, job: JobSpec, *, sweep: Sequence[str] = (), max_parallel: int = 0
) -> list[Submitted]:
    """Submit `cfg` as `job` (one job, or a job array with one run folder per sweep point).

    `max_parallel` lets at most that many array tasks run at once (0: no limit of ours).

    Raises:
        LaunchError: an unsafe value or a bad sweep, before anything is submitted.
    """
    combos = parse_sweep(sweep)
    configs = []
    for combo in combos:
        run_cfg = cfg
        if combo != []:
            run_cfg = with_overrides(cfg, [*combo, f"run_dir={sweep_run_dir(cfg.run_dir, combo)}"])
        check_submission(run_cfg, job)
        configs.append(run_cfg)
    require_sbatch(job)
    folder = log_folder(cfg) / "submitit"
    if max_parallel:
        job = dataclasses.replace(job, max_parallel=max_parallel)
    executor = make_executor(job, folder, training=True)
    if len(configs) == 1:
        jobs = [executor.submit(TrainingJob(configs[0], job))]
    else:
        with executor.batch():
            jobs = [executor.submit(TrainingJob(c, job)) for c in configs]
    results = []
    for run_cfg, sjob in zip(configs, jobs, strict=True):
        paths = sjob.paths
        sub = Submitted(
            job_id=str(sjob.job_id),
            run_dir=run_cfg.run_dir,
            stdout=str(paths.stdout),
            stderr=str(paths.stderr),
        )
        write_job_file(Path(run_cfg.run_dir), sub, job)
        results.append(sub)
    return results


def write_job_file(run_dir: Path, sub: Submitted, job: JobSpec) -> None:
    slurm_dir = private_dir(run_dir / "slurm")
    record = {
        "job_id": sub.job_id,
        "stdout": sub.stdout,
        "stderr": sub.stderr,
        "profile": job.profile,
        "max_requeues": job.max_requeues,
    }
    (slurm_dir / JOB_FILE).write_text(json.dumps(record, indent=1) + "\n")
    (slurm_dir / "job_id").write_text(sub.job_id + "\n")
    # Every job ever submitted into this run folder, for `hpctrain status` (resubmissions too).
    with open(slurm_dir / JOBS_FILE, "a", encoding="utf-8") as f:
        f.write(sub.job_id + "\n")


# ------------------------------------------------------------- submit --eval / --predict
@dataclass(frozen=True)
class InferenceSpec:
    """What an eval or predict job runs (the options of `hpctrain eval`/`predict`)."""

    verb: str  # "eval" or "predict"
    checkpoint: str = "latest"
    data: str = ""  # predict: the data (default data.val); eval: a JSONL file to answer
    out: str = ""  # eval: the record's file; predict: the destination
    fmt: str = "jsonl"
    # eval --data: the record format (`hpctrain convert`'s field options)
    prompt_field: str = ""
    response_field: str = ""
    messages_field: str = ""
    # eval --harness: lm-evaluation-harness tasks (one process)
    harness: str = ""
    harness_include: str = ""
    num_fewshot: int | None = None
    limit: float | None = None
    tokenizer: str = ""  # eval: --tokenizer, where the run's tokenizer has moved
    after: str = ""  # a job id this job waits for (afterok): the run's training job

    @property
    def fields(self) -> dict[str, str]:
        return {
            "prompt_field": self.prompt_field,
            "response_field": self.response_field,
            "messages_field": self.messages_field,
        }


class InferenceJob:
    """The callable submitit pickles for `submit --eval/--predict`: every task is one rank.

    Not requeued on a signal (no state to save): a preempted job that SLURM requeues runs
    again from the start; a prediction rewrites its destination.
    """

    def __init__(self, cfg: Config, spec: InferenceSpec) -> None:
        self.cfg, self.spec = cfg, spec

    def __call__(self) -> int:
        spec = self.spec
        try:
            if spec.verb == "eval" and spec.harness:
                from hpctrain.inference.harness import run_harness

                code = run_harness(
                    self.cfg,
                    tasks=spec.harness,
                    checkpoint=spec.checkpoint,
                    include=spec.harness_include,
                    num_fewshot=spec.num_fewshot,
                    limit=spec.limit,
                    out=spec.out,
                    tokenizer_spec=spec.tokenizer,
                )
            elif spec.verb == "eval" and spec.data:
                from hpctrain.inference.answers import run_answers

                code = run_answers(
                    self.cfg,
                    data=spec.data,
                    fields=spec.fields,
                    checkpoint=spec.checkpoint,
                    out=spec.out,
                    tokenizer_spec=spec.tokenizer,
                )
            elif spec.verb == "eval":
                from hpctrain.inference.evaluate import run_eval

                code = run_eval(
                    self.cfg,
                    checkpoint=spec.checkpoint,
                    out=spec.out,
                    tokenizer_spec=spec.tokenizer,
                )
            else:
                from hpctrain.inference.predict import run_predict

                code = run_predict(
                    self.cfg,
                    checkpoint=spec.checkpoint,
                    data=spec.data or self.cfg.data.val,
                    out=spec.out,
                    fmt=spec.fmt,
                )
        except HpctrainError as exc:
            exit_with_one_line(exc, verb=spec.verb)
        return code


def absolute_local(value: str) -> str:
    """A local path made absolute (the job may start elsewhere); URLs and names as they are."""
    if not value or "://" in value or value in ("latest", "best") or value.startswith("pipe:"):
        return value
    return str(Path(value).resolve())


def submit_inference(cfg: Config, job: JobSpec, spec: InferenceSpec) -> Submitted:
    """Submit an eval or predict job of `cfg`'s run; the job's ranks are its SLURM tasks.

    It is not recorded in the run folder's `slurm/job.json` (that is the training job's,
    for `hpctrain status`); its logs go to the same `slurm.folder`.

    Raises:
        LaunchError: an unsafe value, before anything is submitted.
    """
    spec = dataclasses.replace(
        spec,
        checkpoint=absolute_local(spec.checkpoint),
        data=absolute_local(spec.data),
        out=absolute_local(spec.out),
        harness_include=absolute_local(spec.harness_include),
        tokenizer=absolute_local(spec.tokenizer) if spec.tokenizer != "bytes" else "bytes",
    )
    check_submission(cfg, job)
    for key, value in (
        ("--checkpoint", spec.checkpoint),
        ("--data", spec.data),
        ("--out", spec.out),
        ("--harness-include", spec.harness_include),
        ("--tokenizer", spec.tokenizer),
    ):
        check_no_credential(value, key)
    require_sbatch(job)
    job = dataclasses.replace(job, job_name=f"{job.job_name}-{spec.verb}")
    if spec.harness:  # the harness runs in one process (one GPU)
        job = dataclasses.replace(
            job, nodes=1, tasks_per_node=1, gpus_per_node=min(job.gpus_per_node, 1)
        )
    executor = make_executor(job, log_folder(cfg) / "submitit")
    if spec.after:  # start once the run's training job has ended well
        executor.update_parameters(
            slurm_additional_parameters={
                **executor_parameters(job)["slurm_additional_parameters"],
                "dependency": f"afterok:{spec.after}",
            }
        )
    sjob = executor.submit(InferenceJob(cfg, spec))
    return Submitted(
        job_id=str(sjob.job_id),
        run_dir=cfg.run_dir,
        stdout=str(sjob.paths.stdout),
        stderr=str(sjob.paths.stderr),
    )
