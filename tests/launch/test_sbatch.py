"""sbatch rendering: golden scripts, the requeue logic, and refusal of unsafe values."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.launch.profiles import LaunchError, load_profile, resolve_job
from hpctrain.launch.sbatch import render_profile_template, render_sbatch

HERE = Path(__file__).parent
REPO = HERE.parents[1]
UPDATE = os.environ.get("HPCTRAIN_UPDATE_GOLDEN") == "1"


def golden(path: Path, text: str) -> None:
    """Compare with a golden file; HPCTRAIN_UPDATE_GOLDEN=1 rewrites it."""
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with HPCTRAIN_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"{path} differs; rerun with HPCTRAIN_UPDATE_GOLDEN=1 if intended"
    )


def a100_job(*overrides: str):  # type: ignore[no-untyped-def]
    cfg = with_overrides(
        Config(),
        ["run_dir=/scratch/u/runs/demo", "slurm.profile=jean-zay-a100", "slurm.account=abc@a100",
         "slurm.nodes=2", *overrides],
    )  # fmt: skip
    return resolve_job(cfg, load_profile("jean-zay-a100"))


def render(job, overrides=("train.max_steps=100",), **kwargs):  # type: ignore[no-untyped-def]
    args = {
        "config_path": "/work/u/hpctrain/configs/demo.yaml",
        "overrides": list(overrides),
        "run_dir": "/scratch/u/runs/demo",
        "python": "/work/u/venv/bin/python",
        "log_dir": "/scratch/u/runs/demo/slurm",
        "description": "rendered by `hpctrain sbatch` from demo.yaml",
    }
    args.update(kwargs)
    return render_sbatch(job, **args)


def test_rendered_script_matches_golden() -> None:
    golden(HERE / "golden" / "jean-zay-a100-2nodes.sbatch", render(a100_job()))


@pytest.mark.parametrize("name", ["generic", "jean-zay-a100", "jean-zay-h100", "jean-zay-v100"])
def test_slurm_templates_are_current(name: str) -> None:
    """slurm/*.sbatch are what the renderer gives for each profile (never stale)."""
    golden(REPO / "slurm" / f"{name}.sbatch", render_profile_template(load_profile(name)))


def test_script_is_valid_bash_with_the_key_lines() -> None:
    script = render(a100_job())
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    for line in (
        "#SBATCH --signal=USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --hint=nomultithread",
        "#SBATCH --constraint=a100",
        "#SBATCH --no-kill",
        'scontrol requeue "$SLURM_JOB_ID"',
        'TRAIN_ARGS=("$CONFIG" "run_dir=$RUN_DIR" train.max_steps=100)',
        "module load arch/a100",
        "HF_HUB_OFFLINE=1",
        'export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"',
        "export HPCTRAIN_FABRIC=infiniband",
    ):
        assert line in script, line


def test_every_srun_gets_the_cpus_of_its_tasks() -> None:
    """srun from SLURM 22.05 to 23.11 ignores the job's --cpus-per-task (issue #38)."""
    script = render(a100_job())
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in script
    sruns = [line.strip().partition("&& ")[2] or line.strip() for line in script.splitlines()
             if "srun " in line and not line.lstrip().startswith("#")]  # fmt: skip
    assert len(sruns) == 3  # the fork server, the health probe, the training
    assert all("--cpus-per-task=" in line for line in sruns), sruns
    train = sruns[2].removeprefix("{ ").partition(" 2>&1 1>&3 ")[0]  # srun's lines kept aside
    assert (
        train.startswith("srun --kill-on-bad-exit=1 ")
        and '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in train
    )
    assert train.endswith(
        '"$PYTHON" -m hpctrain.resilience.watch "$ATTEMPT_DIR" -- train "${TRAIN_ARGS[@]}" "${RESUME[@]}"'
    )


def test_spare_nodes_are_asked_for_and_the_probe_can_be_switched_off() -> None:
    script = render(a100_job("slurm.spare_nodes=1"))
    assert "#SBATCH --nodes=3  " in script and "# 2 to train on + 1 spare" in script
    assert "hpctrain.resilience.probe" in script
    assert "hpctrain.resilience.probe" not in render(a100_job("slurm.probe=false"))
    assert "HPCTRAIN_FABRIC" not in render(
        resolve_job(with_overrides(Config(), ["slurm.profile=generic"]), load_profile("generic"))
    )


def test_the_fork_server_runs_beside_the_attempts_unless_switched_off() -> None:
    """One per node for the allocation, in the background, sharing the job's resources
    (--overlap), never ending the job (--no-kill, no kill-on-bad-exit), stopped on exit."""
    script = render(a100_job("slurm.spare_nodes=1"))
    (line,) = [x for x in script.splitlines() if "hpctrain.resilience.forkserver" in x]
    assert line.startswith("srun --overlap ") and line.endswith(" </dev/null &"), line
    for option in ("--no-kill", "--kill-on-bad-exit=0", '--nodes="$SLURM_JOB_NUM_NODES"',
                   "--ntasks-per-node=1", '--cpus-per-task="$SLURM_CPUS_ON_NODE"'):  # fmt: skip
        assert option in line, option
    assert script.index(line) < script.index("while [ ")  # before the first attempt
    assert "trap 'kill \"$FORKSERVER\" 2>/dev/null' EXIT" in script
    off = render(a100_job("slurm.forkserver=false"))
    assert "forkserver" not in off.lower() and "FORKSERVER" not in off


def test_free_arguments_are_shell_quoted() -> None:
    script = render(a100_job(), overrides=["data.train=/data/my shards/index.json", "seed=$(id)"])
    assert "'data.train=/data/my shards/index.json' 'seed=$(id)'" in script


@pytest.mark.parametrize(
    "override",
    [
        "slurm.account=x; rm -rf ~",
        "slurm.account=x\nrm -rf ~",
        "slurm.account=`id`@a100",
        "slurm.qos=qos_gpu-t3 --wrap=id",
        "slurm.constraint=a100$(id)",
    ],
)
def test_injection_in_sbatch_fields_is_refused(override: str) -> None:
    job = a100_job()
    key, _, value = override.partition("=")
    job = dataclasses.replace(job, **{key.split(".")[1]: value})
    with pytest.raises(LaunchError) as info:
        render(job)
    assert key in str(info.value) and "\n" not in str(info.value).replace("\\n", "")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("run_dir", "/scratch/$(rm -rf ~)", "only letters"),
        ("run_dir", "/scratch/`id`", "only letters"),
        ("run_dir", '/scratch/a"b', "only letters"),
        ("run_dir", "$AWS_SECRET_ACCESS_KEY/x", "is not allowed in a path"),
        ("config_path", "/a\n/b", "newlines"),
        ("python", "python; id", "only letters"),
    ],
)
def test_unsafe_paths_are_refused(field: str, value: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        render(a100_job(), **{field: value})


def test_scratch_variables_in_paths_are_kept_for_the_node() -> None:
    script = render(a100_job(), run_dir="$SCRATCH/runs/${SLURM_JOB_NAME}", log_dir="$SCRATCH/x")
    assert 'RUN_DIR="$SCRATCH/runs/${SLURM_JOB_NAME}"' in script
    assert "#SBATCH --output=%x-%j.out" in script  # #SBATCH cannot expand variables


@pytest.mark.parametrize(
    "override",
    [
        "data.train=https://user:s3cret@example.org/shards/index.json",
        "data.train=https://example.org/index.json?X-Amz-Signature=s3cret",
        "data.train=https://example.org/index.json?token=s3cret",
    ],
)
def test_credentials_never_reach_the_script(override: str) -> None:
    with pytest.raises(LaunchError) as info:
        render(a100_job(), overrides=[override])
    assert "s3cret" not in str(info.value)


def test_setup_lines_with_newlines_or_secrets_are_refused() -> None:
    with pytest.raises(LaunchError, match="newlines"):
        render(dataclasses.replace(a100_job(), setup=("module load a\nid",)))
    with pytest.raises(LaunchError, match="secret environment variable") as info:
        render(a100_job("slurm.setup=['export HF_TOKEN=s3cret']"))
    assert "s3cret" not in str(info.value)


def test_sweep_renders_a_throttled_array_with_a_folder_per_point() -> None:
    from hpctrain.launch.sbatch import SweepPoint

    sweep = [
        SweepPoint(("train.lr=0.1",), "/scratch/u/runs/demo/lr-0.1"),
        SweepPoint(("train.lr=0.2", "data.train=/d/my shards"), "/scratch/u/runs/demo/lr-0.2"),
    ]
    script = render(a100_job(), sweep=sweep, max_parallel=1)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "#SBATCH --array=0-1%1" in script
    assert """    0) POINT=(train.lr=0.1); RUN_DIR="/scratch/u/runs/demo/lr-0.1" ;;""" in script
    assert """    1) POINT=(train.lr=0.2 'data.train=/d/my shards'); RUN_DIR=""" in script
    assert script.index('case "$SLURM_ARRAY_TASK_ID"') < script.index('mkdir -p "$RUN_DIR/slurm"')
    assert '"run_dir=$RUN_DIR" train.max_steps=100 "${POINT[@]}")' in script
    unthrottled = render(a100_job(), sweep=sweep)
    assert "#SBATCH --array=0-1 " in unthrottled or "#SBATCH --array=0-1\n" in unthrottled


def test_sweep_case_selects_the_point_in_bash() -> None:
    """The rendered `case` run by bash gives each array task its own overrides and folder."""
    from hpctrain.launch.sbatch import SweepPoint, _sweep_lines

    lines = _sweep_lines(
        [SweepPoint(("seed=1",), "/r/seed-1"), SweepPoint(("seed=2", "x=a b"), "/r/seed-2")]
    )
    body = "\n".join(lines) + '\nprintf "%s|" "$RUN_DIR" "${POINT[@]}"'
    for task, expected in (("0", "/r/seed-1|seed=1|"), ("1", "/r/seed-2|seed=2|x=a b|")):
        out = subprocess.run(
            ["bash", "-c", body],
            env={"SLURM_ARRAY_TASK_ID": task, "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out == expected


# -- where a cluster job's run lives: a relative run_dir under the profile's run_root (#43) --


def sbatch_verb(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`hpctrain sbatch configs/demo.yaml ARGS --no-preflight` (run_dir: runs/demo)."""
    from hpctrain.cli.main import main

    code = main(["sbatch", str(REPO / "configs" / "demo.yaml"), *args, "--no-preflight"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_relative_run_dir_lands_under_the_profiles_run_root_on_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a login node ($SCRATCH set) the path is literal: the log goes into the run folder
    and the printed line is the path to give `hpctrain status`; nothing lands in the clone."""
    scratch, clone = tmp_path / "scratch", tmp_path / "clone"
    clone.mkdir()
    monkeypatch.chdir(clone)
    monkeypatch.setenv("SCRATCH", str(scratch))
    code, script, err = sbatch_verb(capsys, "--profile", "jean-zay-a100", "slurm.account=a@a100")
    run = scratch / "hpctrain" / "runs" / "demo"
    assert code == 0 and f'RUN_DIR="{run}"' in script
    assert f"#SBATCH --output={run}/slurm/%j.out" in script
    assert err == (
        f"hpctrain sbatch: run folder {run} (run_dir=runs/demo under the jean-zay-a100 "
        "profile's run_root; give this path to hpctrain status, eval, export)\n"
    )
    assert list(clone.iterdir()) == []


def test_off_the_cluster_the_run_root_is_left_for_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRATCH", raising=False)
    code, script, err = sbatch_verb(capsys, "--profile", "jean-zay-a100", "slurm.account=a@a100")
    assert code == 0 and 'RUN_DIR="$SCRATCH/hpctrain/runs/demo"' in script
    assert "#SBATCH --output=%x-%j.out" in script  # #SBATCH cannot expand $SCRATCH
    assert "run folder $SCRATCH/hpctrain/runs/demo (run_dir=runs/demo under" in err
    assert "its variables are expanded on the node" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given", ["{tmp}/mine", "$SCRATCH/mine"])
def test_an_absolute_or_variable_run_dir_is_kept(
    given: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    run_dir = given.format(tmp=tmp_path)
    code, script, err = sbatch_verb(
        capsys, f"run_dir={run_dir}", "--profile", "jean-zay-a100", "slurm.account=a@a100"
    )
    assert code == 0 and f'RUN_DIR="{run_dir}"' in script
    assert "run_root" not in err and f"run folder {run_dir}" in err


def test_a_sweeps_run_folders_are_under_the_run_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the generic profile's run_root: $HOME/hpctrain
    code, script, err = sbatch_verb(capsys, "--profile", "generic", "--sweep", "seed=1,2")
    runs = tmp_path / "hpctrain" / "runs" / "demo"
    assert code == 0 and f'RUN_DIR="{runs}/seed-1"' in script and f'"{runs}/seed-2"' in script
    assert f"run folders inside {runs}, one per sweep point" in err


def test_a_profile_without_run_root_keeps_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpctrain.launch.prepare import cluster_run_dir

    monkeypatch.chdir(tmp_path)
    profile = dataclasses.replace(load_profile("generic"), run_root="")
    placed = cluster_run_dir(with_overrides(Config(), ["run_dir=runs/x"]), profile)
    assert placed.run_dir == str(tmp_path / "runs" / "x")


def test_an_empty_account_the_site_wants_is_a_warning_without_preflight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = f"run_dir={tmp_path}"
    code, script, err = sbatch_verb(capsys, run, "--profile", "jean-zay-h100")
    assert code == 0 and "#SBATCH --account" not in script
    assert err.splitlines()[0] == (
        "hpctrain sbatch: warning: slurm.account is empty: the job goes to your default "
        "project; with several projects, or both CPU and GPU hours, jean-zay-h100 needs "
        "slurm.account=<project>@h100"
    )
    for args in ([run, "slurm.account=abc@h100", "--profile", "jean-zay-h100"],
                 [run, "--profile", "generic"]):  # fmt: skip
        assert "warning" not in sbatch_verb(capsys, *args)[2]


# -- slurm.spare_nodes: auto (#47): chosen from the numbers when the job is rendered --------


def test_auto_spares_are_chosen_from_the_profile_and_the_measured_queue_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """8 nodes x 20 h on a site whose nodes fail every 100 h, and your last jobs waited 1, 3
    and 5 h (sacct stubbed): one spare; the script asks for 9 nodes and says why, and so
    does the verb's stderr line."""
    from hpctrain.resilience.spares import SpareModel, choose_spares

    profile = tmp_path / "flaky.yaml"
    text = (REPO / "configs" / "clusters" / "local-dev.yaml").read_text()
    profile.write_text(text.replace("mtbf_node_hours: 12600", "mtbf_node_hours: 100"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(
        "#!/bin/sh\n"  # the user's recent jobs (the run has none): Submit|Start
        "echo '2026-01-01T10:00:00|2026-01-01T11:00:00'\n"
        "echo '2026-01-01T10:00:00|2026-01-01T13:00:00'\n"
        "echo '2026-01-01T10:00:00|2026-01-01T15:00:00'\n"
    )
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    code, script, err = sbatch_verb(
        capsys, "--profile", str(profile), f"run_dir={tmp_path / 'run'}", "slurm.nodes=8",
        "slurm.time=20:00:00", "slurm.spare_nodes=auto",
    )  # fmt: skip
    assert code == 0, err
    expected = choose_spares(
        SpareModel(8, 20.0, 100.0, 3.0), "median of 3 of your jobs of the last 14 days, sacct"
    )
    assert expected.spares == 1
    assert "#SBATCH --nodes=9  " in script and "# 8 to train on + 1 spare" in script
    assert f"\n# {expected.line}\n" in script
    assert f"hpctrain sbatch: {expected.line}\n" in err
    # the job's steps train on slurm.nodes of them: the rest stand by
    assert "slurm.spare_nodes=auto" in script


def test_a_profile_queue_wait_that_is_not_hours_is_refused(tmp_path: Path) -> None:
    profile = tmp_path / "bad.yaml"
    text = (REPO / "configs" / "clusters" / "local-dev.yaml").read_text()
    profile.write_text(text.replace("queue_wait_hours: 0.0033", "queue_wait_hours: soon"))
    with pytest.raises(LaunchError, match=r"bad.yaml: queue_wait_hours='soon' is not a number"):
        load_profile(str(profile))
