"""submitit submission without a cluster: parameters, sweeps, the training job's script, refusals."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.launch import submit as submit_mod
from hpctrain.launch.profiles import LaunchError, load_profile, resolve_job
from hpctrain.launch.sbatch import environment_lines, render_sbatch
from hpctrain.launch.submit import (
    executor_parameters,
    job_script,
    parse_sweep,
    submission_script,
    sweep_run_dir,
    training_parameters,
)

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
    # every task's srun gets its CPUs: srun from SLURM 22.05 to 23.11 ignores the job's
    assert params["slurm_srun_args"] == ["--kill-on-bad-exit=1", "--cpus-per-task=10"]


def test_a_training_job_is_one_process_that_runs_the_job_scripts_loop() -> None:
    params = training_parameters(dataclasses.replace(v100_job(), spare_nodes=1))
    # submitit counts one task (one result); the allocation is 2 nodes x 4 tasks
    assert (params["nodes"], params["tasks_per_node"], params["slurm_use_srun"]) == (1, 1, False)
    extra = params["slurm_additional_parameters"]
    assert (extra["nodes"], extra["ntasks_per_node"], extra["no_kill"]) == (2, 4, True)
    assert "slurm_srun_args" not in params
    assert params["slurm_setup"] == [*environment_lines(v100_job()), *v100_job().setup]


def _exports(script: str) -> set[str]:
    return {line for line in script.splitlines() if line.startswith("export ")}


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval-predict"])
def test_submitit_scripts_export_the_environment_of_the_sbatch_script(
    training: bool, tmp_path: Path
) -> None:
    """One environment both ways (#43): every variable the `hpctrain sbatch` script exports
    (offline switches, TORCH_HOME and HF_HOME under the profile's cache_root, srun's CPUs,
    the allocator, the fabric) is exported by submitit's script too, before the site's setup."""
    job = v100_job()
    sbatch_script = render_sbatch(
        job, config_path="/w/c.yaml", overrides=[], run_dir="/s/r", python="/venv/bin/python"
    )
    wanted = _exports(sbatch_script) - _exports("\n".join(job.setup))
    assert any("TORCH_HOME=" in line and "HF_HOME=" in line for line in wanted)
    assert 'HF_HOME="${HF_HOME:-$SCRATCH/hpctrain/cache/huggingface}"' in sbatch_script
    submitit_script = submission_script(
        job, tmp_path / "s", python="/v/bin/python", training=training
    )
    assert wanted <= _exports(submitit_script), sorted(wanted - _exports(submitit_script))
    lines = submitit_script.splitlines()
    assert lines.index(next(x for x in wanted if "TORCH_HOME" in x)) < lines.index(
        "module load python/3.11.5"
    )


def test_the_submitit_jobs_environment_gives_the_caches_to_the_tasks(tmp_path: Path) -> None:
    """The exports run in bash as submitit's setup would: a task sees TORCH_HOME and HF_HOME
    under the cache root, and a value set where the user submits wins."""
    job = dataclasses.replace(v100_job(), cache_root=str(tmp_path / "cache"), setup=())
    setup = "\n".join(training_parameters(job)["slurm_setup"])
    show = 'echo "$TORCH_HOME|$HF_HOME|$HF_HUB_OFFLINE"'
    env = {"PATH": "/usr/bin:/bin", "SLURM_CPUS_PER_TASK": "4"}
    out = subprocess.run(
        ["bash", "-c", f"{setup}\n{show}"], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == f"{tmp_path}/cache/torch|{tmp_path}/cache/huggingface|1"
    mine = {**env, "HF_HOME": "/mine/hf"}
    out = subprocess.run(
        ["bash", "-c", f"{setup}\n{show}"], env=mine, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == f"{tmp_path}/cache/torch|/mine/hf|1"


def test_the_submitit_job_runs_the_sbatch_script_without_its_setup() -> None:
    script = job_script(
        with_overrides(Config(), ["run_dir=/scratch/r"]), v100_job(), "/scratch/r/slurm/c.yaml",
        python="/venv/bin/python",
    )  # fmt: skip
    assert "module load" not in script  # submitit ran the site's setup before the process
    assert 'CONFIG="/scratch/r/slurm/c.yaml"' in script and 'RUN_DIR="/scratch/r"' in script
    assert (
        "-m hpctrain.resilience.attempts" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    )


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
    assert "#SBATCH --no-kill" in out and "\nsrun " not in out  # one process runs the loop


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


# -- where a submitted run lives, and submitting from the wrong machine (#43) -------------


class _FakeExecutor:
    """submitit's executor without a cluster: records the folder, returns job 42."""

    folders: list[Path] = []

    def __init__(self, job: object, folder: Path, **options: object) -> None:
        self.folders.append(folder)

    def submit(self, fn: object) -> object:
        folder = self.folders[-1]
        paths = type(
            "Paths", (), {"stdout": folder / "42_0_log.out", "stderr": folder / "42_0_log.err"}
        )
        return type("Job", (), {"job_id": "42", "paths": paths})()


def test_a_submitted_relative_run_dir_lives_under_run_root_and_status_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scratch, clone = tmp_path / "scratch", tmp_path / "clone"
    clone.mkdir()
    monkeypatch.chdir(clone)
    monkeypatch.setenv("SCRATCH", str(scratch))
    monkeypatch.setattr(submit_mod, "make_executor", _FakeExecutor)
    monkeypatch.setattr("hpctrain.launch.status.query_state", lambda job_id: ("RUNNING", "", 0))
    args = ["submit", DEMO, "slurm.account=abc@h100", "--profile", "jean-zay-h100"]
    assert main([*args, "--no-preflight"]) == 0
    run = scratch / "hpctrain" / "runs" / "demo"
    captured = capsys.readouterr()
    assert f"  run folder: {run}\n" in captured.out
    assert f"  status:     hpctrain status {run}\n" in captured.out
    assert f"hpctrain submit: run folder {run} (run_dir=runs/demo under" in captured.err
    assert _FakeExecutor.folders[-1] == run / "slurm" / "submitit"
    assert (run / "slurm" / "job.json").is_file() and list(clone.iterdir()) == []
    assert main(["status", str(run)]) == 0 and "42" in capsys.readouterr().out
    # an evaluation of the same config finds the same run folder
    assert main([*args, "--eval", "--dry-run", "--no-preflight"]) == 0
    assert f"hpctrain submit: run folder {run} (" in capsys.readouterr().err


def test_submit_refuses_a_run_root_whose_variable_is_unset_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """submitit writes the run's files from this machine: `$SCRATCH` must be known here (the
    dry run keeps it, to read the script off the cluster)."""
    submitted = _no_submission(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRATCH", raising=False)
    args = [
        "submit",
        DEMO,
        "slurm.account=abc@h100",
        "--profile",
        "jean-zay-h100",
        "--no-preflight",
    ]
    assert main(args) == 6 and submitted == []
    err = capsys.readouterr().err
    assert err == (
        "hpctrain submit: launch error: run_dir=$SCRATCH/hpctrain/runs/demo: $SCRATCH is not "
        "set here, and submitit writes the run's files from this machine; submit from the "
        "cluster's login node, or give an absolute path\n"
    )
    assert main([*args, "--dry-run"]) == 0 and list(tmp_path.iterdir()) == []


def test_submit_without_sbatch_says_where_to_submit_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    submitted: list[str] = []
    monkeypatch.setattr(submit_mod, "make_executor", lambda *a, **k: submitted.append("x"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM commands
    code = main(["submit", DEMO, f"run_dir={tmp_path / 'run'}", "--profile", "local-dev",
                 "--no-preflight"])  # fmt: skip
    assert code == 6 and submitted == []
    assert capsys.readouterr().err == (
        "hpctrain submit: launch error: sbatch: not found here: submit from a login node of "
        "local-dev (off the cluster, --dry-run --no-preflight prints the script)\n"
    )


def test_submit_eval_of_a_run_name_finds_the_run_under_run_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`submit runs/demo --eval` from the clone: the training's folder is under the profile's
    run_root, not here; what is here wins; neither: the name is refused as before."""
    scratch, clone = tmp_path / "scratch", tmp_path / "clone"
    run = scratch / "hpctrain" / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(Path(DEMO).read_text())
    clone.mkdir()
    monkeypatch.chdir(clone)
    monkeypatch.setenv("SCRATCH", str(scratch))
    args = ["submit", "runs/demo", "--eval", "--dry-run", "--no-preflight"]
    args += ["--profile", "jean-zay-h100", "slurm.account=abc@h100"]
    assert main(args) == 0
    assert f"hpctrain submit: run folder {run} (run_dir=runs/demo under" in capsys.readouterr().err
    here = clone / "runs" / "demo"
    here.mkdir(parents=True)
    (here / "config.yaml").write_text(Path(DEMO).read_text())
    assert main(args) == 0
    assert f"hpctrain submit: run folder {here}\n" in capsys.readouterr().err
    assert main([*args[:1], "runs/other", *args[2:]]) == 2
    assert "runs/other: no such file or folder" in capsys.readouterr().err


def test_a_dry_run_off_the_cluster_names_the_log_folder_as_the_cluster_will(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`$SCRATCH/...` unset here was shown as `<here>/$SCRATCH/...` (#49)."""
    monkeypatch.chdir(tmp_path)
    folder = Path("$SCRATCH/hpctrain/runs/demo/slurm/submitit")
    script = submission_script(v100_job(), folder, training=True)
    assert f"--output='{folder}/%j_0_log.out'" in script
    assert str(tmp_path) not in script
