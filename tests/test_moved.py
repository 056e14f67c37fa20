"""Old module paths (before the house move of #36) still import, warn once, and give the
same objects as the new paths: user code and configs written against them keep working."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpctrain import moved

REPO = Path(__file__).resolve().parents[1]


def test_every_old_path_names_a_module_that_exists() -> None:
    import importlib.util

    for old, new in moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)
        assert moved.new_name(old) == new
    assert moved.new_name("hpctrain.train.tasks.causal_lm") == "hpctrain.tasks.causal_lm"
    assert moved.new_name("hpctrain.train.trainer") is None  # the loop stayed
    assert moved.new_name("hpctrain.distributed") is None


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: each old path warns on its first import in a process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_a_custom_task_written_against_the_old_paths_imports_and_warns_once() -> None:
    done = run_python(
        """
        from hpctrain.train.task import Task
        from hpctrain.train.tasks.image_classification import ImageClassification
        from hpctrain.train.task import Sample  # a second import: no second warning
        import hpctrain.tasks.task, hpctrain.tasks.image_classification as ic
        from hpctrain.dist import DistEnv
        import hpctrain.distributed

        class MyTask(ImageClassification):
            pass

        assert Task is hpctrain.tasks.task.Task
        assert issubclass(MyTask, ic.ImageClassification)
        assert DistEnv is hpctrain.distributed.DistEnv
        print("ok")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    warnings = [line for line in done.stderr.splitlines() if "MovedModuleWarning" in line]
    assert len(warnings) == 4, done.stderr  # train.task, train.tasks, .image_classification, dist
    assert any(
        "hpctrain.train.task moved to hpctrain.tasks.task" in line
        and "removed in hpctrain 0.3" in line
        for line in warnings
    ), warnings
    assert (
        "<string>:2: MovedModuleWarning" in done.stderr
    )  # the warning points at the user's import line


def test_a_config_naming_an_old_task_path_loads_that_task() -> None:
    from hpctrain.config import load_config
    from hpctrain.data.index import ShardIndex, ShardInfo
    from hpctrain.tasks.image_classification import ImageClassification
    from hpctrain.tasks.task import load_task

    for name in ("hpctrain.train.tasks", "hpctrain.train.tasks.image_classification"):
        sys.modules.pop(name, None)
        moved._warned.discard(name)
    with pytest.warns(moved.MovedModuleWarning, match="moved to hpctrain.tasks"):
        old = "hpctrain.train.tasks.image_classification:ImageClassification"
        cfg = load_config(None, [f"task={old}", "model.image_size=16"])
        task = load_task(cfg, ShardIndex(shards=(ShardInfo("a.tar", 10),), class_names=("a", "b")))
    assert isinstance(task, ImageClassification)


def test_a_queued_job_scripts_old_module_names_still_run(tmp_path: Path) -> None:
    """Job scripts rendered before the move of #50 call `python -m hpctrain.launch.attempts`,
    `.probe` and `.watch`; they run the modules' code now under `resilience/`."""
    for old in ("hpctrain.launch.attempts", "hpctrain.launch.probe", "hpctrain.launch.watch"):
        done = subprocess.run(
            [sys.executable, "-m", old, "--help"],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        # --help exits 0 (argparse) or the watcher's usage line exits 2: the module ran
        assert done.returncode in (0, 2), (old, done.stderr)
        assert "usage:" in done.stdout + done.stderr, (old, done.stderr)
        assert "No code object" not in done.stderr and "No module named" not in done.stderr
        new = old.replace(".launch.", ".resilience.")
        assert f"run python -m {new}" in done.stderr, done.stderr  # one warning naming the new
    from hpctrain.resilience import attempts

    with pytest.warns(moved.MovedModuleWarning):
        import hpctrain.launch.attempts as old_attempts
    assert old_attempts is attempts
