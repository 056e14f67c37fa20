"""Checks run before a job is queued: what would fail on a compute node after hours of wait.

Each check gives a `Check(name, ok, message)`; `preflight` runs them all (it does not stop at
the first failure) so the user fixes everything in one round.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from hpctrain.config import Config, ConfigError
from hpctrain.errors import DataError
from hpctrain.launch.checks import Check
from hpctrain.launch.cluster_limits import check_live_limits
from hpctrain.launch.environment import check_job_environment
from hpctrain.launch.profiles import (
    ClusterProfile,
    JobSpec,
    LaunchError,
    account_warning,
    resolve_job,
)
from hpctrain.launch.script_values import check_no_credential

if TYPE_CHECKING:  # torch: imported by the checks that need it, not by `hpctrain --help`
    from hpctrain.parallel.precision import DeviceFacts, TrainingPlan

SAMPLE_SHARDS = 3
LOGIN_NODE = "login node"  # the check that tells a login node of the job's cluster from elsewhere


def _is_local_host(host: str) -> bool:
    if host in ("", "localhost") or host.endswith((".local", ".internal", ".lan")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "." not in host  # a bare cluster host name
    return address.is_private or address.is_loopback or address.is_link_local


def check_profile(cfg: Config, profile: ClusterProfile) -> Check:
    try:
        job = resolve_job(cfg, profile)
    except LaunchError as exc:
        return Check("profile", False, str(exc))
    summary = f"{profile.name}: {job.nodes} node(s) x {job.tasks_per_node} task(s), {job.time}, qos {job.qos or '-'}"
    warning = account_warning(job, profile)
    if warning:
        return Check("profile", True, f"{summary}; {warning}", warning=True)
    return Check("profile", True, summary)


def check_credentials(cfg: Config) -> Check:
    for key, value in (
        *cfg.data.train_paths(),
        ("data.val", cfg.data.val),
        ("checkpoint.dir", cfg.checkpoint.dir),
    ):
        try:
            check_no_credential(value, key)
        except LaunchError as exc:
            return Check("credentials", False, str(exc))
    return Check("credentials", True, "no credential in data or checkpoint URLs")


def check_data(cfg: Config) -> list[Check]:
    """The index opens and a sample of shards can be read (from here, as from the job).

    Through the loader's own `open_index` and shard reader, so every form the trainer reads
    passes here (an index anywhere, a folder, a shard pattern, HTTP servers without range
    requests, `pipe:` patterns with `data.allow_pipe`) and every form it refuses fails here.
    """
    from hpctrain.data import open_index, redact_url
    from hpctrain.data.stream import ShardReadError, open_shard
    from hpctrain.data.tar import iter_members

    allow_pipe = cfg.data.allow_pipe
    checks = []
    for key, spec in (*cfg.data.train_paths(), ("data.val", cfg.data.val)):
        if not spec:
            if key.startswith("data.train"):
                checks.append(Check(key, False, f"{key} is empty"))
            continue
        scheme = urlparse(spec).scheme
        if scheme in ("http", "https") and not _is_local_host(urlparse(spec).hostname or ""):
            checks.append(
                Check(
                    f"{key} offline",
                    True,
                    f"{redact_url(spec)} is on the internet: compute nodes usually cannot reach it",
                    warning=True,
                )
            )
        try:
            index = open_index(spec, allow_pipe=allow_pipe)
        except Exception as exc:  # any failure here is the user's to see, in one line
            shown = spec if spec.startswith("pipe:") else redact_url(spec)
            message = str(exc).splitlines()[0]
            if spec.startswith("pipe:") or message.startswith(shown):
                checks.append(Check(key, False, message))
            else:
                checks.append(Check(key, False, f"{shown}: {message}"))
            continue
        if cfg.data.seq_len:  # packed sequences need a token index: say so before the job
            from hpctrain.data.sequences import sequence_counts

            try:
                sequence_counts(index, cfg.data.seq_len)
            except DataError as exc:
                checks.append(Check(key, False, str(exc)))
                continue
        failures = []
        num_shards = len(index.shards)
        for i in sorted({0, num_shards // 2, num_shards - 1})[:SAMPLE_SHARDS]:
            url = index.shard_url(i)
            try:
                # the first tar header: the shard opens and is a tar file
                with open_shard(
                    url, size=index.shards[i].num_bytes, max_retries=1, allow_pipe=allow_pipe
                ) as f:
                    next(iter_members(f), None)
            except ShardReadError as exc:  # names the shard itself
                failures.append(str(exc).splitlines()[0])
            except Exception as exc:
                failures.append(f"{redact_url(url)}: {str(exc).splitlines()[0]}")
        if failures:
            checks.append(Check(key, False, f"shard unreadable: {failures[0]}"))
        else:
            checks.append(
                Check(
                    key,
                    True,
                    f"{num_shards} shards, {index.num_samples} samples; sample shards open",
                )
            )
    return checks


def check_run_dir(cfg: Config) -> Check:
    if "$" in cfg.run_dir:
        return Check(
            "run_dir",
            True,
            f"{cfg.run_dir} is expanded on the node; not checked here",
            warning=True,
        )
    path = Path(cfg.run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-"):
            pass
    except OSError as exc:
        return Check("run_dir", False, f"{cfg.run_dir} is not writable: {exc.strerror or exc}")
    return Check("run_dir", True, f"{path.resolve()} writable")


def check_checkpoint_trust(cfg: Config) -> Check:
    """The checkpoint folder (and a `checkpoint.resume` path) would be trusted by a load.

    The same check a run makes at start-up (`check_root_trusted`): a folder the job would
    later refuse to load from fails here, before the job waits in the queue.
    """
    from hpctrain.checkpoint.manager import check_root_trusted
    from hpctrain.checkpoint.safety import CheckpointError
    from hpctrain.checkpoint.storage import is_local, open_store

    root = cfg.checkpoint_root()
    paths = [root]
    if cfg.checkpoint.resume not in ("latest", "none"):
        paths.append(cfg.checkpoint.resume)
    checked = []
    for path in paths:
        if "$" in path or not is_local(path):
            continue  # expanded on the node, or an object store (no owners to check)
        store = open_store(path)
        try:
            if path == root or not store.exists("manifest.json"):
                check_root_trusted(store)
            else:  # a resume path naming one step folder
                store.check_trusted(["", *store.listdir()])
        except (CheckpointError, OSError) as exc:
            return Check("checkpoint.dir", False, str(exc).splitlines()[0])
        checked.append(store.root)
    if not checked:
        # Not echoed: a URL may hold a credential (check_credentials reports those).
        return Check(
            "checkpoint.dir", True, "an object store, or a path expanded on the node: not checked"
        )
    return Check(
        "checkpoint.dir", True, f"{', '.join(checked)}: owned by you, not writable by others"
    )


def check_task(cfg: Config) -> Check:
    """The task and model modules import in this Python environment."""
    from hpctrain.tasks.task import BUILTIN_TASKS

    target = BUILTIN_TASKS.get(cfg.task, cfg.task)
    module_name = target.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return Check(
            "task",
            False,
            f"task={cfg.task!r}: module {module_name} not importable with {sys.executable}",
        )
    try:
        importlib.import_module(module_name)
    except Exception as exc:
        return Check("task", False, f"task={cfg.task!r}: importing {module_name} failed: {exc}")
    from hpctrain.tasks.task import check_model_name

    try:
        check_model_name(cfg.task, cfg.model.name, cfg.model.image_size)
    except ConfigError as exc:
        return Check("model", False, str(exc))
    return Check("task", True, f"{target} imports")


def resume_manifest(cfg: Config) -> dict[str, Any] | None:
    """The manifest of the checkpoint the job would resume from (None: a new run)."""
    if "$" in cfg.checkpoint_root():
        return None  # expanded on the node
    from hpctrain.checkpoint.selection import peek
    from hpctrain.checkpoint.storage import open_store

    return peek(open_store(cfg.checkpoint_root()), cfg.checkpoint.resume)


def check_monitor_metric(cfg: Config) -> Check | None:
    """`checkpoint.monitor` is a metric the task's evaluation reports (None: no monitor, or
    a task that does not declare its metrics)."""
    from hpctrain.tasks.task import check_monitor, class_hook

    if not cfg.checkpoint.monitor or class_hook(cfg.task, "eval_metric_names") is None:
        return None
    try:
        check_monitor(cfg)
    except ConfigError as exc:
        return Check("checkpoint.monitor", False, str(exc))
    return Check("checkpoint.monitor", True, f"{cfg.checkpoint.monitor}: reported by the task")


def check_init_from(cfg: Config) -> Check | None:
    """`model.init_from` exists, is readable and of a known kind (None: not set); not read
    by a run that resumes (which needs it no more)."""
    path = cfg.model.init_from
    if not path:
        return None
    if "$" in path:
        return Check(
            "model.init_from", True, f"{path} is expanded on the node; not checked", warning=True
        )
    resumed = resume_manifest(cfg)
    if resumed is not None:
        return Check(
            "model.init_from",
            True,
            f"{path}: not read, the run resumes from its step {resumed.get('step')}",
        )
    from hpctrain.models.init_from import kind_of

    try:
        kind = kind_of(path)
    except ConfigError as exc:
        return Check("model.init_from", False, str(exc))
    if not os.access(path, os.R_OK):
        return Check("model.init_from", False, f"model.init_from={path}: not readable by you")
    what = {"hf": "a Hugging Face model folder", "run": "an hpctrain run or checkpoint"}
    return Check("model.init_from", True, f"{path}: {what.get(kind, 'a state dict file')}")


def check_lora_settings(cfg: Config) -> Check | None:
    """`model.lora.*` against the rest of the config (None: LoRA off and unset)."""
    from hpctrain.config.lora_rules import check_lora

    try:
        check_lora(cfg)
    except ConfigError as exc:
        return Check("model.lora", False, str(exc))
    if not cfg.model.lora.rank:
        return None
    lora = cfg.model.lora
    return Check(
        "model.lora", True, f"rank {lora.rank}, alpha {lora.alpha:g} on {cfg.model.init_from}"
    )


def job_device(job: JobSpec) -> DeviceFacts:
    """What the trainer's plan needs to know of the job's devices: the profile's GPUs (their
    compute capability from `gpu_arch`), or CPUs (a cluster without GPUs)."""
    from hpctrain.parallel.precision import DeviceFacts

    if not job.gpus_per_node:
        return DeviceFacts(type="cpu")
    digits = job.gpu_arch.removeprefix("sm_").rstrip("a")
    capability = (int(digits[:-1]), int(digits[-1])) if digits.isdigit() else (0, 0)
    return DeviceFacts(type="cuda", name=f"{job.profile} GPUs", capability=capability)


def check_plan(cfg: Config, job: JobSpec) -> tuple[Check, TrainingPlan | None]:
    """The trainer's plan for the job's ranks and nodes, and the rules between config keys:
    a `train.tp_degree` or `train.shard_degree` the node shape does not divide, a
    `data.seq_len` the TP degree does not divide, bf16 on GPUs without it. The same
    functions the trainer runs first (`check_rules`, `plan_training`)."""
    from hpctrain.config.load import check_rules
    from hpctrain.parallel.precision import plan_training

    ranks = job.nodes * job.tasks_per_node
    try:
        check_rules(cfg)
        plan = plan_training(cfg.train, job_device(job), ranks, job.tasks_per_node)
    except ConfigError as exc:
        return Check("train", False, str(exc)), None
    what = f"{ranks} rank(s) on {job.nodes} node(s): {plan.describe_mesh()}"
    return Check("train", True, f"{what}, {plan.precision.name}"), plan


def check_model(cfg: Config, plan: TrainingPlan | None) -> Check | None:
    """The trainer's own checks of its task and model, without building the model: a
    built-in task constructed from the training index as the trainer constructs it (a
    Hugging Face folder's architecture, safetensors weights, RoPE entries and sliding window
    against `data.seq_len`; the tokenizer's vocabulary; `model.name` against the folder; a
    resume's recorded model and tokenizer), `model.init_from` for the task, and the model's
    heads against `train.tp_degree`. None for a task of the user's (its constructor is their
    code) or data that cannot be read (`check_data` says why)."""
    from hpctrain.data.mixture_index import open_train_index
    from hpctrain.errors import HpctrainError
    from hpctrain.models import init_from
    from hpctrain.models.gpt import GPTConfig, check_tensor_parallel
    from hpctrain.tasks.task import BUILTIN_TASKS, load_task

    if cfg.task not in BUILTIN_TASKS:
        return None
    try:
        index = open_train_index(cfg.data)
    except Exception:  # any failure: check_data reports it in its own line
        return None
    resumed = resume_manifest(cfg)
    try:
        task = load_task(cfg, index, resumed)
        if resumed is None:
            init_from.check(cfg, task)
        shape = getattr(task, "model_cfg", None)
        if plan is not None and plan.tp > 1 and isinstance(shape, GPTConfig):
            check_tensor_parallel(shape, plan.tp)
    except HpctrainError as exc:
        return Check("model", False, " ".join(str(exc).splitlines()))
    start = f"resumes from step {resumed.get('step')}" if resumed else "a new run"
    return Check("model", True, f"task {cfg.task} builds its model ({start})")


def check_python() -> Check:
    """The job runs the interpreter that runs this (submitit and the rendered script use it)."""
    in_venv = sys.prefix != sys.base_prefix or "CONDA_PREFIX" in os.environ
    note = (
        ""
        if in_venv
        else " (not a virtual environment: make sure compute nodes see the same packages)"
    )
    return Check("python", True, f"{sys.executable}{note}", warning=not in_venv)


def calls_module(setup: tuple[str, ...]) -> bool:
    """Whether setup lines call environment modules (`module load ...`, Lmod's `ml`)."""
    return any(line.split()[:1] in (["module"], ["ml"]) for line in setup)


def has_module_command() -> bool:
    """Whether a fresh login shell here has `module` (a shell function that the site's
    profile scripts define, so not found on PATH), as the environment probe's shell would."""
    try:
        done = subprocess.run(
            ["bash", "-lc", "type module"],
            capture_output=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return True  # a slow login shell: let the environment probe tell
    return done.returncode == 0


def check_login_node(job: JobSpec) -> Check | None:
    """Whether this machine is a login node of the job's cluster (None: nothing lacking).

    Off the cluster (a laptop, CI) the profile's setup lines fail one by one with `module:
    command not found` and nothing can be submitted: one check says so instead, failing when
    the `module` command the setup lines call is missing (the job's environment cannot be
    probed here), a warning when only `sbatch` is (the script can be rendered and read here).
    """
    no_module = calls_module(job.setup) and not has_module_command()
    lacking = ["no `module` command (the profile's setup lines call it)"] if no_module else []
    if shutil.which("sbatch") is None:
        lacking.append("no `sbatch`")
    if not lacking:
        return None
    here = f"this shell has {' and '.join(lacking)}: not a login node of {job.profile}"
    if no_module:
        return Check(LOGIN_NODE, False, f"{here}, so the job's environment was not checked")
    return Check(LOGIN_NODE, True, f"{here}: a script can be rendered, not submitted", warning=True)


def preflight(
    cfg: Config,
    profile: ClusterProfile,
    *,
    data: bool = True,
    environment: bool = True,
    python: str = sys.executable,
) -> list[Check]:
    """All checks for `cfg` on `profile`.

    Args:
        data: read the index and a sample of shards.
        environment: run the setup lines and the job's `python` (or its image) in a fresh
            login shell and check imports, torch's version, CUDA and the GPU architecture.
        python: the interpreter the job runs (the one `submit`/`sbatch` put in the script).
    """
    checks = [check_profile(cfg, profile), check_credentials(cfg), check_run_dir(cfg)]
    checks.append(check_checkpoint_trust(cfg))
    try:
        job = resolve_job(cfg, profile)
    except LaunchError:
        job = None  # check_profile reported it
    if job is not None:
        checks += check_live_limits(job)
    plan = None
    if job is not None:
        plan_check, plan = check_plan(cfg, job)
        checks.append(plan_check)
    if data:
        checks += check_data(cfg)
    checks += [check_task(cfg), check_python()]
    init_check = check_init_from(cfg)
    if init_check is not None:
        checks.append(init_check)
    for optional in (check_lora_settings(cfg), check_monitor_metric(cfg)):
        if optional is not None:
            checks.append(optional)
    if data and (init_check is None or init_check.ok):
        model_check = check_model(cfg, plan)
        if model_check is not None:
            checks.append(model_check)
    if environment and job is not None:
        login = check_login_node(job)
        if login is not None:
            checks.append(login)
        if login is None or login.ok:
            checks += check_job_environment(job, python, compile=cfg.train.compile)
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = "ok  " if c.ok and not c.warning else ("warn" if c.ok else "FAIL")
        lines.append(f"{mark} {c.name}: {c.message}")
    return "\n".join(lines)


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]


def raise_if_failed(checks: list[Check], consequence: str = "", *, off_cluster: str = "") -> None:
    """Raise one `LaunchError` line naming every failed check, if any failed.

    A failed `login node` check comes first: off the cluster it explains the others (data
    and folders that only the cluster has).

    Args:
        consequence: what did not happen because of it, e.g. "nothing submitted".
        off_cluster: what to do instead when this is not a login node, said after that
            check, e.g. "--no-preflight renders the script anyway".
    """
    bad = sorted(failed(checks), key=lambda c: c.name != LOGIN_NODE)
    if bad:
        parts = [f"{c.name}: {c.message}" for c in bad]
        if off_cluster and bad[0].name == LOGIN_NODE:
            parts[0] += f" ({off_cluster})"
        details = "; ".join(parts).replace("\n", " ")
        raise LaunchError(f"preflight failed{', ' + consequence if consequence else ''}: {details}")
