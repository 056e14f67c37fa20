"""Where triton finds a C compiler, Python.h and libcuda.so.1, probed without torch or triton.

This machine has gcc and Python.h but no GPU driver; the other cases fake the probes (the
PATH lookup, the include folder, the loader cache) and use real files in tmp_path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain import toolchain as toolchain_module
from hpctrain.toolchain import LIBCUDA, find_toolchain


def test_this_machine_has_a_c_compiler_and_python_h() -> None:
    found = find_toolchain({"PATH": "/usr/bin:/bin"})
    assert found.c_compiler and Path(found.python_h).name == "Python.h"
    assert found.missing(cuda=False) == []


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node with gcc, Python.h and a driver in `tmp_path/driver`, all faked but the files."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "Python.h").write_text("")
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / LIBCUDA).write_text("")
    tools = {"gcc": "/usr/bin/gcc", "clang": None}
    monkeypatch.setattr(toolchain_module.shutil, "which", lambda name: tools.get(name))
    monkeypatch.setattr(toolchain_module, "python_include", lambda: str(tmp_path / "include"))
    cache = [f"{tmp_path / 'driver' / LIBCUDA}"]
    monkeypatch.setattr(toolchain_module, "ldconfig_paths", lambda library: cache)
    return tmp_path


def test_a_complete_node_misses_nothing(node: Path) -> None:
    found = find_toolchain({})
    assert (found.c_compiler, found.libcuda) == ("/usr/bin/gcc", str(node / "driver"))
    assert found.missing(cuda=True) == []


def test_each_missing_piece_is_named_with_its_fix(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toolchain_module.shutil, "which", lambda name: None)
    (node / "include" / "Python.h").unlink()
    monkeypatch.setattr(toolchain_module, "ldconfig_paths", lambda library: [])
    missing = find_toolchain({}).missing(cuda=True)
    assert missing == [
        "no C compiler (neither gcc nor clang on PATH, CC unset; fix: `module load gcc` in "
        "the job's setup, or set CC)",
        f"no Python.h in {node / 'include'} (fix: install Python's development headers, "
        "python3-dev/python3-devel, or use a Python that has them)",
        "no libcuda.so.1 where triton looks (/sbin/ldconfig -p, LD_LIBRARY_PATH, "
        "TRITON_LIBCUDA_PATH; fix: set TRITON_LIBCUDA_PATH to the driver's folder)",
    ]
    assert find_toolchain({}).missing(cuda=False, c_compiler=False) == [missing[1]]


def test_cc_is_used_as_triton_uses_it(node: Path) -> None:
    assert find_toolchain({"CC": "gcc"}).c_compiler == "/usr/bin/gcc"
    missing = find_toolchain({"CC": "icx"}).missing(cuda=False)
    assert missing == ["no C compiler (CC=icx not found; fix: set CC to a compiler)"]


def test_libcuda_from_the_variable_the_cache_or_ld_library_path(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = str(node / "driver")
    assert find_toolchain({"TRITON_LIBCUDA_PATH": driver}).libcuda == driver
    assert find_toolchain({"TRITON_LIBCUDA_PATH": str(node)}).libcuda == ""  # not there
    monkeypatch.setattr(toolchain_module, "ldconfig_paths", lambda library: [])
    assert find_toolchain({"LD_LIBRARY_PATH": f"/nowhere:{driver}"}).libcuda == driver
    # no ldconfig at all (some containers): triton fails there unless the variable is set
    monkeypatch.setattr(toolchain_module, "ldconfig_paths", lambda library: None)
    assert find_toolchain({"LD_LIBRARY_PATH": driver}).libcuda == ""
    assert find_toolchain({"TRITON_LIBCUDA_PATH": driver}).libcuda == driver
