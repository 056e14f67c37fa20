"""The requeue policy exists twice: bash in the rendered sbatch script, Python in submit.py.

Both requeue a RUNNING job after the trainer exits `REQUEUE_EXIT_CODE`, while
SLURM_RESTART_COUNT < slurm.max_requeues; this runs the script's block under stubbed
`squeue`/`scontrol` and compares it with `requeue_this_job`, case by case.
"""

from __future__ import annotations

import contextlib
import subprocess

import pytest

import hpctrain.launch.submit as submit_mod
from hpctrain.config import Config, with_overrides
from hpctrain.launch.profiles import load_profile, resolve_job
from hpctrain.launch.sbatch import render_sbatch
from hpctrain.train.preemption import REQUEUE_EXIT_CODE

MAX_REQUEUES = 2


def bash_requeues(restarts: int, state: str) -> bool:
    cfg = with_overrides(
        Config(),
        ["run_dir=/scratch/runs/x", "slurm.profile=jean-zay-a100", "slurm.account=abc@a100",
         f"slurm.max_requeues={MAX_REQUEUES}"],
    )  # fmt: skip
    script = render_sbatch(
        resolve_job(cfg, load_profile("jean-zay-a100")),
        config_path="/c.yaml",
        overrides=(),
        run_dir="/r",
        python="/p",
    )
    assert f"REQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE} " in script
    assert f"MAX_REQUEUES={MAX_REQUEUES}\n" in script
    policy = script[script.index('if [ "$status" -eq "$REQUEUE_EXIT_CODE" ]') :]
    stubs = (
        f"squeue() {{ echo {state}; }}\n"
        'scontrol() { echo CALLED scontrol "$@"; }\n'
        f"MAX_REQUEUES={MAX_REQUEUES}\nREQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE}\n"
        f"SLURM_JOB_ID=42\nSLURM_RESTART_COUNT={restarts}\nstatus={REQUEUE_EXIT_CODE}\n"
    )
    done = subprocess.run(
        ["bash", "-c", stubs + policy], capture_output=True, text=True, timeout=30
    )
    return "CALLED scontrol requeue 42" in done.stdout


def python_requeues(restarts: int, state: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(submit_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(submit_mod, "job_state", lambda job_id: state)
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": str(restarts)}
    with contextlib.suppress(SystemExit, RuntimeError):  # its exit, or "requeues are done"
        submit_mod.requeue_this_job(MAX_REQUEUES, env)
    return calls == [["scontrol", "requeue", "42"]]


@pytest.mark.parametrize(
    ("restarts", "state"),
    [(0, "RUNNING"), (1, "RUNNING"), (2, "RUNNING"), (3, "RUNNING"), (0, "CANCELLED")],
)
def test_bash_and_python_requeue_policies_agree(
    restarts: int, state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = state == "RUNNING" and restarts < MAX_REQUEUES
    assert bash_requeues(restarts, state) == expected
    assert python_requeues(restarts, state, monkeypatch) == expected
