"""Checks run before a job is queued: what would fail on a compute node after hours of wait.

Each check gives a `Check(name, ok, message)`; `preflight` runs them all (it does not stop at
the first failure) so the user fixes everything in one round.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from hpctrain.config import Config, ConfigError
from hpctrain.errors import DataError
from hpctrain.launch.checks import Check
from hpctrain.launch.cluster_limits import check_live_limits
from hpctrain.launch.environment import check_job_environment
from hpctrain.launch.profiles import ClusterProfile, LaunchError, resolve_job
from hpctrain.launch.script_values import check_no_credential

SAMPLE_SHARDS = 3


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
    if profile.account_suffix and not job.account:
        return Check(
            "profile",
            True,
            f"{summary}; slurm.account is empty (expected <project>{profile.account_suffix} when you have several projects)",
            warning=True,
        )
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
    """`model.init_from` exists, is readable and of a known kind (None: not set)."""
    path = cfg.model.init_from
    if not path:
        return None
    if "$" in path:
        return Check(
            "model.init_from", True, f"{path} is expanded on the node; not checked", warning=True
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


def check_python() -> Check:
    """The job runs the interpreter that runs this (submitit and the rendered script use it)."""
    in_venv = sys.prefix != sys.base_prefix or "CONDA_PREFIX" in os.environ
    note = (
        ""
        if in_venv
        else " (not a virtual environment: make sure compute nodes see the same packages)"
    )
    return Check("python", True, f"{sys.executable}{note}", warning=not in_venv)


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
    if data:
        checks += check_data(cfg)
    checks += [check_task(cfg), check_python()]
    for optional in (check_init_from(cfg), check_monitor_metric(cfg)):
        if optional is not None:
            checks.append(optional)
    if environment and job is not None:
        checks += check_job_environment(job, python)
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = "ok  " if c.ok and not c.warning else ("warn" if c.ok else "FAIL")
        lines.append(f"{mark} {c.name}: {c.message}")
    return "\n".join(lines)


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]


def raise_if_failed(checks: list[Check], consequence: str = "") -> None:
    """Raise one `LaunchError` line naming every failed check, if any failed.

    Args:
        consequence: what did not happen because of it, e.g. "nothing submitted".
    """
    bad = failed(checks)
    if bad:
        details = "; ".join(f"{c.name}: {c.message}" for c in bad).replace("\n", " ")
        raise LaunchError(f"preflight failed{', ' + consequence if consequence else ''}: {details}")
