"""A pytest plugin that prints how long each test tier took (`tools/run-tests` loads it).

The tiers go by marker, the first that applies: `slurm` (the dev cluster), `docs` (the docs'
shell blocks), `multi-process` (`slow`, `distributed` or `network`: gloo ranks, loader
workers at length, loopback servers), else `unit`. `make test-fast` runs `unit` and the docs
blocks that do not train. One pytest run holds every tier, so the times are the sums of each
tier's test durations (setup, call and teardown) and collection is timed apart: separate runs
per tier would each pay the collection again (15-25 s here, importing torch and the suite).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest

TIERS = ("unit", "docs", "multi-process", "slurm")
MULTI_PROCESS = ("slow", "distributed", "network")
FAST = "not (slow or distributed or network or slurm)"  # `make test-fast`'s -m


def tier_of(markers: Iterable[str]) -> str:
    names = set(markers)
    if "slurm" in names:
        return "slurm"
    if "docs" in names:
        return "docs"
    if names & set(MULTI_PROCESS):
        return "multi-process"
    return "unit"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s" if seconds >= 60 else f"{seconds:.1f}s"


def summary(durations: dict[str, float], counts: dict[str, int], collect_s: float) -> list[str]:
    lines = [f"collection: {minutes(collect_s)}"]
    for tier in TIERS:
        if counts.get(tier):
            lines.append(f"{tier}: {counts[tier]} tests, {minutes(durations[tier])}")
    lines.append(f"total: {minutes(collect_s + sum(durations.values()))}")
    return lines


class TierTimes:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.collect_s = 0.0
        self.tier: dict[str, str] = {}
        self.durations = dict.fromkeys(TIERS, 0.0)
        self.counts = dict.fromkeys(TIERS, 0)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collect_s = time.monotonic() - self.start
        for item in session.items:
            self.tier[item.nodeid] = tier_of(m.name for m in item.iter_markers())

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = self.tier.get(report.nodeid, "unit")
        self.durations[tier] += report.duration
        if report.when == "setup":
            self.counts[tier] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        terminalreporter.section("time per tier")
        for line in summary(self.durations, self.counts, self.collect_s):
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TierTimes(), "hpctrain-tier-times")
