"""Suite-wide rules: in CI (CI=true) a skipped test is a failure, except GPU tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Session fixtures shared by several test packages: defined once (see the module's docstring).
pytest_plugins = ("tests.support.shard_fixtures",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if (
        IN_CI
        and report.skipped
        and item.get_closest_marker("gpu") is None
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every non-GPU test must run: {reason}"


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    """In-process trainers switch on process-wide modes (deterministic algorithms)."""
    torch = sys.modules.get("torch")
    deterministic = torch.are_deterministic_algorithms_enabled() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.use_deterministic_algorithms(bool(deterministic))


@pytest.fixture(autouse=True)
def _release_run_locks_left_held() -> Iterator[None]:
    """Release the run locks a test left held (a CheckpointManager it did not close).

    A held lock's renewal thread would outlive its test and act during later ones: CI once saw
    it fail, and print a logging traceback, under another test's `seteuid(nobody)`.
    """
    lock = sys.modules.get("hpctrain.checkpoint.lock")
    before = set(lock._held) if lock is not None else set()
    yield
    lock = sys.modules.get("hpctrain.checkpoint.lock")
    for path in [] if lock is None else [p for p in list(lock._held) if p not in before]:
        held, _ = lock._held.pop(path)
        held.release()
