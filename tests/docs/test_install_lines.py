"""Each page starts with the line that installs what its commands need, from the clone.

`make demo` installs hpctrain and its dependencies into `.venv` (not on the PATH); the pages
type bare `hpctrain` and `python`, and some need optional extras (transformers and peft for
fine-tuning.md, a tokenizer library, ...). The README says how to get the venv on the PATH
before its first bare command; each page's first shell block is `pip install -e SPEC` with
extras that pyproject.toml defines and that hold every optional package the page's commands
import or need.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from tests.support.doc_blocks import shell_blocks

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
# Pages a user follows (not the generated reference, the architecture or the benchmark notes).
PAGES = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "docs").glob("*.md")
    if p.name not in ("architecture.md", "benchmark-log.md", "config-reference.md")
)
INSTALL = re.compile(r"^pip install -e (?:\.|'\.\[(?P<extras>[a-z,-]+)\]')\s")

# What a command or a Python line of a page needs, and the package that brings it.
NEEDS = {
    r"^\s*(import|from) transformers\b": "transformers",
    r"^\s*(import|from) peft\b": "peft",
    r"^\s*(import|from) safetensors\b|--format (hf|safetensors)\b": "safetensors",
    r"--tokenizer \S*\.json\b|^\s*(import|from) tokenizers\b": "tokenizers",
    r"--tokenizer \S*\.model\b|^\s*(import|from) sentencepiece\b": "sentencepiece",
    r"--tokenizer \S*\.tiktoken\b|^\s*(import|from) tiktoken\b": "tiktoken",
    r"^\s*(import|from) pyarrow\b|\.parquet\b": "pyarrow",
    r"--harness\b|^\s*(import|from) lm_eval\b": "lm-eval",
}


def extras() -> dict[str, set[str]]:
    """pyproject.toml's extras: name -> the package names they install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        name: {re.split(r"[<>=\[ ;]", spec, maxsplit=1)[0] for spec in specs}
        for name, specs in project["optional-dependencies"].items()
    }


@pytest.mark.parametrize("page", PAGES)
def test_every_page_starts_with_its_install_line(page: str) -> None:
    blocks = [b for b in shell_blocks(ROOT, [page]) if not b.transcript]
    assert blocks, f"{page}: no shell block"
    first = blocks[0].body.strip()
    match = INSTALL.match(first)
    assert match and "\n" not in first, f"{page}: starts with {first!r}, not its install line"
    named = [e for e in (match["extras"] or "").split(",") if e]
    defined = extras()
    assert set(named) <= set(defined), f"{page}: no such extra {set(named) - set(defined)}"
    installed = set().union(*(defined[e] for e in named)) if named else set()
    text = "\n".join(b.body for b in blocks[1:])
    needed = {pkg for pattern, pkg in NEEDS.items() if re.search(pattern, text, re.M)}
    assert needed <= installed, f"{page}: its commands need {needed - installed}, not installed"


def test_fine_tuning_s_extra_holds_what_its_page_imports() -> None:
    assert {"transformers", "peft", "safetensors"} <= extras()["hf"]


def test_the_readme_puts_the_venv_on_the_path_before_its_first_bare_command() -> None:
    blocks = [b for b in shell_blocks(ROOT, ["README.md"]) if not b.transcript]
    bare = re.compile(r"^(hpctrain|python3?) ", re.M)
    first = next(i for i, b in enumerate(blocks) if bare.search(b.body))
    activate = [i for i, b in enumerate(blocks) if "source .venv/bin/activate" in b.body]
    assert activate and activate[0] < first, "README: no `source .venv/bin/activate` before"
