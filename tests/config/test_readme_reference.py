"""The README's config reference lists every key with its default (regenerate with
`python tools/update_readme_reference.py`)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from update_readme_reference import README, updated  # noqa: E402


def test_readme_reference_is_current() -> None:
    text = README.read_text()
    assert updated(text) == text, (
        "README config reference is stale: run python tools/update_readme_reference.py"
    )
