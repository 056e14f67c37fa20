"""What compiling kernels at run time needs from the machine: a C compiler, Python.h, libcuda.

Triton (inductor's GPU backend, and so flex attention's kernels and block masks) builds a small
C launcher for the kernels it compiles, with the system's C compiler, against Python's headers,
linked to the CUDA driver's `libcuda.so.1` (triton's `runtime/build.py`, `_build` and
`_find_compiler`; `backends/nvidia/driver.py`, `libcuda_dirs`). Inductor's CPU backend compiles
C++ against the same headers. On a compute node without them (no `module load gcc`, an image
without Python's development headers, a driver outside the loader's cache) the first compiled
forward fails deep inside triton, after the queue wait and the start-up.

`find_toolchain` looks where triton looks, without importing torch or triton: the job-environment
preflight runs it in the job's Python (`launch/environment.py`), `train.compile=true` is refused
by it (`parallel/precision.py`), and the GPT falls back from flex attention to SDPA's masked path
by it (`models/gpt.py`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass

LIBCUDA = "libcuda.so.1"
LDCONFIG = "/sbin/ldconfig"  # the path triton runs


@dataclass(frozen=True)
class Toolchain:
    """Where this machine's kernel-building pieces are ("" where one is missing)."""

    c_compiler: str  # triton's choice: $CC, else gcc, else clang
    python_h: str  # Python.h in the interpreter's include folder
    libcuda: str  # the folder of libcuda.so.1 triton would link against
    python_include: str  # where Python.h was looked for (named when it is missing)
    compiler_wanted: str = ""  # $CC when it is set

    def missing(self, *, cuda: bool, c_compiler: bool = True) -> list[str]:
        """Each missing piece in a few words with its fix; `cuda`: libcuda counts too,
        `c_compiler`: the C compiler does (inductor's CPU backend wants C++, checked apart)."""
        out = []
        if c_compiler and not self.c_compiler:
            out.append(
                f"no C compiler (CC={self.compiler_wanted} not found; fix: set CC to a compiler)"
                if self.compiler_wanted
                else "no C compiler (neither gcc nor clang on PATH, CC unset; fix: `module "
                "load gcc` in the job's setup, or set CC)"
            )
        if not self.python_h:
            out.append(
                f"no Python.h in {self.python_include} (fix: install Python's development "
                "headers, python3-dev/python3-devel, or use a Python that has them)"
            )
        if cuda and not self.libcuda:
            out.append(
                f"no {LIBCUDA} where triton looks ({LDCONFIG} -p, LD_LIBRARY_PATH, "
                "TRITON_LIBCUDA_PATH; fix: set TRITON_LIBCUDA_PATH to the driver's folder)"
            )
        return out


def find_toolchain(environ: Mapping[str, str] | None = None) -> Toolchain:
    """This machine's pieces, found as triton finds them."""
    env = os.environ if environ is None else environ
    wanted = env.get("CC", "")
    if wanted:
        compiler = shutil.which(wanted) or ""
    else:
        compiler = shutil.which("gcc") or shutil.which("clang") or ""
    include = python_include()
    header = os.path.join(include, "Python.h")
    return Toolchain(
        c_compiler=compiler,
        python_h=header if os.path.isfile(header) else "",
        libcuda=libcuda_folder(env),
        python_include=include,
        compiler_wanted=wanted,
    )


def python_include() -> str:
    """The include folder triton compiles against (Debian's `posix_local` scheme mapped to
    `posix_prefix`, as triton does)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def libcuda_folder(environ: Mapping[str, str]) -> str:
    """The folder of libcuda.so.1 that triton would use, or "".

    TRITON_LIBCUDA_PATH if set; else the loader cache (`ldconfig -p`); else, only when the
    cache has none, LD_LIBRARY_PATH's folders. Without ldconfig triton fails unless
    TRITON_LIBCUDA_PATH is set.
    """
    given = environ.get("TRITON_LIBCUDA_PATH", "")
    if given:
        return given if os.path.isfile(os.path.join(given, LIBCUDA)) else ""
    cached = ldconfig_paths(LIBCUDA)
    if cached is None:
        return ""
    folders = [os.path.dirname(path) for path in cached]
    if not folders:
        folders = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    return next((d for d in folders if os.path.isfile(os.path.join(d, LIBCUDA))), "")


def ldconfig_paths(library: str) -> list[str] | None:
    """The paths the loader cache lists for `library`; None where ldconfig cannot run."""
    try:
        listing = subprocess.run(
            [LDCONFIG, "-p"], capture_output=True, text=True, errors="ignore", timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.split()[-1] for line in listing.splitlines() if library in line]
