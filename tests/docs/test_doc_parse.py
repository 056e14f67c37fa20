"""The docs tier's own parts, in the unit tier: which lines parse instead of running, and that
`tests/support/doc_parse.py` refuses what `hpctrain` would refuse (so a parsed line can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config import ConfigError
from hpctrain.launch.profiles import LaunchError
from tests.support.doc_blocks import shell_blocks
from tests.support.doc_parse import check

ROOT = Path(__file__).resolve().parents[2]
FINETUNE = str(ROOT / "configs" / "finetune-lm.yaml")

PAGE = """# A page

```bash
hpctrain train configs/demo.yaml
```

<!-- docs-test: skip site: needs a downloaded model folder -->
```bash
hf download org/model --local-dir $WORK/model
.venv-x/bin/hpctrain preflight configs/demo.yaml --profile jean-zay-h100
pip install -e .
```

<!-- docs-test: skip network: downloads -->
```bash
hf download org/model --local-dir $WORK/model
```

```bash
hpctrain submit configs/demo.yaml --profile jean-zay-h100   # submits
hpctrain convert a b
```
"""


def test_skipped_hpctrain_lines_parse_and_other_skipped_lines_do_not_run(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(PAGE)
    trains, site, download, mixed = shell_blocks(tmp_path, ["page.md"])
    assert trains.slow and not trains.skip
    # a skipped block with an hpctrain line is a test item that only parses that line
    assert not site.skip and site.parse_only and site.after_slow and site.slow
    assert [c.parse_words for c in site.commands] == [
        "",
        "preflight configs/demo.yaml --profile jean-zay-h100",
        "",
    ]
    assert all(c.skip.startswith("site: ") for c in site.commands)
    # nothing to run or parse: no test item, the reason kept
    assert download.skip == "network: downloads"
    # a line skipped by LINE_SKIPS parses; the block's other lines run
    submit, convert = mixed.commands
    assert submit.skip.startswith("slurm:") and submit.parse_words.startswith("submit ")
    assert not convert.skip and not convert.parse_words and not mixed.parse_only


def test_a_documented_slurm_command_is_checked_up_to_its_job() -> None:
    said = check(["submit", FINETUNE, "--profile", "jean-zay-h100", "slurm.account=abc@h100",
                  "slurm.nodes=2", "model.init_from=/models/llama"])  # fmt: skip
    assert said.startswith("hpctrain submit: the command line parses; ")
    assert "is a valid config" in said and "the job resolves on jean-zay-h100 (2 node(s)" in said
    # a run folder is made by a run, not here: its flags are what can be checked
    said = check(["eval", "runs/qa", "--checkpoint", "best", "--harness", "x"])
    assert said == "hpctrain eval: the command line parses"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["train", "task=causal_lm", "model.init_from=/m"], SystemExit),  # no config file
        (["convert", "a", "b", "--no-such-flag"], SystemExit),
        (["train", FINETUNE, "train.no_such_key=1"], ConfigError),
        (["train", FINETUNE, "model.lora.base_dtype=bf16"], ConfigError),  # rank 0: LoRA off
        (["submit", FINETUNE, "--profile", "jean-zay-v100", "model.init_from=/m"], LaunchError),
        (["train", "missing.yaml"], ConfigError),  # a config the page never made
    ],
)
def test_what_hpctrain_refuses_fails_the_parse(argv: list[str], error: type) -> None:
    with pytest.raises(error):
        check(argv)


def unclosed_fences(text: str) -> list[str]:
    """Code fences of a Markdown page that do not close where they should: a fence with an
    info string (```bash) met inside an open block, or a block open at the end."""
    problems, opened = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("```"):
            continue
        if not opened:
            opened = number
        elif line.strip() == "```":
            opened = 0
        else:
            problems.append(f"line {number}: {line.strip()} inside the block opened at {opened}")
    return problems + ([f"the block opened at line {opened} never closes"] if opened else [])


def test_every_page_closes_its_code_blocks() -> None:
    """A merge that cut a block's closing fence ran the prose after it as shell commands."""
    assert unclosed_fences("```bash\nls\n### Next\n```text\nx\n```\n") == [
        "line 4: ```text inside the block opened at 1"
    ]
    assert unclosed_fences("```bash\nls\n```\n\n```\nx\n") == [
        "the block opened at line 5 never closes"
    ]
    pages = [*sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*.md"))]
    found = {p.name: unclosed_fences(p.read_text()) for p in pages}
    assert not {name: problems for name, problems in found.items() if problems}
