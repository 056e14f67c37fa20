"""`hpctrain.files.write_atomic`: whole or nothing, locally and on an fsspec URL."""

from __future__ import annotations

import os
import subprocess
import sys

import fsspec
import pytest

from hpctrain.errors import UsageError
from hpctrain.files import write_atomic


@pytest.mark.parametrize("durable", [True, False])
def test_write_atomic_replaces_whole_and_leaves_no_temp(tmp_path, durable):
    target = tmp_path / "sub" / "f.json"
    write_atomic(target, b"old", durable=durable)
    write_atomic(str(target), lambda f: f.write(b"new"), durable=durable)
    assert target.read_bytes() == b"new"
    assert os.listdir(target.parent) == ["f.json"]


def test_a_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def broken(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError, match=r"f\.bin: cannot write the export: No space left"):
        write_atomic(target, broken, what="the export")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]
    with pytest.raises(OSError):
        write_atomic(target, broken)


def test_a_folder_in_the_way_is_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match="out: cannot write the record"):
        write_atomic(tmp_path / "out", b"x", what="the record")


def test_write_atomic_on_a_remote_url():
    write_atomic("memory://bucket/a/b.txt", b"hello")
    write_atomic("memory://bucket/a/c.txt", lambda f: f.write(b"world"))
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/bucket/a/b.txt") == b"hello"
    assert fs.cat_file("/bucket/a/c.txt") == b"world"


def test_the_job_scripts_steps_import_no_fsspec_for_a_local_run_folder() -> None:
    """`python -m hpctrain.resilience.attempts` runs two or three times between two
    trainings; fsspec's import was ~40 % of its own (writes to a path need none of it)."""
    code = "import sys, hpctrain.resilience.attempts, hpctrain.resilience.watch; print(sorted(m for m in sys.modules if m.startswith('fsspec')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == "[]", out
