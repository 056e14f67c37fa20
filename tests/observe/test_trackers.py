"""Trackers with the real libraries: W&B offline (its files read back) and MLflow's local store
(read back with MLflow's own client), one tracked run across starts, `hpctrain sync`."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import Config, ConfigError, with_overrides
from hpctrain.errors import install_hint
from hpctrain.observe import trackers
from hpctrain.observe.trackers import Trackers, check_trackers, wandb_sync_command
from tests.support.train_kit import REPO, run_hpctrain


def make_cfg(run_dir: Path, *overrides: str) -> Config:
    return with_overrides(Config(), [f"run_dir={run_dir}", *overrides])


def train_record(step: int, loss: float) -> dict[str, Any]:
    return {"kind": "train", "step": step, "epoch": 0, "loss": loss, "lr": 0.1, "note": "x"}


def eval_record(step: int, accuracy: float) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "epoch": 0, "val_accuracy": accuracy}


def test_a_missing_package_fails_with_the_pip_line(tmp_path, monkeypatch):
    real_find_spec = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util,
        "find_spec",
        lambda name: None if name in ("wandb", "alembic") else real_find_spec(name),
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(f"logging.wandb=offline needs the wandb package: {install_hint('wandb')}"),
    ):
        check_trackers(make_cfg(tmp_path, "logging.wandb=offline").logging)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"logging.mlflow=local needs the alembic package: {install_hint('mlflow')}"
        ),
    ):
        check_trackers(make_cfg(tmp_path, "logging.mlflow=local").logging)
    check_trackers(make_cfg(tmp_path).logging)  # all off: nothing needed
    with pytest.raises(
        ConfigError, match="logging.mlflow='lcoal': must be off, local or a tracking URI"
    ):
        check_trackers(make_cfg(tmp_path, "logging.mlflow=lcoal").logging)


def test_a_tracker_that_cannot_start_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # a port nothing listens on: the connection is refused at once
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = make_cfg(tmp_path, f"logging.mlflow=http://127.0.0.1:{port}")
    with pytest.raises(
        ConfigError, match=f"logging.mlflow=http://127.0.0.1:{port}: no answer from"
    ):
        Trackers.start(cfg, world_size=1)


UNANSWERED_SCENARIO = """
import sys, time
from hpctrain.config import Config, ConfigError, with_overrides
from hpctrain.observe.trackers import Trackers

cfg = with_overrides(Config(), [f"run_dir={sys.argv[1]}", sys.argv[2]])
began = time.monotonic()
try:
    Trackers.start(cfg, world_size=1, resumed=False)
except ConfigError as exc:
    print(f"{time.monotonic() - began:.1f}", exc, sep="\\t")
"""


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_server_that_does_not_answer_fails_in_seconds_naming_it(tmp_path, tracker):
    """Issue 32: MLflow's HTTP retries took 4 minutes on a closed port (W&B waits 90 s)."""
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://someone:s3cret@127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update(PYTHONPATH=str(REPO / "src"), MLFLOW_DISABLE_TELEMETRY="true")
    if tracker == "mlflow":
        override = f"logging.mlflow={url}"
    else:
        override = "logging.wandb=online"
        env.update(WANDB_BASE_URL=url, WANDB_API_KEY="0" * 40, WANDB_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", UNANSWERED_SCENARIO, str(tmp_path / "run"), override],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    seconds, _, message = done.stdout.strip().partition("\t")
    assert message, (done.stdout, done.stderr[-2000:])
    assert float(seconds) < 15, message
    assert f"logging.{tracker}=" in message and f"no answer from http://127.0.0.1:{port}" in message
    assert "s3cret" not in done.stdout + done.stderr and "\n" not in message


def test_a_server_that_answers_is_left_to_the_client():
    """Any answer counts, a TLS handshake the probe cannot verify included: the tracker's
    client has its own certificate settings (MLFLOW_TRACKING_SERVER_CERT_PATH, ...)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def answer() -> None:
        for reply in (b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n", b"not TLS\r\n"):
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    try:
        trackers.check_server("logging.mlflow=x", f"http://127.0.0.1:{port}")  # a 404
        trackers.check_server("logging.mlflow=x", f"https://127.0.0.1:{port}")  # not TLS
    finally:
        thread.join(timeout=10)
        server.close()


def test_run_params_name_the_code_and_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "81234")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    repo = tmp_path / "code"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "task.py").write_text("X = 1\n")
    subprocess.run([*git, "add", "task.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.chdir(repo)
    params = trackers.run_params(make_cfg(tmp_path, "train.lr=0.5"), world_size=4, start=3)
    assert params["git_commit"] == head
    assert params["config.train.lr"] == 0.5 and params["config.checkpoint.async"] is False
    assert params["slurm_job_id"] == "81234" and params["slurm_restart_count"] == 2
    assert params["world_size"] == 4 and params["start"] == 3
    assert params["torch_version"] and params["hpctrain_version"]
    (repo / "task.py").write_text("X = 2\n")
    assert trackers.git_commit(repo) == f"{head}-dirty"
    assert trackers.git_commit(tmp_path) is None  # not a repository


def test_steps_after_a_rollback_are_not_sent_again(tmp_path):
    sent: list[tuple[int, dict[str, float]]] = []

    class Recorder:
        def log(self, values: dict[str, float], step: int) -> None:
            sent.append((step, values))

        def close(self, status: str) -> None:
            pass

    state: dict[str, Any] = {"last_step": {}}
    first = Trackers(tmp_path, {"r": Recorder()}, state)
    for step in (1, 2, 3, 4):
        first.log(train_record(step, 1.0 / step))
    first.log(eval_record(4, 0.5))
    # A resume from the checkpoint of step 2: steps 3 and 4 are trained and logged again.
    again = Trackers(tmp_path, {"r": Recorder()}, trackers.read_tracking(tmp_path))
    for step in (3, 4, 5):
        again.log(train_record(step, 9.0))
    again.log(eval_record(4, 0.9))  # already sent for step 4
    again.log(eval_record(5, 0.8))
    assert [step for step, _ in sent] == [1, 2, 3, 4, 4, 5, 5]
    assert sent[3][1] == {"epoch": 0.0, "loss": 0.25, "lr": 0.1}  # the first values stand
    assert sent[5][1]["loss"] == 9.0 and sent[6][1] == {"epoch": 0.0, "val_accuracy": 0.8}
    assert again.skipped == {"train": [3, 4], "eval": [4, 4]}
    assert trackers.read_tracking(tmp_path)["last_step"] == {"train": 5, "eval": 5}


def test_a_tracker_failing_mid_run_is_dropped_not_the_training(tmp_path, caplog):
    sent: list[int] = []

    class Broken:
        def log(self, values: dict[str, float], step: int) -> None:
            raise ConnectionError("server gone")

        def close(self, status: str) -> None:
            pass

    class Recorder(Broken):
        def log(self, values: dict[str, float], step: int) -> None:
            sent.append(step)

    both = Trackers(tmp_path, {"mlflow": Broken(), "wandb": Recorder()}, {"last_step": {}})
    with caplog.at_level("WARNING", logger="hpctrain"):
        both.log(train_record(1, 1.0))
        both.log(train_record(2, 1.0))
    assert sent == [1, 2] and list(both.trackers) == ["wandb"]
    assert "mlflow failed at step 1 (ConnectionError: server gone)" in caplog.text


def test_a_damaged_tracking_record_is_named(tmp_path):
    (tmp_path / "tracking.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="tracking.json: unreadable tracking record"):
        trackers.read_tracking(tmp_path)


# ------------------------------------------------------------------------------ MLflow
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_mlflow_local_store_one_run_across_starts(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_cfg(run_dir, "logging.mlflow=local", "logging.project=shapes", "train.lr=0.25")
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    first = Trackers.start(cfg, world_size=2)
    for step in (1, 2, 3):
        first.log(train_record(step, 1.0 / step))
    first.log(eval_record(3, 0.5))
    first.close("preempted")
    run_id = trackers.read_tracking(run_dir)["mlflow_run_id"]

    monkeypatch.setenv("SLURM_JOB_ID", "101")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    second = Trackers.start(cfg, world_size=1)  # resumed from step 2 on one rank
    assert second.state["mlflow_run_id"] == run_id
    for step in (3, 4):
        second.log(train_record(step, 5.0))
    second.log(eval_record(4, 0.75))
    second.close("finished")

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    # A start that loads no checkpoint (--resume none) trains from step 0: a new tracked run.
    fresh = Trackers.start(cfg, world_size=1, resumed=False)
    assert fresh.state["mlflow_run_id"] != run_id and fresh.state["starts"] == 1
    fresh.log(train_record(1, 7.0))  # step 1 again, sent: it is another run
    fresh.close("finished")
    assert [m.step for m in client.get_metric_history(fresh.state["mlflow_run_id"], "loss")] == [1]
    experiment = client.get_experiment_by_name("shapes")
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted([run_id, fresh.state["mlflow_run_id"]])  # one for both starts
    run = runs[run_id]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["config.train.lr"] == "0.25"
    assert run.data.params["torch_version"] and run.data.params["git_commit"]
    assert "world_size" not in run.data.params  # per start: tags, updated by each start
    assert run.data.tags["hpctrain.slurm_job_id"] == "101"
    assert run.data.tags["hpctrain.slurm_restart_count"] == "1"
    assert run.data.tags["hpctrain.world_size"] == "1" and run.data.tags["hpctrain.start"] == "2"
    losses = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert sorted(losses) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 5.0)]
    accuracy = [(m.step, m.value) for m in client.get_metric_history(run_id, "val_accuracy")]
    assert sorted(accuracy) == [(3, 0.5), (4, 0.75)]
    assert "note" not in run.data.metrics and "kind" not in run.data.metrics
    assert (run_dir / "mlflow" / "mlflow.db").is_file()


def test_mlflow_file_store_follows_mlflows_rule(tmp_path, monkeypatch):
    """Issue 32: `./mlruns` was refused even with MLFLOW_ALLOW_FILE_STORE=true."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(tmp_path / "run", "logging.mlflow=./mlruns", "logging.project=shapes")
    for refused in (None, "false", "0"):  # MLflow 3 refuses its file store unless told
        if refused is None:
            monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        else:
            monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", refused)
        with pytest.raises(ConfigError, match="needs MLFLOW_ALLOW_FILE_STORE=true"):
            check_trackers(cfg.logging)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")
    with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE='yes': must be true, false"):
        check_trackers(cfg.logging)
    for allowed in ("1", "TRUE"):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allowed)
        check_trackers(cfg.logging)
    (tmp_path / "run").mkdir()
    run = Trackers.start(cfg, world_size=1)
    run.log(train_record(1, 0.5))
    run.close("finished")
    client = MlflowClient(tracking_uri="./mlruns")
    history = client.get_metric_history(run.state["mlflow_run_id"], "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]
    assert (tmp_path / "mlruns").is_dir()


# ------------------------------------------------------------------------------ W&B offline
@pytest.fixture
def network_trap() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback listener that every proxy variable points to: what reaches it is a request
    that would have left the machine. Yields its URL and the requests it received."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    received: list[bytes] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    received.append(conn.recv(4096) or b"(connected)")
                except OSError:
                    received.append(b"(connected)")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", received
    done.set()
    thread.join()
    server.close()


WANDB_SCENARIO = """
import sys
from pathlib import Path
from hpctrain.config import Config, with_overrides
from hpctrain.observe.trackers import Trackers

run_dir = Path(sys.argv[1])
cfg = with_overrides(Config(), [f"run_dir={run_dir}", "logging.wandb=offline",
                                "logging.project=shapes", "train.lr=0.25"])
start = int(sys.argv[2])
first, last, status = (1, 5, "preempted") if start == 1 else (3, 8, "finished")
trackers = Trackers.start(cfg, world_size=2)
for step in range(first, last + 1):  # the second start resumed from step 2
    trackers.log({"kind": "train", "step": step, "loss": start * 10.0 + step})
    if step % 4 == 0:
        trackers.log({"kind": "eval", "step": step, "val_accuracy": step / 10})
trackers.close(status)
print("id", trackers.state["wandb_id"])
"""


def read_wandb_file(path: Path) -> Iterator[Any]:
    """The records of a `.wandb` file: W&B's block log format (7-byte header, 32 KiB blocks of
    [crc32 u32, length u16, type u8] chunks; types FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0:  # zero padding up to the end of the block
            pos += left - 7
            continue
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(folder: Path) -> list[tuple[int, dict[str, float]]]:
    rows = []
    for record in read_wandb_file(next(folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            values = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append((record.history.step.num, values))
    return rows


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_wandb_offline_one_run_across_starts_touches_no_network(tmp_path, network_trap):
    proxy, received = network_trap
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("WANDB_") and key.lower() not in ("no_proxy",)
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = proxy
    env.update(
        WANDB_BASE_URL=proxy,  # W&B's own server, should anything try to reach it
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
    )
    ids = []
    for start in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-c", WANDB_SCENARIO, str(run_dir), str(start)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,  # offline must not wait for a network that is not there
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids.append(proc.stdout.split()[-1])
    assert ids[0] == ids[1]
    assert received == []  # nothing tried to leave the machine

    record = trackers.read_tracking(run_dir)
    folders = [run_dir / f for f in record["wandb_folders"]]
    assert len(folders) == 2 and all(f.name.endswith(f"-{ids[0]}") for f in folders)
    assert all(f.name.startswith("offline-run-") for f in folders)
    first, second = wandb_history(folders[0]), wandb_history(folders[1])
    # Steps continue across starts: 1..5 from the first, then 6..8 (3..5 were trained again
    # after the resume and are not sent twice; W&B keeps the first values).
    assert [step for step, _ in first] == [1, 2, 3, 4, 5]
    assert [step for step, _ in second] == [6, 7, 8]
    assert first[3][1]["loss"] == 14.0 and first[3][1]["val_accuracy"] == 0.4
    assert second[0][1]["loss"] == 26.0 and second[2][1]["val_accuracy"] == 0.8
    run_records = [
        r.run for r in read_wandb_file(next(folders[0].glob("run-*.wandb"))) if r.HasField("run")
    ]
    config = {item.key: json.loads(item.value_json) for item in run_records[0].config.update}
    assert run_records[0].project == "shapes" and run_records[0].display_name == "run"
    assert config["config.train.lr"] == 0.25 and config["world_size"] == 2


def test_sync_finds_the_offline_folders_in_the_order_of_starts(tmp_path):
    # Uploading needs the network (a W&B server and an API key): what is tested here is the
    # folders and the command; `--dry-run` is W&B's own listing, which works offline.
    run_dir = tmp_path / "run"
    wandb_dir = run_dir / "wandb"
    # The second start's node clock was behind: its folder sorts first by name.
    names = ["offline-run-20261130_120000-abc", "offline-run-20261130_110000-abc"]
    for name in [*names, "offline-run-20261129_000000-old"]:
        (wandb_dir / name).mkdir(parents=True)
    trackers.write_tracking(run_dir, {"wandb_folders": [f"wandb/{n}" for n in names]})
    command = wandb_sync_command(run_dir)
    assert command[:4] == [sys.executable, "-m", "wandb", "sync"]
    assert command[4:] == [str(wandb_dir / n) for n in [*names, "offline-run-20261129_000000-old"]]
    assert "--dry-run" in wandb_sync_command(run_dir, dry_run=True)


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_sync_cli_lists_a_real_offline_run_and_names_bad_folders(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["WANDB_CONFIG_DIR"] = str(tmp_path / "wandb-config")
    proc = subprocess.run(
        [sys.executable, "-c", WANDB_SCENARIO, str(run_dir), "1"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = run_hpctrain("sync", str(run_dir), "--dry-run")
    assert listed.stdout.startswith("wandb sync --dry-run ")
    assert "Would sync 1 run(s)" in listed.stdout + listed.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_hpctrain("sync", str(empty), check=False)
    assert missing.returncode == 2
    assert f"{empty}: no offline W&B run under {empty / 'wandb'}" in missing.stderr
    nothing = run_hpctrain("sync", str(tmp_path / "nope"), check=False)
    assert nothing.returncode == 2 and "not a run folder" in nothing.stderr


def test_metrics_writer_feeds_the_trackers_and_closes_them(tmp_path):
    from hpctrain.observe.metrics import MetricsWriter

    calls: list[Any] = []

    class Fake:
        def log(self, record: dict[str, Any]) -> None:
            calls.append(("log", record["step"]))

        def close(self, status: str) -> None:
            calls.append(("close", status))

    writer = MetricsWriter(
        tmp_path,
        enabled=True,
        progress="lines",
        total_steps=2,
        tensorboard=False,
        trackers=Fake(),  # type: ignore[arg-type]
    )
    writer.write(
        {
            **train_record(1, 0.5),
            "samples_per_s": 1.0,
            "data_wait_fraction": 0.0,
            "data_wait_fraction_worst": 0.0,
            "step_time_s": 0.1,
        }
    )
    writer.write(eval_record(1, 0.25))
    writer.close("preempted")
    assert calls == [("log", 1), ("log", 1), ("close", "preempted")]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert trackers.start_trackers(make_cfg(tmp_path), world_size=1, resumed=False) is None
    assert not (tmp_path / "tracking.json").exists()


# ------------------------------------------------------------------------------ end to end
@pytest.mark.distributed
@pytest.mark.slow
def test_requeued_two_rank_run_is_one_tracked_run_with_a_best_checkpoint(
    shapes_shards, tmp_path, monkeypatch
):
    """A 2-rank run interrupted by USR2 (exit 75) and started again: one MLflow run and one
    W&B run id with continuous steps, the best checkpoint kept and exported."""
    from mlflow.tracking import MlflowClient

    from tests.checkpoint.test_resume_e2e import train_with_signal_at
    from tests.support.train_kit import train_args

    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    run_dir = tmp_path / "run"
    args = train_args(
        shapes_shards,
        run_dir,
        "train.max_steps=8",
        "task=tests.support.slow_tasks:SlowImageClassification",
        "task_options.step_s=0.2",  # the signal arrives before the last step
        "train.eval_every=2",
        "checkpoint.monitor=val_loss",
        "checkpoint.mode=min",
        "checkpoint.keep_best=1",
        "checkpoint.keep_last=1",
        "logging.mlflow=local",
        "logging.wandb=offline",
        "logging.project=e2e",
    )
    train_with_signal_at(args, run_dir, step=3)
    first_record = trackers.read_tracking(run_dir)
    assert first_record["starts"] == 1
    run_hpctrain("train", *args, "--nproc", "2")

    record = trackers.read_tracking(run_dir)
    assert record["starts"] == 2 and record["wandb_id"] == first_record["wandb_id"]
    assert record["mlflow_run_id"] == first_record["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["config.checkpoint.monitor"] == "val_loss"
    assert runs[0].data.tags["hpctrain.start"] == "2"
    loss_steps = sorted(m.step for m in client.get_metric_history(record["mlflow_run_id"], "loss"))
    assert loss_steps == list(range(1, 9))  # every step once, across the two starts
    eval_steps = sorted(
        m.step for m in client.get_metric_history(record["mlflow_run_id"], "val_loss")
    )
    assert eval_steps == [2, 4, 6, 8]

    folders = [run_dir / f for f in record["wandb_folders"]]
    assert len(folders) == 2
    first, second = wandb_history(folders[0]), wandb_history(folders[1])
    steps = [step for step, _ in first] + [step for step, _ in second]
    assert steps == sorted(set(steps)) and steps[-1] == 8 and first and second

    # The best checkpoint by val_loss is kept besides the newest, and exports.
    root = run_dir / "checkpoints"
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    best_step = min((e["val_loss"], e["step"]) for e in evals)[1]
    assert (root / "best").read_text().strip() == f"step-{best_step}"
    assert (root / f"step-{best_step}").is_dir() and (root / "step-8").is_dir()
    out = tmp_path / "best.safetensors"
    exported = run_hpctrain("export", str(run_dir), str(out), "--best")
    assert f"(step {best_step})" in exported.stdout
    assert not out.with_suffix(".json").exists()  # the slow task is a custom task: no card
    listed = run_hpctrain("sync", str(run_dir), "--dry-run")  # both starts' folders, in order
    assert listed.stdout.splitlines()[0].endswith(" ".join(str(f) for f in folders))
    assert "Would sync 2 run(s)" in listed.stdout + listed.stderr
