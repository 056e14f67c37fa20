"""The attempts' files and processes without SLURM: the watcher of a rank, the health probe,
and the steps `begin`/`place`/`end` of `python -m hpctrain.resilience.attempts` on a run folder.

The decisions themselves are tested in test_restart_policy.py; the whole loop of the job
script, with srun and scontrol stubbed, in test_attempt_loop.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hpctrain.config import load_config
from hpctrain.resilience import attempts as attempts_mod
from hpctrain.resilience.attempts import JobFacts, begin, end_attempt, place_attempt, read_records
from hpctrain.resilience.probe import (
    CheckFailed,
    check_gpus,
    join_collective,
    run_probe,
    serve_collective,
)

JOB = JobFacts(job_id="42", restart=0, allocation=("n1", "n2", "n3"), tasks_per_node=2,
               end_time=None)  # fmt: skip


def watch(tmp_path: Path, script: str, *, rank: int = 1, node: str = "n2",
          signal_watcher: int | None = None) -> tuple[int, dict]:  # fmt: skip
    """Run a watcher whose rank runs `script` (Python); its exit status and record."""
    runner = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from hpctrain.resilience.watch import Watcher
        sys.exit(Watcher(Path({str(tmp_path)!r}), [sys.executable, "-c", {script!r}]).run())
    """)
    env = {**os.environ, "SLURM_PROCID": str(rank), "SLURMD_NODENAME": node}
    proc = subprocess.Popen([sys.executable, "-c", runner], env=env)
    if signal_watcher is not None:
        path = tmp_path / f"rank-{rank}.json"
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal_watcher)  # the watcher alone: its rank runs on
    code = proc.wait(timeout=120)
    return code, json.loads((tmp_path / f"rank-{rank}.json").read_text())


@pytest.mark.slow  # a process or two (seconds)
def test_the_watcher_records_an_exit_code_and_passes_it_on(tmp_path: Path) -> None:
    code, record = watch(tmp_path, "raise SystemExit(3)")
    assert code == 3
    assert (record["rank"], record["node"], record["exit_code"], record["signal"]) == (
        1,
        "n2",
        3,
        None,
    )
    assert record["started"] <= record["ended"]


@pytest.mark.slow  # a process or two (seconds)
def test_the_watcher_records_the_signal_that_killed_its_rank(tmp_path: Path) -> None:
    code, record = watch(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert code == 128 + signal.SIGKILL  # as a shell says it
    assert record["signal"] == signal.SIGKILL and record["exit_code"] is None


@pytest.mark.slow  # a process or two (seconds)
def test_the_watcher_notes_slurms_signals_and_waits_for_its_rank(tmp_path: Path) -> None:
    code, record = watch(tmp_path, "import time; time.sleep(2)", signal_watcher=signal.SIGTERM)
    assert code == 0 and record["exit_code"] == 0 and record["received"] == ["SIGTERM"]


# ------------------------------------------------------------------------------ the probe
def config(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "index.json").write_text("{}")
    return load_config(None, [f"run_dir={tmp_path / 'run'}", f"data.train={data / 'index.json'}",
                              "slurm.nodes=2", *overrides])  # fmt: skip


def test_a_healthy_node_passes_every_check(tmp_path: Path) -> None:
    record = run_probe(tmp_path, config(tmp_path), gpus=0, rank=0, num_nodes=1, node="n1")
    assert record["failed_check"] == "" and set(record["seconds"]) >= {
        "run folder",
        "data",
        "local temp",
    }
    assert json.loads((tmp_path / "probe-n1.json").read_text()) == record


def test_a_node_whose_temp_folder_is_unusable_fails_it_and_says_which(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The marker the SLURM tests use: a folder where this node's probe file should go."""
    temp = tmp_path / "tmp"
    (temp / "hpctrain-probe-n2").mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    cfg = config(tmp_path)
    assert run_probe(tmp_path, cfg, gpus=0, rank=0, num_nodes=1, node="n1")["failed_check"] == ""
    record = run_probe(tmp_path, cfg, gpus=0, rank=0, num_nodes=1, node="n2")
    assert (record["failed_check"], record["shared"]) == ("local temp", False)
    assert capsys.readouterr().out.startswith(
        f"hpctrain probe: n2 failed local temp: {temp / 'hpctrain-probe-n2'}: Is a directory"
    )


def test_missing_data_fails_a_shared_check(tmp_path: Path) -> None:
    cfg = config(tmp_path, f"data.train={tmp_path / 'nowhere' / 'index.json'}")
    record = run_probe(tmp_path, cfg, gpus=0, rank=0, num_nodes=1, node="n1")
    assert (record["failed_check"], record["shared"]) == ("data", True)
    assert "No such file or directory" in str(record["message"])


def test_too_few_gpus_fail_the_node() -> None:
    """No GPU here: the count CUDA's driver gives is faked (the GPU script runs the real one)."""
    check_gpus(4, count=lambda: 4)
    with pytest.raises(CheckFailed, match="2 GPU\\(s\\) visible, 4 expected"):
        check_gpus(4, count=lambda: 2)


def test_the_collective_gathers_every_node_and_names_one_that_cannot_come(tmp_path: Path) -> None:
    results: dict[str, object] = {}

    def join(node: str) -> None:
        results[node] = join_collective(tmp_path, node, 30)

    peers = [threading.Thread(target=join, args=(n,)) for n in ("n2", "n3")]
    for peer in peers:
        peer.start()
    assert serve_collective(tmp_path, "n1", 2, 30) < 30
    for peer in peers:
        peer.join(30)
    assert set(results) == {"n2", "n3"}
    alone = tmp_path / "alone"
    alone.mkdir()
    with pytest.raises(CheckFailed, match="no other node reached n1 within 0.2 s"):
        serve_collective(alone, "n1", 1, 0.2)
    with pytest.raises(CheckFailed, match="the first node published no address within 0.2 s"):
        join_collective(tmp_path / "nobody", "n2", 0.2)


# ------------------------------------------------------------------------------ the steps
def shell(text: str) -> dict[str, str]:
    """The assignments a step printed for the script's eval (an array as its words joined)."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if value.startswith("(") and value.endswith(")"):
            values[key] = " ".join(shlex.split(value[1:-1]))
        else:
            values[key] = " ".join(shlex.split(value))
    return values


def rank_record(folder: Path, rank: int, node: str, **end: object) -> None:
    (folder / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "node": node, "started": 1.0, "ended": 2.0, "exit_code": 0,
         "signal": None, **end}))  # fmt: skip


def probe_record(folder: Path, node: str, check: str = "") -> None:
    (folder / f"probe-{node}.json").write_text(json.dumps(
        {"node": node, "failed_check": check, "message": "bad" if check else "", "shared": False}))  # fmt: skip


def commit(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "latest").write_text(f"step-{step}\n")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": step + 1}) + "\n")


def test_a_killed_rank_on_a_spare_allocation_restarts_without_its_node(tmp_path: Path) -> None:
    cfg = config(tmp_path, "slurm.spare_nodes=1")
    run_dir = Path(cfg.run_dir)
    first = shell(begin(cfg, JOB))
    assert (first["ATTEMPT"], first["PROBE_NODES"], first["NUM_PROBE_NODES"]) == (
        "1",
        "n1,n2,n3",
        "3",
    )
    assert first["HPCTRAIN_ATTEMPT"] == "1" and first["RESUME"] == ""
    folder = Path(first["ATTEMPT_DIR"])
    for node in ("n1", "n2", "n3"):
        probe_record(folder, node)
    placed = shell(place_attempt(cfg, JOB))
    assert (placed["NEXT"], placed["TRAIN_NODES"], placed["NUM_TASKS"]) == ("train", "n1,n2", "4")
    commit(run_dir, 10)
    rank_record(folder, 0, "n1", ended=5.1, exit_code=7)
    rank_record(folder, 1, "n1", ended=5.2, exit_code=7)
    rank_record(folder, 2, "n2", ended=5.0, exit_code=None, signal=int(signal.SIGKILL))
    rank_record(folder, 3, "n2", ended=5.3, exit_code=None, signal=int(signal.SIGTERM))
    ended = shell(end_attempt(cfg, JOB, srun_status=143, state="RUNNING"))
    assert (ended["NEXT"], ended["EXCLUDE"], ended["EXIT"]) == ("restart", "n2", "0")
    (rec,) = read_records(run_dir)
    assert (rec.kind, rec.decision, rec.nodes, rec.num_tasks) == (
        "signal",
        "restart",
        ["n1", "n2"],
        4,
    )
    assert rec.first_failure == {
        "rank": 2,
        "node": "n2",
        "exit_code": None,
        "signal": "SIGKILL",
        "time": 5.0,
    }
    assert (rec.resumed_from, rec.committed, rec.step_reached) == (None, 10, 11)
    assert rec.set_aside == {"n2": "signal: rank 2 on n2 killed by SIGKILL"}

    second = shell(begin(cfg, JOB))
    # no probe after a SIGKILL (slurm.probe_after_kill), and n2 stays aside
    assert (second["ATTEMPT"], second["PROBE_NODES"], second["NUM_PROBE_NODES"]) == ("2", "", "0")
    assert (
        second["RESUME"] == "checkpoint.resume=latest"
    )  # the run's own newest, whatever the config
    folder = Path(second["ATTEMPT_DIR"])
    assert shell(place_attempt(cfg, JOB))["TRAIN_NODES"] == "n1,n3"
    for rank, node in enumerate(("n1", "n1", "n3", "n3")):
        rank_record(folder, rank, node)
    assert shell(end_attempt(cfg, JOB, srun_status=0, state="RUNNING"))["NEXT"] == "done"
    assert [r.excluded for r in read_records(run_dir)] == [[], ["n2"]]


def test_a_probe_that_leaves_too_few_nodes_requeues_without_them(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    probe_record(folder, "n1")
    probe_record(folder, "n2", "local temp")
    probe_record(folder, "n3", "/dev/shm")
    placed = shell(place_attempt(cfg, JOB))
    assert (placed["NEXT"], placed["EXCLUDE"]) == ("requeue", "n2,n3")
    (rec,) = read_records(Path(cfg.run_dir))
    assert (rec.kind, rec.nodes, rec.num_tasks) == ("probe", [], 0)
    assert set(rec.set_aside) == {"n2", "n3"}


def test_a_config_error_stops_after_one_attempt_with_its_code(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    place_attempt(cfg, JOB)  # no probe: every node trains, 3 x 2 ranks
    for rank in range(6):
        rank_record(folder, rank, f"n{rank // 2 + 1}", exit_code=2)
    ended = shell(end_attempt(cfg, JOB, srun_status=2, state="RUNNING"))
    assert (ended["NEXT"], ended["EXIT"]) == ("stop", "2")
    assert [r.kind for r in read_records(Path(cfg.run_dir))] == ["user"]


def test_an_attempt_the_job_never_finished_is_closed_by_the_next(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    place_attempt(cfg, JOB)
    commit(Path(cfg.run_dir), 20)
    requeued = JobFacts(**{**JOB.__dict__, "restart": 1})
    after = shell(begin(cfg, requeued))
    assert after["ATTEMPT"] == "2" and after["RESUME"] == "checkpoint.resume=latest"
    (rec,) = read_records(Path(cfg.run_dir))
    assert (rec.attempt, rec.kind, rec.decision, rec.committed) == (1, "interrupted", "requeue", 20)
    assert folder.is_dir()


@pytest.mark.slow  # a process or two (seconds)
def test_the_steps_run_as_a_module_with_the_jobs_variables(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"run_dir: {tmp_path / 'run'}\n")
    env = {**os.environ, "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NTASKS_PER_NODE": "2"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "hpctrain.resilience.attempts", "begin", "--down", "n2", str(cfg_file)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "PROBE_NODES=n1\n" in done.stdout
    assert done.stderr == "hpctrain: attempt 1 (job 9, restart 0) probes n1, n2 set aside\n"
    bad = subprocess.run(
        [sys.executable, "-m", "hpctrain.resilience.attempts", "place", str(cfg_file), "slurm.nodes=0"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "config error: slurm.nodes" in bad.stderr


@pytest.mark.slow  # a process or two (seconds)
def test_the_module_steps_import_no_torch() -> None:
    code = "import sys, hpctrain.resilience.attempts, hpctrain.resilience.probe, hpctrain.resilience.watch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (
        out.stdout.strip() == "False"
    )  # each step costs a fraction of a second, not torch's import


def test_unreadable_history_lines_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / attempts_mod.RECORDS).write_text('{"attempt": 1, "job_id": "1"\n')
    assert read_records(tmp_path) == []


def test_the_nodes_to_train_on_are_the_allocations_less_the_spares(tmp_path: Path) -> None:
    """`#SBATCH --nodes` edited by hand (3 nodes for a config's 2) trains on all three."""
    from hpctrain.resilience.attempts import nodes_to_train

    assert nodes_to_train(config(tmp_path), JOB) == 3
    assert nodes_to_train(config(tmp_path, "slurm.spare_nodes=1"), JOB) == 2
    assert nodes_to_train(config(tmp_path), JobFacts("", 0, (), 1, None)) == 2  # slurm.nodes
