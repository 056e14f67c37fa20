"""submitit submission without a cluster: parameters, sweeps, requeue decision, refusals."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.launch import submit as submit_mod
from hpctrain.launch.profiles import LaunchError, load_profile, resolve_job
from hpctrain.launch.submit import (
    executor_parameters,
    parse_sweep,
    requeue_this_job,
    submission_script,
    sweep_run_dir,
)
from hpctrain.train.preemption import REQUEUE_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")


def v100_job():  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), ["slurm.profile=jean-zay-v100", "slurm.account=abc@v100"])
    return resolve_job(cfg, load_profile("jean-zay-v100"))


def test_executor_parameters_follow_the_profile() -> None:
    params = executor_parameters(v100_job())
    assert params["tasks_per_node"] == 4 and params["cpus_per_task"] == 10
    assert params["slurm_gres"] == "gpu:4" and params["slurm_constraint"] == "v100-32g"
    assert params["slurm_account"] == "abc@v100" and params["slurm_qos"] == "qos_gpu-t3"
    assert params["slurm_additional_parameters"] == {"requeue": True, "hint": "nomultithread"}
    assert params["slurm_signal_delay_s"] == 120 and params["timeout_min"] == 120
    assert "slurm_partition" not in params  # gpu_p13 is picked by the constraint
    assert params["slurm_srun_args"] == ["--kill-on-bad-exit=1"]


def test_dry_run_script_is_submitits(tmp_path: Path) -> None:
    script = submission_script(v100_job(), tmp_path / "submitit", python="/venv/bin/python")
    for line in (
        "#SBATCH --signal=USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gres=gpu:4",
        "module load python/3.11.5",
        "/venv/bin/python -u -m submitit.core._submit",
    ):
        assert line in script, line
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun.split(), srun  # a failed or hung task ends them all


def test_sweep_is_a_cartesian_product_with_one_folder_each() -> None:
    combos = parse_sweep(["train.lr=0.1,0.2", "seed=1,2"])
    assert combos == [
        ["train.lr=0.1", "seed=1"],
        ["train.lr=0.1", "seed=2"],
        ["train.lr=0.2", "seed=1"],
        ["train.lr=0.2", "seed=2"],
    ]
    assert parse_sweep([]) == [[]]
    assert sweep_run_dir("runs/x/", ["train.lr=0.1", "seed=1"]) == "runs/x/lr-0.1_seed-1"
    for bad in ("train.lr", "=1,2", "a b=1", "x;id=1"):
        with pytest.raises(LaunchError, match="--sweep"):
            parse_sweep([bad])


def test_requeue_from_rank_zero_only_and_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(submit_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(submit_mod, "job_state", lambda job_id: "RUNNING")
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "1"}
    with pytest.raises(SystemExit) as info:
        requeue_this_job(3, env)
    assert info.value.code == REQUEUE_EXIT_CODE and calls == [["scontrol", "requeue", "42"]]

    calls.clear()
    with pytest.raises(SystemExit):
        requeue_this_job(3, {**env, "SLURM_PROCID": "1"}, wait_s=0)
    assert calls == []  # other ranks only exit (after rank 0 requeued: --kill-on-bad-exit)

    with pytest.raises(RuntimeError, match="max_requeues=1"):
        requeue_this_job(1, env)
    assert calls == []


def _no_submission(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    submitted: list[str] = []

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        submitted.append("submitted")
        raise AssertionError("nothing may be submitted")

    monkeypatch.setattr(submit_mod, "submit", refuse)  # hpctrain submit imports it when run
    monkeypatch.setattr(submit_mod, "make_executor", refuse)
    return submitted


@pytest.mark.parametrize(
    "override",
    [
        "slurm.account=x; rm -rf ~",
        "slurm.account=x\nrm -rf ~",
        "slurm.partition=debug\n#SBATCH --uid=0",
        "slurm.qos=$(id)",
        "data.train=https://user:s3cret@example.org/index.json",
        "slurm.time='30:00:00'",
        "slurm.gpus_per_node=9",
    ],
)
def test_submit_refuses_before_anything_is_submitted(
    override: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    submitted = _no_submission(monkeypatch)
    code = main(
        [
            "submit",
            DEMO,
            f"run_dir={tmp_path / 'run'}",
            override,
            "--profile",
            "jean-zay-h100",
            "--no-preflight",
        ]
    )
    err = capsys.readouterr().err
    assert code == 6 and submitted == []
    assert err.startswith("hpctrain submit: ") and err.count("\n") == 1
    assert "s3cret" not in err
    assert not (tmp_path / "run" / "slurm").exists()


def test_sbatch_verb_refuses_injection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "sbatch",
            DEMO,
            f"run_dir={tmp_path}",
            "slurm.account=x; rm -rf ~",
            "--profile",
            "generic",
            "--no-preflight",
        ]
    )
    assert code == 6
    assert "slurm.account='x; rm -rf ~': only letters" in capsys.readouterr().err


def test_dry_run_prints_the_script_and_submits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    submitted = _no_submission(monkeypatch)
    code = main(
        [
            "submit",
            DEMO,
            f"run_dir={tmp_path / 'run'}",
            "--profile",
            "local-dev",
            "--dry-run",
            "--no-preflight",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and submitted == []
    assert "#SBATCH --partition=debug" in out and "#SBATCH --ntasks-per-node=2" in out
    assert "--gres" not in out  # local-dev: tasks stand in for GPUs


def test_no_requeue_of_a_job_cancelled_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """scancel sends TERM too; the trainers save and exit 75, but the job must stay cancelled."""
    calls: list[list[str]] = []
    monkeypatch.setattr(submit_mod.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(submit_mod, "job_state", lambda job_id: "CANCELLED")
    with pytest.raises(SystemExit):
        requeue_this_job(3, {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"})
    assert calls == []


def test_sweep_dry_run_is_a_throttled_array(tmp_path: Path) -> None:
    script = submission_script(v100_job(), tmp_path / "s", num_tasks=3, max_parallel=1)
    assert "#SBATCH --array=0-2%1" in script
    params = executor_parameters(dataclasses.replace(v100_job(), max_parallel=2))
    assert params["slurm_array_parallelism"] == 2


@pytest.mark.parametrize("verb", ["submit", "sbatch"])
def test_max_parallel_needs_a_sweep(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([verb, DEMO, f"run_dir={tmp_path}", "--max-parallel", "1", "--profile",
                 "local-dev", "--no-preflight"])  # fmt: skip
    assert code == 2 and "add --sweep" in capsys.readouterr().err


def test_sbatch_verb_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sbatch", DEMO, "--sweep", "train.lr=0.1,0.2", f"run_dir={tmp_path / 'r'}",
                 "--max-parallel", "1", "--profile", "local-dev", "--no-preflight"])  # fmt: skip
    script = capsys.readouterr().out
    assert code == 0 and "#SBATCH --array=0-1%1" in script
    assert f'RUN_DIR="{tmp_path / "r" / "lr-0.1"}"' in script
    assert f"slurm.folder={tmp_path / 'r' / 'slurm'}" in script  # where status finds the log


def test_a_user_error_in_a_task_is_one_line_and_its_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hpctrain.errors import DataError
    from hpctrain.launch.submit import exit_with_one_line

    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    with pytest.raises(SystemExit) as info:
        try:
            raise DataError("/d/index.json: index not found")
        except DataError as exc:
            exit_with_one_line(exc, env, now=False)
    assert info.value.code == 3
    assert capsys.readouterr().err == (
        "hpctrain train [rank 1]: data error: /d/index.json: index not found\n"
    )
