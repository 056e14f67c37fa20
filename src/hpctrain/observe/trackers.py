"""Experiment trackers: Weights & Biases and MLflow, one tracked run per training run.

Only rank 0 tracks. A training run that is requeued or resumed many times is one tracked run:
the ids are stored in `RUN_DIR/tracking.json` at the first start and reused by every later
start that resumes from a checkpoint (W&B `id=` with `resume="allow"`, MLflow's run id). A
start that loads no checkpoint (the first, `--resume none`, or a crash before the first
save) trains from step 0 again, and begins a new tracked run.

Steps never go back or repeat in a tracker. A resume rolls back to the last checkpoint, so
the steps between it and the interruption are trained (and logged to `metrics.jsonl`) again;
trackers got them the first time, and `tracking.json` remembers the last step sent of each
kind of record ("train", "eval"). A record at or below it is not sent again: the tracker
keeps the first values of those steps, and continues from the next new step. This is also
what lets `wandb sync` stitch the offline folders of successive starts into one run (their
steps are disjoint). A step whose record was sent but not yet flushed when the process was
killed (SIGKILL) may be missing from the tracker; it is never duplicated.

Compute nodes have no internet: `logging.wandb=offline` writes `RUN_DIR/wandb/offline-run-*`
and touches no network (W&B's error reporting is turned off too); `hpctrain sync RUN_DIR`
uploads them from a login node. MLflow's telemetry is turned off whenever hpctrain drives
MLflow; `logging.mlflow=local` is a SQLite store in `RUN_DIR/mlflow/`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch

import hpctrain
from hpctrain.config import Config, ConfigError, LoggingConfig, config_to_dict
from hpctrain.errors import install_hint
from hpctrain.files import write_atomic

log = logging.getLogger("hpctrain")

TRACKING_FILE = "tracking.json"
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # a scheme: sqlite:, http:, databricks:...
MLFLOW_LOCAL = "local"
SERVER_TIMEOUT_S = 5.0  # how long a tracker's server may take to answer at the start
# Run parameters that may differ between the starts of one run (a requeue, another world
# size after a resume): MLflow params cannot change, so these go to tags there.
PER_START_KEYS = ("slurm_job_id", "slurm_restart_count", "world_size", "start")


def requirements(cfg: LoggingConfig) -> list[tuple[str, str, str]]:
    """(config key, module, pip line) of every tracker the config turns on."""
    needed = []
    if cfg.wandb != "off":
        needed.append((f"logging.wandb={cfg.wandb}", "wandb", install_hint("wandb")))
    if cfg.mlflow != "off":
        needed.append((f"logging.mlflow={cfg.mlflow}", "mlflow", install_hint("mlflow")))
        if _is_sqlite(cfg.mlflow):  # MLflow's database stores need SQLAlchemy and alembic
            needed += [
                (f"logging.mlflow={cfg.mlflow}", name, install_hint("mlflow"))
                for name in ("sqlalchemy", "alembic")
            ]
    return needed


def check_trackers(cfg: LoggingConfig) -> None:
    """Fail before any work when a tracker is on but its package is missing, or
    `logging.mlflow` is neither off, local, a URI nor a file store MLflow allows
    (ConfigError)."""
    file_store = cfg.mlflow not in ("off", MLFLOW_LOCAL) and _is_file_store(cfg.mlflow)
    if file_store and not file_store_allowed():
        raise ConfigError(
            f"logging.mlflow={cfg.mlflow!r}: must be off, local or a tracking URI "
            "(sqlite:///path/mlflow.db, http://host:5000); a folder (MLflow's file store, "
            "./mlruns) needs MLFLOW_ALLOW_FILE_STORE=true, as MLflow 3 does"
        )
    for key, module, pip in requirements(cfg):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key} needs the {module} package: {pip} (or set it to off)")
    if cfg.tensorboard:
        require_tensorboard()


def require_tensorboard() -> None:
    """Fail before any work when `logging.tensorboard` is on but tensorboard is missing."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package: "
            f"{install_hint('tensorboard')} (or set logging.tensorboard=false)"
        ) from None


def _is_file_store(uri: str) -> bool:
    """A folder or a `file:` URI: MLflow's file store (its `""` and `file` schemes)."""
    return uri.startswith("file:") or not _URI.match(uri)


def file_store_allowed() -> bool:
    """MLflow's rule for its file store: `MLFLOW_ALLOW_FILE_STORE` is true or 1 (in any case);
    false, 0 or unset refuse it; another value is an error, as MLflow makes it."""
    value = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    if value is None:
        return False
    if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(
            f"MLFLOW_ALLOW_FILE_STORE={value!r}: must be true, false, 1 or 0 (MLflow's rule)"
        )
    return value.lower() in ("true", "1")


def _is_sqlite(uri: str) -> bool:
    return uri == MLFLOW_LOCAL or uri.startswith("sqlite:")


def mlflow_uri(cfg: LoggingConfig, run_dir: Path) -> str:
    """The tracking URI `logging.mlflow` means: `local` is a SQLite file in the run folder."""
    if cfg.mlflow == MLFLOW_LOCAL:
        return f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}"
    return cfg.mlflow


def shown_url(url: str) -> str:
    """`url` without the user and password it may carry (`https://user:token@host`)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_server(key: str, url: str, timeout_s: float = SERVER_TIMEOUT_S) -> None:
    """Fail within about `timeout_s` with one line (a ConfigError naming `key` and `url`,
    without credentials) when nothing answers HTTP at `url`.

    The trackers' own clients retry for minutes (MLflow's backoff took 4 min on a closed
    port, W&B waits 90 s): minutes of a GPU allocation before the run could say why. Any HTTP
    answer, an error status included, is a server: the tracker's client says the rest.
    """
    request = urllib.request.Request(url, method="GET")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as exc:  # URLError, a timeout, a refused or reset connection
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, ssl.SSLError):
            return  # a server answered; its certificate is for the client's settings to judge
        raise ConfigError(
            f"{key}: no answer from {shown_url(url)} within {timeout_s:g} s ({reason}); "
            "is the server running, and can this node reach it? (compute nodes often cannot)"
        ) from None


# ------------------------------------------------------------------------- run parameters
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1}}` -> `{"train.lr": 1}`; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def git_commit(folder: Path) -> str | None:
    """HEAD of the git repository holding `folder` (with "-dirty" for uncommitted changes to
    tracked files), or None outside a repository or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    dirty = status.returncode == 0 and status.stdout.strip() != ""
    return head.stdout.strip() + ("-dirty" if dirty else "")


def code_folder(task: str) -> Path:
    """Where the user's code is: the folder of a custom task's module, else the working
    folder (a built-in task is run from the user's project)."""
    module = task.partition(":")[0] if ":" in task else ""
    if module:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            return Path(spec.origin).parent
    return Path.cwd()


def run_params(cfg: Config, world_size: int, start: int) -> dict[str, Any]:
    """What a tracked run records about itself: the config and where the code came from."""
    params: dict[str, Any] = {f"config.{k}": v for k, v in flatten(config_to_dict(cfg)).items()}
    params.update(
        {
            "hpctrain_version": hpctrain.__version__,
            "torch_version": torch.__version__,
            "git_commit": git_commit(code_folder(cfg.task)) or "none",
            "slurm_job_id": os.environ.get("SLURM_JOB_ID", "none"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "world_size": world_size,
            "start": start,
        }
    )
    return params


def numeric_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record, without its `step` and `kind`."""
    return {
        name: float(value)
        for name, value in record.items()
        if name not in ("step", "kind")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


# ------------------------------------------------------------------------- the trackers
class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self, status: str) -> None: ...


class WandbTracker:
    """A W&B run (`mode` offline or online) resumed by id on every start."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        run_id: str | None,
        name: str,
        params: dict[str, Any],
    ) -> None:
        mode: Literal["online", "offline"] = "online" if cfg.wandb == "online" else "offline"
        env_mode = os.environ.get("WANDB_MODE", "")
        if mode == "online" and env_mode in ("offline", "disabled", "dryrun"):
            # The job scripts export WANDB_MODE=offline: compute nodes have no internet.
            log.info("logging.wandb=online, but WANDB_MODE=%s here: tracking offline", env_mode)
            mode = "offline"
        if mode == "offline":
            os.environ["WANDB_ERROR_REPORTING"] = "false"  # no Sentry reports from offline nodes
        import wandb

        if mode == "online":
            base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
            check_server(f"logging.wandb={cfg.wandb}", base_url)

        self.run = wandb.init(
            dir=str(run_dir),
            project=cfg.project,
            name=name,
            id=run_id,
            resume="allow",
            mode=mode,
            config=params,
            settings=wandb.Settings(console="off", silent=True, save_code=False),
        )
        # Values of this start (a requeue's job id, a new world size) replace the first's.
        self.run.config.update(
            {k: params[k] for k in PER_START_KEYS if k in params}, allow_val_change=True
        )
        self.id: str = self.run.id
        self.folder = Path(self.run.dir).parent  # RUN_DIR/wandb/<offline-run-...|run-...>

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(
            exit_code={"finished": 0, "preempted": 75, "interrupted": 130}.get(status, 1)
        )


class MlflowTracker:
    """An MLflow run, created at the first start and continued (same run id) afterwards."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        run_id: str | None,
        name: str,
        params: dict[str, Any],
    ) -> None:
        # Telemetry would post to mlflow.org from compute nodes that have no internet.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(cfg, run_dir)
        self._pending: list[Any] = []  # MLflow's operations in flight (asynchronous logging)
        if cfg.mlflow == MLFLOW_LOCAL:
            (run_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        tags = {f"hpctrain.{k}": str(params[k]) for k in PER_START_KEYS if k in params}
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (
                    (run_dir / "mlflow" / "artifacts").resolve().as_uri()
                    if cfg.mlflow == MLFLOW_LOCAL
                    else None
                )
                try:
                    experiment_id = self.client.create_experiment(
                        cfg.project, artifact_location=artifacts
                    )
                except MlflowException:
                    # Another run (a sweep's sibling on the same server) created it meanwhile.
                    created = self.client.get_experiment_by_name(cfg.project)
                    if created is None:
                        raise
                    experiment_id = created.experiment_id
            run = self.client.create_run(experiment_id, run_name=name, tags=tags)
            self.id: str = run.info.run_id
            fixed = [
                # MLflow caps a param value at 6000 characters
                Param(key, json.dumps(value) if not isinstance(value, str) else value[:6000])
                for key, value in params.items()
                if key not in PER_START_KEYS
            ]
            for first in range(0, len(fixed), 100):  # log_batch takes at most 100 params
                self.client.log_batch(self.id, params=fixed[first : first + 100])
        else:
            self.id = run_id
            self.client.update_run(self.id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(self.id, key, value)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self._wait()  # the previous record's error surfaces here, one record late
        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in values.items()]
        # Asynchronous: MLflow's own thread writes while training goes on; a synchronous
        # write blocked rank 0, and so every rank, several times longer (BENCHMARKS.md,
        # "Figures behind the code").
        for first in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self._pending.append(
                self.client.log_batch(
                    self.id, metrics=metrics[first : first + 1000], synchronous=False
                )
            )

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for operation in pending:
            if operation is not None:
                operation.wait()

    def close(self, status: str) -> None:
        try:
            self._wait()
        finally:
            ended = {"finished": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}
            self.client.set_terminated(self.id, status=ended.get(status, "FAILED"))


# ------------------------------------------------------------------------- the run's record
def read_tracking(run_dir: Path) -> dict[str, Any]:
    """`RUN_DIR/tracking.json` (ids, last steps sent, W&B folders), or {} before the first
    start; a file that is not a JSON object is a ConfigError naming it."""
    path = run_dir / TRACKING_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable tracking record ({exc})") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: unreadable tracking record (not a JSON object)")
    return state


def write_tracking(run_dir: Path, state: Mapping[str, Any]) -> None:
    """Replace `RUN_DIR/tracking.json` atomically (a kill leaves the old or the new one)."""
    write_atomic(run_dir / TRACKING_FILE, (json.dumps(state, indent=1) + "\n").encode())


T = TypeVar("T")


def _started(key: str, start: Callable[[], T]) -> T:
    """`start()`, with a library's failure (a server unreachable, a store refused) turned
    into a ConfigError naming the key: the run stops before training, at its first step."""
    try:
        return start()
    except ConfigError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise ConfigError(
            f"{key}: cannot start the tracked run: {type(exc).__name__}: {text[0] if text else ''}"
        ) from exc


class Trackers:
    """The trackers `logging.*` turns on, fed every metrics record (rank 0 only).

    Use `Trackers.start(cfg, world_size)` once the run folder exists; `log(record)` for each
    record `metrics.jsonl` gets; `close(status)` with "finished", "preempted", "interrupted" (Ctrl-C, saved) or "failed".
    """

    def __init__(self, run_dir: Path, trackers: dict[str, Tracker], state: dict[str, Any]):
        self.run_dir = run_dir
        self.trackers = trackers
        self.state = state
        self.skipped: dict[str, list[int]] = {}  # kind -> [first, last] step not sent again

    @classmethod
    def start(cls, cfg: Config, world_size: int, *, resumed: bool = True) -> Trackers:
        """Open the trackers; `resumed`: this start loaded a checkpoint (else a new run)."""
        run_dir = Path(cfg.run_dir)
        state = read_tracking(run_dir)
        if not resumed and ("wandb_id" in state or "mlflow_run_id" in state):
            log.info("no checkpoint loaded: training from step 0 is a new tracked run")
            for key in ("wandb_id", "mlflow_run_id", "mlflow_uri", "last_step", "starts"):
                state.pop(key, None)
        state["starts"] = int(state.get("starts", 0)) + 1
        state.setdefault("last_step", {})
        params = run_params(cfg, world_size, state["starts"])
        name = cfg.logging.run_name or run_dir.resolve().name
        trackers: dict[str, Tracker] = {}
        if cfg.logging.wandb != "off":
            wandb_run = _started(
                f"logging.wandb={cfg.logging.wandb}",
                lambda: WandbTracker(run_dir, cfg.logging, state.get("wandb_id"), name, params),
            )
            trackers["wandb"] = wandb_run
            state["wandb_id"] = wandb_run.id
            folders = state.setdefault("wandb_folders", [])
            folder = os.path.relpath(wandb_run.folder, run_dir)
            if folder not in folders:
                folders.append(folder)  # in the order of starts, whatever the node clocks say
        if cfg.logging.mlflow != "off":
            uri = mlflow_uri(cfg.logging, run_dir)
            run_id = state.get("mlflow_run_id") if state.get("mlflow_uri") == uri else None
            key = f"logging.mlflow={shown_url(cfg.logging.mlflow)}"
            if uri.startswith(("http://", "https://")):
                check_server(key, uri)
            mlflow_run = _started(
                key, lambda: MlflowTracker(run_dir, cfg.logging, run_id, name, params)
            )
            trackers["mlflow"] = mlflow_run
            state["mlflow_run_id"], state["mlflow_uri"] = mlflow_run.id, uri
        write_tracking(run_dir, state)
        for name, tracker in trackers.items():
            log.info("tracking with %s: run %s", name, getattr(tracker, "id", "?"))
        return cls(run_dir, trackers, state)

    def log(self, record: Mapping[str, Any]) -> None:
        """Send a metrics record to every tracker, unless its step was sent before."""
        if not self.trackers:
            return
        kind, step = str(record.get("kind", "train")), int(record["step"])
        last = self.state["last_step"].get(kind, -1)
        if step <= last:  # trained again after a resume: the tracker has this step already
            first_last = self.skipped.setdefault(kind, [step, step])
            first_last[1] = step
            return
        values = numeric_values(record)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(values, step)
            except Exception as exc:
                # A tracker server gone mid-run must not end hours of training: metrics.jsonl
                # still has everything. Failing to start a tracker, by contrast, stops the run.
                log.warning(
                    "%s failed at step %d (%s: %s): not used for the rest of this start",
                    name,
                    step,
                    type(exc).__name__,
                    exc,
                )
                del self.trackers[name]
        self.state["last_step"][kind] = step
        write_tracking(self.run_dir, self.state)

    def close(self, status: str) -> None:
        for kind, (first, last) in self.skipped.items():
            log.info(
                "trackers: %s steps %d..%d were trained again after the resume and not sent "
                "again (the trackers keep their first values; metrics.jsonl has both)",
                kind,
                first,
                last,
            )
        errors = []
        for name, tracker in self.trackers.items():
            try:
                tracker.close(status)
            except Exception as exc:  # one tracker failing to close must not hide the others
                errors.append(f"{name}: {exc}")
        if errors:
            log.warning("closing trackers failed: %s", "; ".join(errors))


def start_trackers(cfg: Config, world_size: int, *, resumed: bool) -> Trackers | None:
    """Rank 0 at the start of `fit`, after the resume: the trackers `logging.*` turns on, or
    None for none; `resumed` says whether a checkpoint was loaded (see `Trackers.start`)."""
    if cfg.logging.wandb == "off" and cfg.logging.mlflow == "off":
        return None
    return Trackers.start(cfg, world_size, resumed=resumed)


# ------------------------------------------------------------------------- hpctrain sync
def offline_wandb_folders(run_dir: Path) -> list[Path]:
    """The offline W&B run folders of a run, in the order the run's starts made them.

    That order is the one `tracking.json` recorded; folders it does not name (a record from
    an older hpctrain, or none) follow in name order, which is W&B's start-time order.
    """
    from hpctrain.errors import UsageError

    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a run folder")
    recorded = [run_dir / f for f in read_tracking(run_dir).get("wandb_folders", [])]
    found = sorted((run_dir / "wandb").glob("offline-run-*"))
    folders = [f for f in recorded if f in found] + [f for f in found if f not in recorded]
    if not folders:
        raise UsageError(
            f"{run_dir}: no offline W&B run under {run_dir / 'wandb'} "
            "(a run with logging.wandb=offline writes them there)"
        )
    return folders


def wandb_sync_command(run_dir: Path, *, dry_run: bool = False) -> list[str]:
    """The `wandb sync` command that uploads the offline runs of `run_dir` as one run.

    W&B syncs several folders of one run id one after the other, in order of their start
    times; their steps are disjoint (see the module docstring), so together they form the run.
    Folders already synced are skipped by `wandb sync` itself.
    """
    import sys

    command = [sys.executable, "-m", "wandb", "sync"]
    if dry_run:
        command.append("--dry-run")
    return command + [str(folder) for folder in offline_wandb_folders(run_dir)]
