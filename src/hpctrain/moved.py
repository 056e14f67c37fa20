"""Old module paths that still import, for one release, with a warning (the house move, #36).

hpctrain's `train/` package held five concerns until 0.2; they now live in packages of their
own (`tasks/`, `models/`, `parallel/`, `observe/`), and `dist/` became `distributed/`. User code
written against the old paths (a custom task subclassing
`hpctrain.train.tasks.image_classification.ImageClassification`, `hpctrain.train.task.Task` in a
type hint, a config naming `task: hpctrain.train.tasks.causal_lm:CausalLM`) keeps working: an
import of an old path returns the module at its new path (the same module object, so classes
compare equal and subclasses behave) and warns once per old path with a `MovedModuleWarning`,
naming the new one.

One finder in `sys.meta_path` does this for every moved module instead of a file per old path,
so the rooms of the house hold no empty shells; it answers only for the names below.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

# old dotted path (or package prefix) -> new one; a package maps its submodules too
MOVED = {
    "hpctrain.train.task": "hpctrain.tasks.task",
    "hpctrain.train.tasks": "hpctrain.tasks",
    "hpctrain.train.classes": "hpctrain.tasks.classes",
    "hpctrain.train.models": "hpctrain.models",
    "hpctrain.train.init_from": "hpctrain.models.init_from",
    "hpctrain.train.flops": "hpctrain.models.flops",
    "hpctrain.train.parallel": "hpctrain.parallel.parallelize",
    "hpctrain.train.precision": "hpctrain.parallel.precision",
    "hpctrain.train.comms": "hpctrain.parallel.comms",
    "hpctrain.train.memory": "hpctrain.observe.memory",
    "hpctrain.train.trackers": "hpctrain.observe.trackers",
    "hpctrain.train.metrics": "hpctrain.observe.metrics",
    "hpctrain.train.hangs": "hpctrain.observe.hangs",
    "hpctrain.train.profiling": "hpctrain.observe.profiling",
    "hpctrain.train.gpu_stats": "hpctrain.observe.gpu_stats",
    "hpctrain.train.plot": "hpctrain.observe.plot",
    "hpctrain.dist": "hpctrain.distributed",
    # what runs inside the allocation left launch/ (#50); rendered job scripts already in a
    # queue run `python -m hpctrain.launch.attempts|probe|watch` (get_code below)
    "hpctrain.launch.attempts": "hpctrain.resilience.attempts",
    "hpctrain.launch.restart_policy": "hpctrain.resilience.restart_policy",
    "hpctrain.launch.probe": "hpctrain.resilience.probe",
    "hpctrain.launch.watch": "hpctrain.resilience.watch",
    "hpctrain.launch.goodput": "hpctrain.resilience.goodput",
    "hpctrain.launch.goodput_report": "hpctrain.resilience.goodput_report",
    "hpctrain.launch.failure_rate": "hpctrain.resilience.failure_rate",
}
REMOVED_IN = "0.3"


class MovedModuleWarning(FutureWarning):
    """An import of a module path that moved (FutureWarning: shown to end users by default)."""


_warned: set[str] = set()


def new_name(old: str) -> str | None:
    """The module path `old` moved to, or None when it did not move."""
    if old in MOVED:
        return MOVED[old]
    for prefix, target in MOVED.items():
        if old.startswith(prefix + "."):
            return target + old[len(prefix) :]
    return None


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        assert new is not None
        if spec.name not in _warned:
            _warned.add(spec.name)
            warnings.warn(
                f"{spec.name} moved to {new}; the old path is removed in hpctrain "
                f"{REMOVED_IN}: import {new}",
                MovedModuleWarning,
                stacklevel=2,  # the import line: warnings skips importlib's own frames
            )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for `python -m OLD` (runpy runs it as `__main__`)."""
        new = new_name(fullname)
        spec = importlib.util.find_spec(new) if new else None
        loader = spec.loader if spec else None
        if new is None or not isinstance(loader, importlib.abc.InspectLoader):
            return None
        if fullname not in _warned:
            _warned.add(fullname)
            warnings.warn(
                f"python -m {fullname}: the module moved to {new}; the old path is removed in "
                f"hpctrain {REMOVED_IN}: run python -m {new}",
                MovedModuleWarning,
                stacklevel=2,
            )
        return loader.get_code(new)

    def is_package(self, fullname: str) -> bool:
        new = new_name(fullname)
        spec = importlib.util.find_spec(new) if new else None
        return bool(spec and spec.submodule_search_locations is not None)


def install() -> None:
    """Put the finder first in `sys.meta_path` (once): an old package folder left on disk
    with only `__pycache__` in it would otherwise import as an empty namespace package."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
