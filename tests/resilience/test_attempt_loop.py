"""The job script's loop of attempts, run by bash with srun, squeue, sinfo and scontrol stubbed.

The rendered script (what `hpctrain sbatch` writes, and what the submitit job runs) is run as
is; `tests/support/fake_slurm/` stands in for SLURM's commands (srun runs a step's tasks on
this machine) and for the interpreter of the ranks: the attempts steps and the probe run for
real, and each rank's training is a shell line of the scenario (exit 7, `kill -9 $$`...) under
the real watcher. The real thing, on the dev cluster: test_slurm_restarts.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.launch.profiles import load_profile, resolve_job
from hpctrain.launch.sbatch import render_sbatch

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_slurm"
pytestmark = pytest.mark.slow  # a dozen short processes a scenario

# What the ranks do, by (attempt, rank); anything not named exits 0.
COMMIT = 'mkdir -p "$RUN/checkpoints" && echo step-{step} > "$RUN/checkpoints/latest"'


def run_job(tmp_path: Path, scenario: dict[tuple[int, int], str], *, nodes: int = 2,
            spare: int = 0, allocation: str = "n[1-3]", state: str = "RUNNING",
            env: dict[str, str] | None = None,
            slurm: dict[str, str] | None = None,
            extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], Path]:  # fmt: skip
    """`slurm`: what SLURM says after an attempt's step, by file: `down-A` (sinfo's down
    nodes), `srun-lines-A` (srun's own lines). `extra`: overrides of the job's config."""
    run_dir, folder = tmp_path / "run", tmp_path / "scenario"
    folder.mkdir(parents=True)
    for (attempt, rank), line in scenario.items():
        (folder / f"attempt-{attempt}-rank-{rank}").write_text(line.replace("$RUN", str(run_dir)))
    for name, text in (slurm or {}).items():
        (folder / name).write_text(text)
    data = tmp_path / "index.json"
    data.write_text("{}")
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  train: {data}\n")
    cfg = with_overrides(Config(), ["slurm.profile=local-dev", f"slurm.nodes={nodes}",
                                    f"slurm.spare_nodes={spare}", "slurm.gpus_per_node=2"])  # fmt: skip
    job = dataclasses.replace(resolve_job(cfg, load_profile("local-dev")), job_name="loop")
    script = render_sbatch(
        job,
        config_path=str(config),
        overrides=[f"slurm.nodes={nodes}", f"slurm.spare_nodes={spare}", *extra],
        run_dir=str(run_dir),
        python=str(FAKE / "python"),
    )
    environ = {
        **os.environ, "PATH": f"{FAKE}:{os.environ['PATH']}", "SCENARIO": str(folder),
        "REAL_PYTHON": sys.executable, "FAKE_STATE": state, "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": allocation, "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_CPUS_PER_TASK": "1", "SLURM_RESTART_COUNT": "0",
        "HPCTRAIN_WATCH_DIR": str(tmp_path / "shm"), **(env or {}),
    }  # fmt: skip
    environ.pop("SLURM_JOB_END_TIME", None)
    done = subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    return done, run_dir


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "scenario" / "calls").read_text().splitlines()


def records(run_dir: Path) -> list[dict]:
    text = (run_dir / "slurm" / "attempts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("probe_after_kill", [False, True])
def test_a_killed_rank_restarts_on_the_spare_and_the_job_completes(
    tmp_path: Path, probe_after_kill: bool
) -> None:
    """The restart after a SIGKILL skips the probe (none of its checks explains one), unless
    slurm.probe_after_kill asks for it."""
    done, run_dir = run_job(
        tmp_path,
        {(1, 2): f"{COMMIT.format(step=4)}; sleep 0.2; kill -9 $$",
         (1, 0): "sleep 1; exit 7", (1, 1): "sleep 1; exit 7", (1, 3): "sleep 1; exit 7"},
        spare=1, extra=(f"slurm.probe_after_kill={str(probe_after_kill).lower()}",),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    probe = ["srun probe n1,n3 2"] if probe_after_kill else []
    assert calls(tmp_path) == ["srun probe n1,n2,n3 3", "srun train n1,n2 4", *probe,
                               "srun train n1,n3 4"]  # fmt: skip
    skipped = "attempt 2 (job 42, restart 0) skips the probe (a rank killed by SIGKILL"
    assert (skipped in done.stderr) != probe_after_kill, done.stderr
    first, second = records(run_dir)
    assert (first["kind"], first["decision"], first["set_aside"]) == (
        "signal", "restart", {"n2": "signal: rank 2 on n2 killed by SIGKILL"},
    )  # fmt: skip
    assert first["first_failure"]["signal"] == "SIGKILL" and first["committed"] == 4
    assert (second["kind"], second["decision"], second["nodes"]) == (
        "completed",
        "done",
        ["n1", "n3"],
    )
    assert second["resumed_from"] == 4
    assert (
        "hpctrain: attempt 1: rank 2 on n2 killed by SIGKILL; restarting in this allocation"
        in done.stderr
    )


def test_a_node_that_fails_the_probe_without_a_spare_is_excluded_by_a_requeue(
    tmp_path: Path,
) -> None:
    temp = tmp_path / "tmp"
    (temp / "hpctrain-probe-n1").mkdir(parents=True)  # n1's temp folder is unusable
    done, run_dir = run_job(tmp_path, {}, nodes=1, allocation="n1", env={"TMPDIR": str(temp)})
    assert done.returncode == 0, done.stderr
    assert "hpctrain probe: n1 failed local temp:" in done.stdout
    assert calls(tmp_path) == [
        "srun probe n1 1",
        "scontrol show job -o 42",
        "scontrol requeuehold 42",
        "scontrol update JobId=42 ExcNodeList=n9,n1",  # the user's own n9 kept
        "scontrol release 42",
    ]
    (only,) = records(run_dir)
    assert (only["kind"], only["decision"], only["num_tasks"]) == ("probe", "requeue", 0)


def test_a_crash_loop_stops_after_max_no_progress_attempts(tmp_path: Path) -> None:
    done, run_dir = run_job(
        tmp_path, {(1, 0): "kill -9 $$", (2, 0): "kill -9 $$"}, allocation="n[1-2]"
    )
    assert done.returncode == 128 + 9, done.stderr
    assert [r["decision"] for r in records(run_dir)] == ["restart", "stop"]
    assert (
        "hpctrain: attempt 2: stopped: no progress (2 attempts in a row committed no checkpoint"
        in done.stderr
    )
    assert [c for c in calls(tmp_path) if c.startswith("srun train")] == ["srun train n1,n2 4"] * 2


def test_the_trainers_requeue_code_requeues_the_job_and_a_cancelled_one_stays(
    tmp_path: Path,
) -> None:
    saved = {(1, r): "exit 75" for r in range(4)}
    done, run_dir = run_job(tmp_path, saved)
    assert done.returncode == 0, done.stderr
    assert calls(tmp_path)[-1] == "scontrol requeue 42"
    assert records(run_dir)[0]["kind"] == "preempted"
    cancelled, run_dir = run_job(tmp_path / "c", saved, state="CANCELLED")
    assert cancelled.returncode == 75, cancelled.stderr
    assert not any(c.startswith("scontrol") for c in calls(tmp_path / "c"))
    assert records(run_dir)[0]["kind"] == "cancelled"


# A rank's training as a Python line under the real watcher (exec: the watcher's child is
# the rank itself): steps with a heartbeat (1 s allowance), then `then` (the rank stops
# itself, or waits in "a collective" for ever).
BEATING = (
    'exec "$REAL_PYTHON" -c "import os, signal, time\n'
    "from hpctrain.observe.heartbeat import Progress\n"
    "p = Progress.from_environ(floor_s=1, factor=5, first_s=2)\n"
    "for step in range(1, 4):\n"
    "    with p.step(step): time.sleep(0.05)\n"
    '{then}"'
)
STOPS = BEATING.format(then="os.kill(os.getpid(), signal.SIGSTOP)")
WAITS = BEATING.format(then="time.sleep(600)")


def test_a_stopped_rank_is_found_by_its_watcher_and_a_spare_takes_its_node(
    tmp_path: Path,
) -> None:
    """Rank 2 stops (kill -STOP); its peers wait for it in a collective and stop beating too.
    Every watcher ends its rank after the allowance; the stopped one is blamed, not the
    peers whose watchers may have ended them first (#47: 610 s of collective timeout)."""
    done, run_dir = run_job(
        tmp_path, {(1, 0): WAITS, (1, 1): WAITS, (1, 2): STOPS, (1, 3): WAITS}, spare=1
    )
    assert done.returncode == 0, done.stderr
    first, second = records(run_dir)
    assert (first["kind"], first["decision"]) == ("hang", "restart"), first
    failure = first["first_failure"]
    assert (failure["rank"], failure["node"], failure["stopped"]) == (2, "n2", True)
    assert failure["time"] < failure["detected"]  # its last progress, then its watcher
    assert first["set_aside"] == {
        "n2": "hang: rank 2 on n2 hung (no progress, ended by its watcher, the process was stopped)"
    }
    assert (second["kind"], second["nodes"]) == ("completed", ["n1", "n3"])
    assert "hpctrain watch: rank 2 on n2 made no progress for" in done.stderr


@pytest.mark.parametrize("survivors", ["sleep 1.5; exit 7", "sleep 1.5; kill -TERM $$"])
def test_a_node_that_went_away_is_lost_whether_its_peers_exit_7_or_die_of_term(
    tmp_path: Path, survivors: str
) -> None:
    """n2's watchers and ranks killed (a lost node): the survivors see gloo's "connection
    closed" and exit 7, or srun's TERM kills them; the kind was `hang` one way and `lost`
    the other (#47). Lost both ways: n2 set aside, the spare trains."""
    gone = "sleep 0.5; kill -9 $PPID $$"  # once started: the watcher, then the rank
    done, run_dir = run_job(
        tmp_path, {(1, 0): survivors, (1, 1): survivors, (1, 2): gone, (1, 3): gone}, spare=1
    )
    assert done.returncode == 0, done.stderr
    first, second = records(run_dir)
    assert (first["kind"], first["first_failure"]["node"]) == ("lost", "n2"), first
    assert list(first["set_aside"]) == ["n2"] and second["nodes"] == ["n1", "n3"]
    assert isinstance(first["first_failure"]["time"], float)


def test_every_rank_started_and_none_ended_blames_the_node_slurm_says_failed(
    tmp_path: Path,
) -> None:
    """A node frozen for good (#47): SLURM marks it down after minutes, srun kills the
    healthy node's ranks with their watchers; no rank has an end record. The lowest rank's
    node, the healthy one, was blamed and set aside. SLURM's word names the other."""
    gone = "sleep 0.5; kill -9 $PPID $$"  # once started: the watcher, then the rank
    lines = "srun: error: Node failure on n2\nsrun: error: n1: tasks 0-1: Killed\n"
    done, run_dir = run_job(
        tmp_path, {(1, r): gone for r in range(4)}, spare=1,
        slurm={"down-1": "n2\n", "srun-lines-1": lines},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = records(run_dir)
    assert (first["kind"], first["first_failure"]["rank"], list(first["set_aside"])) == (
        "lost", 2, ["n2"],
    ), first  # fmt: skip
    assert second["nodes"] == ["n1", "n3"]
    kept = (run_dir / "slurm" / "attempts" / "1" / "srun.log").read_text()
    assert kept == lines  # srun's own lines, kept aside by the job script
    assert lines.splitlines()[0] in done.stderr  # and still in the job's log
