"""`slurm.container`: the rendered job scripts, submitit's command, and the preflight.

No real `apptainer exec` runs here: Debian 12's archive has no apptainer or singularity
package (only siftool and Go client libraries), and PyPI has no runtime either. The rendered
scripts are compared with golden files and run through `bash -n`; the preflight runs its real
probe through a stand-in `apptainer` on PATH that runs the command after the image on the host,
so what is checked inside the image (imports, torch version) is the real check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.launch.container import container_binds, local_folder
from hpctrain.launch.environment import check_job_environment
from hpctrain.launch.profiles import LaunchError, load_profile, resolve_job
from hpctrain.launch.sbatch import render_sbatch
from hpctrain.launch.submit import executor_parameters, job_python, submission_script
from tests.launch.test_sbatch import HERE, golden

IMAGE = "$WORK/images/hpctrain.sif"


def container_job(*overrides: str, profile: str = "jean-zay-h100"):  # type: ignore[no-untyped-def]
    cfg = with_overrides(
        Config(),
        ["run_dir=/scratch/u/runs/demo", f"slurm.profile={profile}", f"slurm.container={IMAGE}",
         "data.train=/dsdir/shards/train/index.json", "data.val=s3://bucket/val",
         "slurm.container_binds=['/opt/site:/opt/site']", *overrides],
    )  # fmt: skip
    return resolve_job(cfg, load_profile(profile))


def render(job) -> str:  # type: ignore[no-untyped-def]
    return render_sbatch(
        job,
        config_path="/work/u/hpctrain/configs/demo.yaml",
        overrides=["train.max_steps=100"],
        run_dir="/scratch/u/runs/demo",
        python="/unused/python",
        log_dir="/scratch/u/runs/demo/slurm",
        description="rendered by `hpctrain sbatch` from demo.yaml",
    )


def test_binds_cover_run_folder_data_and_checkpoints() -> None:
    assert container_job("checkpoint.dir=/store/ckpt").container_binds == (
        "/scratch/u/runs/demo",
        "/dsdir/shards/train",
        "/store/ckpt",
        "/opt/site:/opt/site",
    )  # the s3:// validation data needs no bind
    assert local_folder("pipe:curl -s http://x/a.tar") is None
    assert local_folder("/d/train-{000000..000009}.tar") == "/d"
    assert local_folder("$SCRATCH/shards/index.json") == "$SCRATCH/shards"
    cfg = with_overrides(Config(), ["slurm.container=x.sif", "run_dir=/r"])
    assert container_binds(cfg) == ("/r",)


def test_container_script_matches_golden() -> None:
    script = render(container_job())
    golden(HERE / "golden" / "jean-zay-h100-container.sbatch", script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    python = next(line for line in script.splitlines() if line.startswith("PYTHON=("))
    assert python.startswith(
        'PYTHON=(singularity exec --nv --bind "$RUN_DIR" --bind "/work/u/hpctrain/configs"'
    )
    assert python.endswith('"$CONTAINER" python3)')
    # the training's srun is grouped with the filter that keeps srun's own lines: `{ srun ...`
    sruns = [line.strip().removeprefix("{ ") for line in script.splitlines()
             if line.strip().removeprefix("{ ").startswith("srun ")]  # fmt: skip
    assert sruns and all('"${PYTHON[@]}" -m hpctrain.resilience.' in line for line in sruns)
    assert 'PYTHON="' not in script  # the host interpreter plays no part


def test_cpu_profile_runs_without_nv_and_apptainer() -> None:
    python = next(
        line
        for line in render(container_job(profile="local-dev")).splitlines()
        if line.startswith("PYTHON=(")
    )
    assert python.startswith("PYTHON=(apptainer exec --bind ") and "--nv" not in python


def test_submitit_runs_the_container_python(tmp_path: Path) -> None:
    job = container_job()
    python = job_python(job, tmp_path / "submitit")
    assert python.startswith('singularity exec --nv --bind "/scratch/u/runs/demo"')
    assert python.endswith(f'--bind "{tmp_path / "submitit"}" "{IMAGE}" python3')
    script = submission_script(job, tmp_path / "submitit")  # eval/predict: every task a rank
    assert f'"{IMAGE}" python3 -u -m submitit.core._submit' in script
    assert "slurm_python" not in executor_parameters(job)  # a constructor argument, not a parameter
    # training: the job's one process runs the job script on the host; its tasks use the image
    training = submission_script(job, tmp_path / "submitit", "/venv/bin/python", training=True)
    assert "\n/venv/bin/python -u -m submitit.core._submit" in training


def test_unsafe_container_values_are_refused() -> None:
    with pytest.raises(LaunchError, match="slurm.container"):
        render(container_job("slurm.container=/img/$(id).sif"))
    with pytest.raises(LaunchError, match="container bind"):
        render(container_job("slurm.container_binds=['/a;id']"))


def fake_runtime(tmp_path: Path) -> Path:
    """A stand-in `apptainer`: skips exec's options and the image, runs the rest on the host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    runtime = bin_dir / "apptainer"
    runtime.write_text(
        "#!/bin/bash\n"
        "shift  # exec\n"
        'while [ "${1#-}" != "$1" ]; do case "$1" in --bind) shift 2 ;; *) shift ;; esac; done\n'
        "shift  # the image\n"
        f'[ "$1" = python3 ] && shift && exec {sys.executable} "$@"\n'
        'exec "$@"\n'
    )
    runtime.chmod(0o755)
    return bin_dir


def test_preflight_fails_on_a_missing_image(tmp_path: Path) -> None:
    job = container_job(f"slurm.container={tmp_path / 'missing.sif'}", profile="local-dev")
    (check,) = check_job_environment(job)
    assert not check.ok and "no such image file" in check.message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_preflight_checks_imports_inside_the_image(tmp_path: Path) -> None:
    image = tmp_path / "hpctrain.sif"
    image.write_bytes(b"SIF stand-in")
    # as `module load apptainer` would (a login shell resets PATH: the setup line sets it)
    setup = f"slurm.setup=['export PATH={fake_runtime(tmp_path)}:$PATH']"
    job = container_job(f"slurm.container={image}", setup, profile="local-dev")
    checks = check_job_environment(job)
    assert [c.name for c in checks if not c.ok] == [], checks
    assert any(c.name == "torch version" and c.ok for c in checks)


def test_preflight_without_the_runtime_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "hpctrain.sif"
    image.write_bytes(b"SIF stand-in")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    (check,) = check_job_environment(container_job(f"slurm.container={image}", profile="local-dev"))
    assert check.ok and check.warning and "not installed here" in check.message
