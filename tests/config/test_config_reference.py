"""docs/config-reference.md lists every key with its default (regenerate with `make docs`)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from config_reference import PAGE, render  # noqa: E402


def test_config_reference_page_is_current() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/config-reference.md is stale: run make docs"
    )
