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
from hpctrain.resilience import records as records_mod
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
    env = {**os.environ, "SLURM_PROCID": str(rank), "SLURMD_NODENAME": node,
           "HPCTRAIN_WATCH_DIR": str(tmp_path / "shm")}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", runner], env=env)
    path = tmp_path / f"node-{node}.json"
    if signal_watcher is not None:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal_watcher)  # the watcher alone: its rank runs on
    code = proc.wait(timeout=120)
    (record,) = json.loads(path.read_text())["ranks"]
    return code, record


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
    gathered = serve_collective(tmp_path, "n1", 2, 30)
    assert gathered.seconds < 30 and sorted(gathered.reached) == ["n2", "n3"]
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
    """What a checkpoint commit leaves: `latest` replaced by a rename (checkpoint/commit.py)."""
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / ".latest.tmp").write_text(f"step-{step}\n")
    os.replace(run_dir / "checkpoints" / ".latest.tmp", run_dir / "checkpoints" / "latest")
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
        "detected": 5.0,
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


def test_a_new_job_keeps_its_own_resume_choice_after_an_interrupted_one(tmp_path: Path) -> None:
    """A rollback (`checkpoint.resume=.../step-10`) submitted after a job the time limit
    killed at step 20: the new job trains from step 10, not from the old job's `latest`;
    once it has committed a checkpoint of its own, its restarts continue from that."""
    cfg = config(tmp_path)
    run_dir = Path(cfg.run_dir)
    begin(cfg, JOB)  # job 42, killed under its attempt after committing step 20
    commit(run_dir, 20)
    rollback = JobFacts(**{**JOB.__dict__, "job_id": "43"})
    first = shell(begin(cfg, rollback))
    assert first["RESUME"] == ""  # the job's own checkpoint.resume stands
    assert read_records(run_dir)[0].kind == "interrupted"
    begun = json.loads((Path(first["ATTEMPT_DIR"]) / "begin.json").read_text())
    assert begun["submission"]["job_id"] == "43" and begun["submission"]["committed"] == 20
    place_attempt(cfg, rollback)
    commit(run_dir, 20)  # trained from 10 again, and saved step 20 anew
    for rank in range(6):
        rank_record(Path(first["ATTEMPT_DIR"]), rank, f"n{rank // 2 + 1}",
                    exit_code=None, signal=int(signal.SIGKILL) if rank == 1 else int(signal.SIGTERM))  # fmt: skip
    assert shell(end_attempt(cfg, rollback, srun_status=137, state="RUNNING"))["NEXT"] == "restart"
    again = shell(begin(cfg, rollback))
    assert again["RESUME"] == "checkpoint.resume=latest"  # its own step 20, committed by it


def test_a_requeued_fresh_start_whose_probe_failed_does_not_resume_the_old_run(
    tmp_path: Path,
) -> None:
    """`--resume none` over an old run's checkpoints, the first attempt's probe failed and
    the job requeued: the requeued attempt starts over as asked (it had resumed the old
    run's `latest`)."""
    cfg = config(tmp_path, "checkpoint.resume=none")
    run_dir = Path(cfg.run_dir)
    commit(run_dir, 30)  # an older run's
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    for node, check in (("n1", "local temp"), ("n2", "/dev/shm"), ("n3", "")):
        probe_record(folder, node, check)
    assert shell(place_attempt(cfg, JOB))["NEXT"] == "requeue"
    requeued = JobFacts(**{**JOB.__dict__, "allocation": ("n4", "n5"), "restart": 1})
    assert shell(begin(cfg, requeued))["RESUME"] == ""


def test_a_requeue_excludes_every_node_set_aside_in_its_allocation(tmp_path: Path) -> None:
    """n2 killed (a spare takes its place), then n3 fails the probe: the requeue excludes
    both (it named n3 only, and the job could land on n2 again)."""
    cfg = config(tmp_path, "slurm.spare_nodes=1")
    run_dir = Path(cfg.run_dir)
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    place_attempt(cfg, JOB)
    commit(run_dir, 10)
    for rank, node in enumerate(("n1", "n1", "n2", "n2")):
        rank_record(folder, rank, node, exit_code=7 if node == "n1" else None,
                    signal=int(signal.SIGKILL) if rank == 2 else None)  # fmt: skip
    first = shell(end_attempt(cfg, JOB, srun_status=137, state="RUNNING"))
    assert (first["NEXT"], first["EXCLUDE"]) == ("restart", "n2")
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    probe_record(folder, "n1")
    probe_record(folder, "n3", "local temp")
    placed = shell(place_attempt(cfg, JOB))
    assert (placed["NEXT"], placed["EXCLUDE"]) == ("requeue", "n2,n3")


def test_failures_over_the_share_of_the_allocation_stop_the_job(tmp_path: Path) -> None:
    """A 1000 s allocation: an earlier attempt lost 300 s (half its 600 s was past its last
    checkpoint), the one now fails too: 30 % > slurm.max_failure_share=0.25."""
    now = time.time()
    job = JobFacts(**{**JOB.__dict__, "start_time": now - 650, "end_time": now + 350})
    for share, action in (("0.25", "stop"), ("0.5", "restart")):
        (tmp_path / share).mkdir()
        cfg = config(tmp_path / share, f"slurm.max_failure_share={share}")
        run_dir = Path(cfg.run_dir)
        (run_dir / "slurm").mkdir(parents=True)
        records_mod.append_record(run_dir, attempts_mod.AttemptRecord(
            attempt=1, job_id="42", restart=0, start=now - 640, end=now - 40, nodes=["n1", "n2"],
            excluded=[], num_tasks=4, kind="distributed", decision="restart", reason="",
            step_reached=20, resumed_from=None, committed=10,
        ))  # fmt: skip
        folder = Path(shell(begin(cfg, job))["ATTEMPT_DIR"])
        place_attempt(cfg, job)
        commit(run_dir, 30)
        for rank in range(6):
            rank_record(folder, rank, f"n{rank // 2 + 1}", exit_code=7)
        ended = shell(end_attempt(cfg, job, srun_status=7, state="RUNNING"))
        assert ended["NEXT"] == action
    (last,) = [r for r in read_records(tmp_path / "0.25" / "run") if r.attempt == 2]
    assert last.reason.startswith(
        "stopped: failures took 30 % of this allocation (slurm.max_failure_share=0.25)"
    )


# srun's own lines on the dev cluster (SLURM 22.05) when n2's watcher, rank and slurmd were
# killed: n2's slurmstepd reports its task killed, then srun ends the step
# (--kill-on-bad-exit) and n1's rank, its peer gone, exits 7.
NODE_WENT_AWAY = """srun: error: n2: tasks 2-3: Killed
srun: launch/slurm: _step_signal: Terminating StepId=42.1
srun: error: n1: tasks 0-1: Exited with exit code 7
srun: Force Terminated StepId=42.1
"""
# A rank that outlived srun's TERM (heartbeat off, its peers' collectives timed out):
# srun reports it killed after it began ending the step.
OUTLIVED_TERM = """srun: error: n1: tasks 0-1: Exited with exit code 7
srun: launch/slurm: _step_signal: Terminating StepId=42.1
srun: error: n2: tasks 2-3: Killed
srun: Force Terminated StepId=42.1
"""


@pytest.mark.parametrize(("lines", "kind"), [(NODE_WENT_AWAY, "lost"), (OUTLIVED_TERM, "hang")])
def test_a_task_srun_reports_killed_before_it_ended_the_step_went_away_with_its_node(
    tmp_path: Path, lines: str, kind: str
) -> None:
    """n2's watchers and ranks killed with its slurmd (the chaos test's lost node): srun
    reported n2's tasks killed before it ended the step, so they did not outlive its TERM:
    the node went away (`lost`). Was `hang` (#47): any task line counted as the node having
    been there when srun ended the step. One that srun reports killed after it began
    ending the step did outlive the TERM: still a `hang`."""
    cfg = config(tmp_path, "slurm.spare_nodes=1")
    folder = Path(shell(begin(cfg, JOB))["ATTEMPT_DIR"])
    place_attempt(cfg, JOB)
    commit(Path(cfg.run_dir), 10)
    for rank in (0, 1):
        rank_record(folder, rank, "n1", ended=5.0, exit_code=7, received=["SIGTERM"])
    for rank in (2, 3):
        rank_record(folder, rank, "n2", ended=None, exit_code=None)
    (folder / "srun.log").write_text(lines)
    ended = shell(end_attempt(cfg, JOB, srun_status=137, state="RUNNING"))
    assert (ended["NEXT"], ended["EXCLUDE"]) == ("restart", "n2")
    (rec,) = read_records(Path(cfg.run_dir))
    assert (rec.kind, rec.first_failure["node"]) == (kind, "n2"), rec  # type: ignore[index]


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
    (tmp_path / "slurm" / records_mod.RECORDS).write_text('{"attempt": 1, "job_id": "1"\n')
    assert read_records(tmp_path) == []


def test_the_nodes_to_train_on_are_the_allocations_less_the_spares(tmp_path: Path) -> None:
    """`#SBATCH --nodes` edited by hand (3 nodes for a config's 2) trains on all three."""
    from hpctrain.resilience.attempts import nodes_to_train

    assert nodes_to_train(config(tmp_path), JOB) == 3
    assert nodes_to_train(config(tmp_path, "slurm.spare_nodes=1"), JOB) == 2
    assert nodes_to_train(config(tmp_path), JobFacts("", 0, (), 1, None)) == 2  # slurm.nodes
    # auto: the spares chosen when the job was rendered are what slurm.nodes leaves
    assert nodes_to_train(config(tmp_path, "slurm.spare_nodes=auto"), JOB) == 2


def test_restarts_are_not_counted_unless_max_restarts_is_set(tmp_path: Path) -> None:
    from hpctrain.resilience.attempts import policy_of

    assert policy_of(config(tmp_path), JOB).max_restarts == 0  # bounded by progress and time
    assert policy_of(config(tmp_path, "slurm.max_restarts=3"), JOB).max_restarts == 3
