"""Preflight of the job's environment: real probes in a fresh `bash -lc` with fake environments.

Each fake environment is a setup line, as a profile or `slurm.setup` would have, that puts a
shim `python` first on PATH. The shim is this interpreter with a fake `torch` (or `hpctrain`)
package in front of the real ones, so the probe, the `bash -lc` run and the checks are the
real ones; only what the fake torch reports (version, CUDA, architectures) is made up.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.launch.checks import Check
from hpctrain.launch.environment import (
    arch_supported,
    check_job_environment,
    smi_cuda,
    torch_requirement,
)
from hpctrain.launch.profiles import JobSpec, load_profile, resolve_job

REPO = Path(__file__).resolve().parents[2]


def job_for(profile: str, *setup: str) -> JobSpec:
    cfg = with_overrides(Config(), [f"slurm.profile={profile}"])
    job = resolve_job(cfg, load_profile(profile))
    return dataclasses.replace(job, setup=tuple(setup))


def fake_env(
    tmp_path: Path,
    *,
    torch: str | None = None,
    hpctrain_broken: bool = False,
    nvidia_smi: str | None = None,
) -> str:
    """A folder with a shim `python`; returns the setup line that puts it first on PATH.

    `torch`: the body of a fake torch/__init__.py (None: the real torch). `nvidia_smi`: what
    a shim `nvidia-smi` prints (None: a login node's, whose driver answers nothing, exit 9,
    whatever this machine has).
    """
    root = tmp_path / "env"
    (root / "bin").mkdir(parents=True)
    (root / "site").mkdir()
    if torch is not None:
        (root / "site" / "torch").mkdir()
        (root / "site" / "torch" / "__init__.py").write_text(torch)
    if hpctrain_broken:
        (root / "site" / "hpctrain").mkdir()
        (root / "site" / "hpctrain" / "__init__.py").write_text(
            "raise ImportError('hpctrain is not installed here')\n"
        )
    shim = root / "bin" / "python"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={root / "site"} exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    smi = root / "bin" / "nvidia-smi"
    said, status = (NO_DRIVER, 9) if nvidia_smi is None else (nvidia_smi, 0)
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{said}\nEOF\nexit {status}\n")
    smi.chmod(0o755)
    return f'export PATH="{root / "bin"}:$PATH"'


def fake_torch(version: str, cuda: str | None, arch_list: list[str]) -> str:
    return (
        "import types\n"
        f"__version__ = {version!r}\n"
        f"version = types.SimpleNamespace(cuda={cuda!r})\n"
        f"cuda = types.SimpleNamespace(get_arch_list=lambda: {arch_list!r})\n"
    )


# What nvidia-smi prints: on a login node without a driver, and the header of a GPU node's.
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


def smi_header(driver: str, cuda: str) -> str:
    return (
        "+-----------------------------------------------------------------------------+\n"
        f"| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}     |\n"
        "|-------------------------------+----------------------+----------------------+"
    )


CU130_ARCHES = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU126_ARCHES = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def failures(checks) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {c.name: c.message for c in checks if not c.ok}


def test_requirement_comes_from_the_installed_metadata() -> None:
    assert torch_requirement() == "torch>=2.6"


def test_a_good_environment_passes(tmp_path: Path) -> None:
    setup = fake_env(tmp_path, torch=fake_torch("2.14.1+cu126", "12.6", CU126_ARCHES))
    checks = check_job_environment(job_for("jean-zay-v100", setup), "python")
    assert failures(checks) == {}
    names = {c.name for c in checks}
    assert {"environment", "torch version", "torch CUDA", "gpu arch"} <= names


def test_a_module_older_than_the_requirement_fails_with_its_fix(tmp_path: Path) -> None:
    setup = fake_env(tmp_path, torch=fake_torch("2.3.0", "12.1", CU126_ARCHES))
    bad = failures(check_job_environment(job_for("jean-zay-a100", setup), "python"))
    assert list(bad) == ["torch version"]
    assert (
        "torch 2.3.0" in bad["torch version"]
        and "hpctrain needs torch>=2.6" in bad["torch version"]
    )
    assert "fix:" in bad["torch version"] and "\n" not in bad["torch version"]


def test_a_torch_without_kernels_for_the_gpu_fails(tmp_path: Path) -> None:
    """The pip default (cu130) on a V100 node: no sm_70, the job would die after the queue."""
    setup = fake_env(tmp_path, torch=fake_torch("2.14.1+cu130", "13.0", CU130_ARCHES))
    bad = failures(check_job_environment(job_for("jean-zay-v100", setup), "python"))
    assert list(bad) == ["gpu arch"]
    assert "not sm_70" in bad["gpu arch"] and "sm_75 sm_80" in bad["gpu arch"]
    assert "whl/cu126" in bad["gpu arch"]
    # the same torch is fine on the H100 nodes
    ok = check_job_environment(job_for("jean-zay-h100", setup), "python")
    assert failures(ok) == {}


def test_a_cpu_only_torch_fails_on_a_gpu_profile(tmp_path: Path) -> None:
    setup = fake_env(tmp_path, torch=fake_torch("2.14.1+cpu", None, []))
    bad = failures(check_job_environment(job_for("jean-zay-h100", setup), "python"))
    assert list(bad) == ["torch CUDA"] and "CPU-only build" in bad["torch CUDA"]
    # the CPU dev cluster needs no CUDA
    assert failures(check_job_environment(job_for("local-dev", setup), "python")) == {}


def test_hpctrain_not_importable_fails(tmp_path: Path) -> None:
    setup = fake_env(
        tmp_path, torch=fake_torch("2.14.1+cu126", "12.6", CU126_ARCHES), hpctrain_broken=True
    )
    bad = failures(check_job_environment(job_for("jean-zay-v100", setup), "python"))
    assert list(bad) == ["hpctrain import"]
    assert "hpctrain is not installed here" in bad["hpctrain import"]


def test_the_kernel_toolchain_is_probed_in_the_jobs_environment(tmp_path: Path) -> None:
    """What triton builds with, as the job's setup lines leave it: a CC that is not there,
    a TRITON_LIBCUDA_PATH without the driver (this machine has none anyway)."""
    good = fake_env(tmp_path, torch=fake_torch("2.14.1+cu126", "12.6", CU126_ARCHES))
    setup = (good, "export CC=/nowhere/gcc", f"export TRITON_LIBCUDA_PATH={tmp_path}")
    checks = check_job_environment(job_for("jean-zay-h100", *setup), "python")
    assert failures(checks) == {}  # a warning: flex attention falls back, nothing fails
    (check,) = [c for c in checks if c.name == "kernel toolchain"]
    assert check.warning and "\n" not in check.message
    assert check.message.startswith("no C compiler (CC=/nowhere/gcc not found; fix:")
    assert "; no libcuda.so.1 where triton looks" in check.message
    assert "per-document attention would use SDPA's dense mask" in check.message
    assert check.message.endswith("login nodes often lack libcuda.so.1: the start-up checks again")
    # a run that compiles cannot start there: a failure, named
    bad = failures(check_job_environment(job_for("jean-zay-h100", *setup), "python", compile=True))
    assert list(bad) == ["kernel toolchain"]
    assert bad["kernel toolchain"].endswith("train.compile=true cannot build its kernels")
    # with gcc and Python.h (this machine's), a CPU cluster misses nothing
    cpu = check_job_environment(job_for("local-dev", good), "python", compile=True)
    (check,) = [c for c in cpu if c.name == "kernel toolchain"]
    assert check.ok and not check.warning and "Python.h" in check.message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_a_missing_module_command_names_the_line(tmp_path: Path) -> None:
    """`module` does not exist on this machine: the setup line fails in the login shell."""
    checks = check_job_environment(job_for("jean-zay-v100", "module load python/3.11.5"))
    bad = [c.message for c in checks if not c.ok and c.name == "environment"]
    assert len(bad) == 1
    assert "'module load python/3.11.5' failed" in bad[0] and "module: command not found" in bad[0]


def test_a_python_that_does_not_exist(tmp_path: Path) -> None:
    bad = failures(check_job_environment(job_for("generic"), str(tmp_path / "no" / "python")))
    assert "Python did not start" in bad["environment"]


@pytest.mark.parametrize(
    ("arch", "arch_list", "ok"),
    [
        ("sm_70", CU126_ARCHES, True),
        ("sm_70", CU130_ARCHES, False),
        ("sm_90", ["sm_80", "compute_80"], True),  # PTX of an older arch is JIT-compiled
        ("sm_70", ["sm_80", "compute_80"], False),  # never for an older GPU
        ("sm_90", ["sm_80", "sm_86"], False),
    ],
)
def test_arch_support(arch: str, arch_list: list[str], ok: bool) -> None:
    assert arch_supported(arch, arch_list) is ok


def test_preflight_verb_reports_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A site module of an old torch, as `module load` would: it sets PYTHONPATH."""
    fake_env(tmp_path, torch=fake_torch("2.3.0", "12.1", CU126_ARCHES))
    setup = f'export PYTHONPATH="{tmp_path / "env" / "site"}"'
    code = main(
        ["preflight", str(REPO / "configs" / "demo.yaml"), "--no-data", f"run_dir={tmp_path / 'r'}",
         "--profile", "generic", f"slurm.setup=['{setup}']"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 6
    assert "FAIL torch version: torch 2.3.0" in captured.out
    assert captured.err.count("\n") == 1 and "hpctrain needs torch>=2.6" in captured.err


def test_every_profile_names_its_gpu_architecture() -> None:
    arches = {name: load_profile(name).gpu_arch for name in
              ("jean-zay-v100", "jean-zay-a100", "jean-zay-h100", "generic")}  # fmt: skip
    assert arches == {
        "jean-zay-v100": "sm_70",
        "jean-zay-a100": "sm_80",
        "jean-zay-h100": "sm_90",
        "generic": "sm_80",
    }
    for name in arches:
        assert not any("pytorch-gpu/py3/2.3" in line for line in load_profile(name).setup)


def driver(checks: list[Check]) -> Check:
    (check,) = [c for c in checks if c.name == "gpu driver"]
    assert "\n" not in check.message
    return check


def test_a_cu13_torch_on_a_cuda_12_driver_fails_naming_both(tmp_path: Path) -> None:
    """nvidia-smi where preflight runs (a GPU node) reports a CUDA 12 driver: the pip
    default torch (cu130) would find no GPU there after the queue wait."""
    setup = fake_env(
        tmp_path,
        torch=fake_torch("2.14.1+cu130", "13.0", CU130_ARCHES),
        nvidia_smi=smi_header("550.54.15", "12.4"),
    )
    check = driver(check_job_environment(job_for("jean-zay-h100", setup), "python"))
    # a profile that names no GPU architecture (a copy of generic.yaml) is checked the same
    no_arch = dataclasses.replace(job_for("generic", setup), gpu_arch="")
    assert driver(check_job_environment(no_arch, "python")).message == check.message
    assert not check.ok
    assert (
        "torch 2.14.1+cu130 (CUDA 13.0) needs an NVIDIA driver for CUDA 13.x or newer (R580+)"
        in check.message
    )
    assert "where preflight ran: CUDA 12.4, driver 550.54.15" in check.message
    assert "fix: install a torch build for the driver's CUDA" in check.message
    assert "whl/cu126" in check.message


def test_a_driver_of_the_same_cuda_major_runs_the_build(tmp_path: Path) -> None:
    """Minor-version compatibility: a cu126 torch on a CUDA 12.2 driver; cu130 on 13.0."""
    for torch_cuda, arches, smi in (("12.6", CU126_ARCHES, "12.2"), ("13.0", CU130_ARCHES, "13.0")):
        folder = tmp_path / torch_cuda
        setup = fake_env(
            folder,
            torch=fake_torch(f"2.14.1+cu{torch_cuda.replace('.', '')}", torch_cuda, arches),
            nvidia_smi=smi_header("580.65.06", smi),
        )
        check = driver(check_job_environment(job_for("jean-zay-h100", setup), "python"))
        assert check.ok and not check.warning, check.message
        assert check.message.endswith(f"runs CUDA {torch_cuda}")


def test_an_unknown_driver_is_said_to_be_unchecked(tmp_path: Path) -> None:
    """A login node (nvidia-smi answers no driver) and a profile that documents none: the
    check passes with a warning that says plainly it was not done, and what to do."""
    setup = fake_env(tmp_path, torch=fake_torch("2.14.1+cu130", "13.0", CU130_ARCHES))
    check = driver(check_job_environment(job_for("jean-zay-h100", setup), "python"))
    assert check.ok and check.warning
    assert check.message.startswith("not checked: nvidia-smi on ")
    assert (
        "answered no driver (exit 9) and profile jean-zay-h100 documents no driver_cuda"
        in check.message
    )
    assert "needs an NVIDIA driver for CUDA 13.x or newer (R580+) on the nodes" in check.message
    assert "set driver_cuda in the profile" in check.message


def test_the_profiles_documented_driver_is_checked(tmp_path: Path) -> None:
    """Without nvidia-smi's answer the profile's `driver_cuda` decides; with both, both count."""
    cu130 = fake_env(tmp_path / "a", torch=fake_torch("2.14.1+cu130", "13.0", CU130_ARCHES))
    job = dataclasses.replace(job_for("jean-zay-h100", cu130), driver_cuda="12.8")
    check = driver(check_job_environment(job, "python"))
    assert not check.ok
    assert "jean-zay-h100's nodes (the profile's driver_cuda): CUDA 12.8" in check.message
    ok = dataclasses.replace(job, driver_cuda="13.1")
    assert driver(check_job_environment(ok, "python")).ok
    # a GPU node's answer that disagrees with the profile: the older one fails the check
    new_node = fake_env(
        tmp_path / "b",
        torch=fake_torch("2.14.1+cu130", "13.0", CU130_ARCHES),
        nvidia_smi=smi_header("580.65.06", "13.0"),
    )
    both = dataclasses.replace(job_for("jean-zay-h100", new_node), driver_cuda="12.8")
    check = driver(check_job_environment(both, "python"))
    assert not check.ok and "CUDA 12.8" in check.message and "nvidia-smi" not in check.message


def test_no_driver_check_without_cuda(tmp_path: Path) -> None:
    """The CPU dev cluster, and a CPU-only torch (its own failure says what to install)."""
    setup = fake_env(tmp_path, torch=fake_torch("2.14.1+cpu", None, []))
    for profile in ("local-dev", "jean-zay-h100"):
        names = {c.name for c in check_job_environment(job_for(profile, setup), "python")}
        assert "gpu driver" not in names


def test_nvidia_smi_header_is_read() -> None:
    assert smi_cuda(smi_header("535.183.06", "12.2")) == ("12.2", "535.183.06")
    assert smi_cuda(NO_DRIVER) == ("", "")
