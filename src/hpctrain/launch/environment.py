"""Preflight of the job's environment, as the job will see it, not as the login shell does.

The job runs the profile's and config's setup lines (`module load ...`) and then its Python (or
the container's). A venv that does not import hpctrain, a module whose torch is older than the
package requires, a CPU-only torch, or a torch without kernels for the partition's GPUs (the
pip default torch 2.14+cu130 has none for a V100's sm_70) otherwise shows only after the queue
wait. `probe_environment` runs exactly those setup lines and that Python in a fresh login shell
(`bash -lc`), or the image through its runtime, and `environment_checks` turns the answer into
one `Check` per finding, each failure one line with its fix. The probe also looks for what
triton and inductor build kernels with (a C compiler, Python.h, libcuda.so.1:
`hpctrain.toolchain`), which per-document attention needs on GPUs and `train.compile` always,
and asks `nvidia-smi` which CUDA the driver runs (a cu13x torch needs a CUDA 13 driver).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from hpctrain.launch.checks import Check
from hpctrain.launch.container import exec_words
from hpctrain.launch.profiles import JobSpec
from hpctrain.toolchain import Toolchain

PROBE_TIMEOUT_S = 300.0  # module loads on a busy login node and a cold `import torch` take a while
_MARK = "HPCTRAIN-PROBE:"
_SETUP_FAILED = "HPCTRAIN-SETUP-FAILED:"

# Runs in the job's Python: what it imports and what its torch can do, one JSON line.
PROBE = f"""
import json, sys
out = {{"python": sys.executable, "python_version": sys.version.split()[0]}}
try:
    import hpctrain
    out["hpctrain"] = getattr(hpctrain, "__version__", "?")
except Exception as exc:
    out["hpctrain_error"] = f"{{type(exc).__name__}}: {{exc}}".splitlines()[0]
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["arch_list"] = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
    if torch.version.cuda and not out["arch_list"]:
        # older torch answers [] without a visible GPU, as on a login node
        flags = getattr(getattr(torch, "_C", None), "_cuda_getArchFlags", lambda: None)()
        out["arch_list"] = flags.split() if flags else []
except Exception as exc:
    out["torch_error"] = f"{{type(exc).__name__}}: {{exc}}".splitlines()[0]
try:
    import shutil, socket, subprocess
    smi = shutil.which("nvidia-smi")
    answer = {{"host": socket.gethostname(), "found": bool(smi)}}
    if smi:
        done = subprocess.run([smi], capture_output=True, text=True, timeout=60)
        answer["returncode"] = done.returncode
        answer["header"] = next((x for x in done.stdout.splitlines() if "CUDA Version" in x), "")
    out["nvidia_smi"] = answer
except Exception as exc:
    out["nvidia_smi"] = {{"error": f"{{type(exc).__name__}}: {{exc}}".splitlines()[0]}}
try:
    import dataclasses
    from hpctrain.toolchain import find_toolchain
    out["toolchain"] = dataclasses.asdict(find_toolchain())
except ImportError:
    pass  # no hpctrain there (reported above), or one older than this check
print("{_MARK}" + json.dumps(out))
"""


@dataclass(frozen=True)
class Probe:
    """What the job's environment answered."""

    command: str  # what ran, for messages
    returncode: int
    report: dict[str, Any]  # the probe's JSON; {} when it did not get that far
    failed_setup: list[tuple[int, str, str]] = field(default_factory=list)  # (index, line, stderr)
    stderr_tail: str = ""


def torch_requirement() -> str:
    """hpctrain's torch requirement from its installed metadata (`torch>=2.6`)."""
    try:
        requires = metadata.requires("hpctrain") or []
    except metadata.PackageNotFoundError:
        requires = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and req.marker is None:
            return str(req)
    return ""


def setup_script(setup: tuple[str, ...] | list[str], final: str) -> str:
    """The setup lines, each reporting its own failure on stderr, then `final`.

    Each line runs as in the job script (one after the other, a failure does not stop the
    next); a failed one prints its index and status so the preflight names it.
    """
    parts = []
    for i, line in enumerate(setup):
        # a newline, not `;`, ends the line: a trailing `# comment` must not swallow the `}`
        parts.append(f"{{\n{line}\n}} || echo '{_SETUP_FAILED}{i}' >&2")
    parts.append(final)
    return "\n".join(parts)


def probe_command(job: JobSpec, python: str) -> tuple[list[str], str]:
    """(argv, a short description) of the probe for `job` run by `python` (or its image)."""
    if job.container:
        inner = " ".join(
            shlex.quote(w)
            for w in exec_words(
                job.container_runtime,
                job.container,
                [],
                gpus=False,  # no GPU on a login node; the image's torch still lists its arches
                quote=False,
            )
        )
        what = f"{job.container_runtime} exec {job.container}"
    else:
        inner = shlex.quote(python)
        what = python
    script = setup_script(job.setup, f"{inner} -c {shlex.quote(PROBE)}")
    return ["bash", "-lc", script], what


def probe_environment(job: JobSpec, python: str = sys.executable) -> Probe:
    """Run the job's setup lines and Python in a fresh login shell; what they answered."""
    argv, what = probe_command(job, python)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return Probe(what, -1, {}, stderr_tail=f"no answer within {PROBE_TIMEOUT_S:.0f} s")
    report: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            try:
                report = json.loads(line[len(_MARK) :])
            except ValueError:
                report = {}
    failed_setup = []
    err_lines = done.stderr.splitlines()
    for n, line in enumerate(err_lines):
        match = re.fullmatch(re.escape(_SETUP_FAILED) + r"(\d+)", line.strip())
        if match:
            i = int(match.group(1))
            # the line's own complaint is the last stderr line before the marker
            before = [x for x in err_lines[:n] if x.strip() and not x.startswith(_SETUP_FAILED)]
            failed_setup.append((i, job.setup[i], before[-1].strip() if before else ""))
    tail = next((x.strip() for x in reversed(err_lines) if x.strip()), "")
    return Probe(what, done.returncode, report, failed_setup, tail)


def _arch_number(arch: str) -> int:
    match = re.search(r"(\d+)", arch)
    return int(match.group(1)) if match else -1


def arch_supported(arch: str, arch_list: list[str]) -> bool:
    """Whether a torch built for `arch_list` runs on `arch` (sm_70...).

    An exact `sm_XX` kernel, or PTX (`compute_YY`) of the same or an older architecture, which
    the driver compiles for the newer GPU at load time.
    """
    wanted = _arch_number(arch)
    for entry in arch_list:
        if entry == arch or (entry.startswith("sm_") and _arch_number(entry) == wanted):
            return True
        if entry.startswith("compute_") and 0 <= _arch_number(entry) <= wanted:
            return True
    return False


def environment_checks(
    job: JobSpec, probe: Probe, requirement: str, *, needs_cuda: bool, compile: bool = False
) -> list[Check]:
    """One `Check` per finding of `probe` against hpctrain's torch `requirement` and `job`.

    `compile`: the run sets `train.compile=true`, which cannot run without a kernel
    toolchain (a failure then, a warning otherwise: see `_toolchain_check`).
    """
    where = f"in the job's environment ({probe.command})"
    checks = [
        Check(
            "environment",
            False,
            f"setup line {line!r} failed in a fresh login shell"
            + (f" ({detail})" if detail else "")
            + "; fix: make it work in `bash -lc` on a login node, or change slurm.setup / the profile's setup",
        )
        for i, line, detail in probe.failed_setup
    ]
    report = probe.report
    if not report:
        reason = probe.stderr_tail or f"exit status {probe.returncode}"
        fix = (
            f"check slurm.container and that {job.container_runtime} is installed"
            if job.container
            else "run `hpctrain submit/sbatch` with the venv's python, after the same setup lines"
        )
        return [
            *checks,
            Check("environment", False, f"Python did not start {where}: {reason}; fix: {fix}"),
        ]
    checks.append(
        Check(
            "environment", True, f"Python {report.get('python_version')} at {report.get('python')}"
        )
    )
    if "hpctrain_error" in report:
        checks.append(
            Check(
                "hpctrain import",
                False,
                f"{report['hpctrain_error']} {where}; fix: `pip install -e /path/to/hpctrain` into that environment (or the image)",
            )
        )
    if "torch_error" in report or "torch" not in report:
        checks.append(
            Check(
                "torch",
                False,
                f"torch does not import {where}: {report.get('torch_error', 'not reported')}; fix: install torch into it (docs/clusters.md: the job's environment)",
            )
        )
        return checks
    version = str(report["torch"])
    checks.append(_version_check(version, requirement, where))
    if needs_cuda:
        checks += _cuda_checks(job, version, report, where)
    if "toolchain" in report:
        checks.append(
            _toolchain_check(report["toolchain"], where, cuda=needs_cuda, compile=compile)
        )
    return checks


def _toolchain_check(found: dict[str, Any], where: str, *, cuda: bool, compile: bool) -> Check:
    """What triton and inductor build kernels with, as the job's environment has it.

    Missing, causal_lm's per-document attention on GPUs falls back from flex attention to
    SDPA's dense mask at start-up (`models/gpt.py`) and `train.compile=true` is refused: a
    warning, unless the run compiles. libcuda.so.1 comes with the GPU driver, which login
    nodes (where this probe runs) often lack: its absence alone is a warning, checked again
    at start-up on the GPU node.
    """
    # the job's hpctrain answered: it may be another version than this one
    tools = Toolchain(**{f.name: str(found.get(f.name, "")) for f in dataclasses.fields(Toolchain)})
    missing = tools.missing(cuda=cuda)
    if not missing:
        driver = f", libcuda.so.1 in {tools.libcuda}" if cuda else ""
        return Check("kernel toolchain", True, f"{tools.c_compiler}, {tools.python_h}{driver}")
    if compile and tools.missing(cuda=False):
        return Check(
            "kernel toolchain",
            False,
            f"{'; '.join(missing)} {where}: train.compile=true cannot build its kernels",
        )
    effect = (
        "causal_lm's per-document attention would use SDPA's dense mask instead of flex "
        "attention (more memory, slower)"
        if cuda
        else "train.compile=true would be refused"
    )
    if cuda and not tools.libcuda:
        effect += "; login nodes often lack libcuda.so.1: the start-up checks again"
    return Check("kernel toolchain", True, f"{'; '.join(missing)} {where}: {effect}", warning=True)


def _version_check(version: str, requirement: str, where: str) -> Check:
    if not requirement:
        return Check(
            "torch version",
            True,
            f"torch {version} (hpctrain's requirement unknown: not installed from metadata)",
            warning=True,
        )
    req = Requirement(requirement)
    try:
        ok = req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return Check("torch version", True, f"torch {version} satisfies {requirement}")
    return Check(
        "torch version",
        False,
        f"torch {version} {where}, hpctrain needs {requirement}; fix: install torch 2.14 wheels into a venv (docs/clusters.md: the job's environment) instead of an older site module",
    )


def _cuda_checks(job: JobSpec, version: str, report: dict[str, Any], where: str) -> list[Check]:
    if not report.get("cuda"):
        return [
            Check(
                "torch CUDA",
                False,
                f"torch {version} {where} is a CPU-only build; fix: install a CUDA build, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu126",
            )
        ]
    checks = [
        Check("torch CUDA", True, f"torch {version} built with CUDA {report['cuda']}"),
        driver_check(job, version, str(report["cuda"]), report.get("nvidia_smi") or {}),
    ]
    if not job.gpu_arch:
        return checks
    arch_list = [str(a) for a in report.get("arch_list", [])]
    if arch_supported(job.gpu_arch, arch_list):
        checks.append(Check("gpu arch", True, f"{job.gpu_arch} in {' '.join(arch_list)}"))
    else:
        checks.append(
            Check(
                "gpu arch",
                False,
                f"torch {version} {where} has kernels for {' '.join(arch_list) or 'no architecture'}, not {job.gpu_arch} ({job.profile}); "
                "fix: install the cu126 build (pip install torch --index-url https://download.pytorch.org/whl/cu126: sm_50 to sm_90, V100 included)",
            )
        )
    return checks


# The oldest Linux driver branch of each CUDA major (NVIDIA's CUDA compatibility table): within
# a major, minor-version compatibility runs any 12.x build on a 12.0 driver and up.
MIN_DRIVER = {11: "R450", 12: "R525", 13: "R580"}


def _major(version: str) -> int:
    match = re.match(r"(\d+)", version)
    return int(match.group(1)) if match else -1


def smi_cuda(header: str) -> tuple[str, str]:
    """(CUDA version, driver version) from nvidia-smi's header line; ("", "") if absent."""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    return (cuda.group(1) if cuda else "", driver.group(1) if driver else "")


def driver_check(job: JobSpec, version: str, torch_cuda: str, smi: dict[str, Any]) -> Check:
    """Whether the nodes' NVIDIA driver runs a torch built for CUDA `torch_cuda`.

    A driver runs builds of its own CUDA major and older; a cu130 torch on a CUDA 12 driver
    finds no GPU at start-up (torch warns "driver too old" and falls back to the CPU). What
    is known of the driver: nvidia-smi where the probe ran (a GPU node when preflight runs
    there, often nothing on a login node) and the profile's documented `driver_cuda`; each
    that is known is checked, and neither known says so.
    """
    need = _major(torch_cuda)
    needs = (
        f"torch {version} (CUDA {torch_cuda}) needs an NVIDIA driver for CUDA {need}.x or "
        f"newer ({MIN_DRIVER.get(need, 'see NVIDIA')}+)"
    )
    fix = (
        f"install a torch build for the driver's CUDA (the cu126 wheels run on CUDA 12 "
        f"drivers, {MIN_DRIVER[12]}+: pip install torch --index-url "
        "https://download.pytorch.org/whl/cu126) or use nodes with a newer driver"
    )
    host = smi.get("host", "this machine")
    known: list[tuple[str, str]] = []  # (CUDA version the driver runs, where it was learnt)
    smi_found, smi_driver = smi_cuda(str(smi.get("header", "")))
    if smi_found:
        where = f"nvidia-smi on {host}, where preflight ran"
        known.append((smi_found, f"{where}: CUDA {smi_found}, driver {smi_driver or '?'}"))
    if job.driver_cuda:
        where = f"{job.profile}'s nodes (the profile's driver_cuda)"
        known.append((job.driver_cuda, f"{where}: CUDA {job.driver_cuda}"))
    if not known:
        if smi.get("error"):
            tried = f"nvidia-smi failed where preflight ran ({smi['error']})"
        elif smi.get("found"):
            tried = f"nvidia-smi on {host} answered no driver (exit {smi.get('returncode')})"
        else:
            tried = f"no nvidia-smi on {host}"
        return Check(
            "gpu driver",
            True,
            f"not checked: {tried} and profile {job.profile} documents no driver_cuda; {needs} "
            "on the nodes: run `nvidia-smi` there (srun ... nvidia-smi) and set driver_cuda "
            "in the profile, or run preflight on a GPU node",
            warning=True,
        )
    too_old = [what for found, what in known if _major(found) < need]
    if too_old:
        return Check("gpu driver", False, f"{needs}; {'; '.join(too_old)}; fix: {fix}")
    return Check(
        "gpu driver", True, f"{'; '.join(what for _, what in known)}: runs CUDA {torch_cuda}"
    )


def check_job_environment(
    job: JobSpec, python: str = sys.executable, *, compile: bool = False
) -> list[Check]:
    """Probe the job's environment and check it (see the module docstring); `compile`: the
    run sets `train.compile=true`."""
    if job.container:
        image = Path(job.container)
        if "$" not in job.container and not image.is_file():
            return [
                Check(
                    "container",
                    False,
                    f"slurm.container={job.container!r}: no such image file; fix: build it (docs/clusters.md: the job's environment) or correct the path",
                )
            ]
        if shutil.which(job.container_runtime) is None and not _setup_may_provide(job):
            return [
                Check(
                    "container",
                    True,
                    f"{job.container_runtime} is not installed here: the image's imports are not checked",
                    warning=True,
                )
            ]
    probe = probe_environment(job, python)
    return environment_checks(
        job,
        probe,
        torch_requirement(),
        needs_cuda=bool(job.gpus_per_node or job.gpu_arch),
        compile=compile,
    )


def _setup_may_provide(job: JobSpec) -> bool:
    """Whether setup lines run first: they may bring the runtime (`module load singularity`)."""
    return bool(job.setup)
