"""Rewrite the config reference between the README's markers (run after changing the schema)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_reference import render

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def updated(text: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _: f"{START}\n{render()}{END}", text)


if __name__ == "__main__":
    README.write_text(updated(README.read_text()))
