"""tests/support/tiers.py: which tier a test's markers put it in, and the lines `make test` prints."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.tiers import FAST, summary, tier_of

ROOT = Path(__file__).resolve().parents[1]


def test_tier_of_takes_the_first_tier_that_applies() -> None:
    assert tier_of([]) == "unit"
    assert tier_of(["gpu"]) == "unit"
    assert tier_of(["docs"]) == "docs"
    assert tier_of(["docs", "slow"]) == "docs"
    assert tier_of(["network"]) == "multi-process"
    assert tier_of(["distributed", "slow"]) == "multi-process"
    assert tier_of(["slurm", "slow"]) == "slurm"


def test_summary_lists_the_tiers_that_ran_and_the_total() -> None:
    lines = summary({"unit": 61.5, "docs": 0.0, "multi-process": 2.0, "slurm": 0.0},
                    {"unit": 800, "multi-process": 3}, collect_s=12.0)  # fmt: skip
    assert lines == [
        "collection: 12.0s",
        "unit: 800 tests, 1m01.5s",
        "multi-process: 3 tests, 2.0s",
        "total: 1m15.5s",
    ]


def test_make_test_fast_selects_what_the_plugin_calls_unit_and_quick_docs() -> None:
    """The Makefile's fast tier and the plugin agree on which markers are not fast."""
    run_tests = (ROOT / "tools" / "run-tests").read_text()
    assert f'fast_tier="{FAST}"' in run_tests
    assert re.search(r"^test-fast:", (ROOT / "Makefile").read_text(), re.M)


FAST_WHAT = "the unit tier and the docs blocks that do not train"  # the Makefile's words


def test_every_page_says_what_make_test_fast_runs_as_the_makefile_does() -> None:
    """README, CONTRIBUTING and docs/testing.md describe `make test-fast` in the Makefile's
    words (the README once said "the unit tier only"), and no page quotes test counts, which
    go stale with every test added: `make test` and `make test-fast` print them each run."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^# {FAST_WHAT.capitalize()}:.*\ntest-fast:", makefile, re.M)
    for page in ("README.md", "CONTRIBUTING.md", "docs/testing.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert FAST_WHAT in text.replace("The unit", "the unit"), page
        assert "unit tier only" not in text, page
        assert not re.search(r"\b\d[\d,]* (tests|passed)\b", text), page
