"""The docs' shell blocks, run as a user would run them (the `docs` tier; see doc_blocks.py).

Each document gets one scratch folder holding what a fresh clone holds and nothing else: the
repo's `configs/` and `examples/` (copies, with step caps written into the configs the docs
train) and `tools/` (a link). No data, no tokenizer, no model: a page makes everything its
commands use (or says in a skipped line how to get it), so a newcomer who copies its blocks
into a clone gets what the test got. Its blocks run there in document order, so a block sees
what the blocks above it made (convert, then train, then export). A block that exits non-zero
fails; a transcript fails when its output no longer matches the shown one after masking
times, dates, absolute paths and numbers. A line that cannot run here (a cluster, S3, the
network) still parses: `tests/support/doc_parse.py` checks its words, its config and its job.

Blocks with nothing to run or parse (`make demo`, a download) are no test items, so CI's "a
skip is a failure" rule does not apply to them: `python -m tests.support.doc_blocks` lists
them with the reason, and `test_every_skip_says_why` keeps the reasons to the known needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.doc_blocks import Block, matches, shell_blocks, untagged_shell

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
BLOCKS = shell_blocks(ROOT, DOCS)
NEEDS = ("slurm", "gpu", "s3", "network", "site", "long", "install")
BLOCK_TIMEOUT_S = 300

# Step caps written into the scratch copies of the configs the docs train (key paths -> value).
STEP_CAPS = {
    "configs/demo.yaml": {
        "train.max_epochs": 0,
        "train.max_steps": 4,
        "train.eval_every": 2,
        "train.log_every": 2,
        "checkpoint.every_steps": 2,
    },
    "examples/segmentation/config.yaml": {
        "train.max_epochs": 0,
        "train.max_steps": 2,
        "train.eval_every": 2,
        "train.log_every": 1,
        "checkpoint.every_steps": 2,
    },
}


def _cap(path: Path, caps: dict[str, object]) -> None:
    cfg = yaml.safe_load(path.read_text())
    for dotted, value in caps.items():
        *parents, key = dotted.split(".")
        node = cfg
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MPLBACKEND"] = "Agg"
    env.pop("CI", None)  # the commands are a user's, not the suite's
    return env


def _scratch(base: Path) -> Path:
    """What a fresh clone holds: configs/ and examples/ (step-capped copies), tools/."""
    for name in ("configs", "examples"):
        shutil.copytree(ROOT / name, base / name)
    for name, caps in STEP_CAPS.items():
        _cap(base / name, caps)
    (base / "tools").symlink_to(ROOT / "tools")
    return base


@pytest.fixture(scope="module")
def scratches() -> dict[str, Path]:
    """One scratch folder per document, made when its first block runs."""
    return {}


def _scratch_for(doc: str, scratches: dict[str, Path], factory: pytest.TempPathFactory) -> Path:
    if doc not in scratches:
        scratches[doc] = _scratch(factory.mktemp(re.sub(r"\W", "_", doc)))
    return scratches[doc]


PARSE = ROOT / "tests" / "support" / "doc_parse.py"


def shell_lines(block: Block) -> list[str]:
    """The block's commands as bash runs them: a skipped hpctrain line parses instead."""
    lines = []
    for c in block.commands:
        if not c.skip:
            lines.append(c.text)
        elif c.parse_words:
            lines.append(f'"{sys.executable}" "{PARSE}" {c.parse_words}')
    return lines


def _run_shell(block: Block, cwd: Path) -> None:
    lines = ["set -eo pipefail",
             "trap 'echo \"docs-test: this command failed: $BASH_COMMAND\" >&2' ERR"]  # fmt: skip
    lines += shell_lines(block)
    done = subprocess.run(
        ["bash", "-c", "\n".join(lines)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
    )  # fmt: skip
    skipped = "".join(f"  line {c.line} {'parsed, ' if c.parse_words else ''}not run "
                      f"({c.skip}): {c.text}\n" for c in block.commands if c.skip)  # fmt: skip
    if skipped:
        print(f"{block.id}: lines not run:\n{skipped}")
    assert done.returncode == 0, (
        f"{block.id}: the block failed (exit {done.returncode}) in {cwd}\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )


def _run_transcript(block: Block, cwd: Path) -> None:
    for command in block.commands:
        if command.skip:
            continue
        done = subprocess.run(
            ["bash", "-c", command.text + " 2>&1"],
            cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
        assert matches(command.expected, done.stdout), (
            f"{block.doc}:{command.line}: `{command.text}` shows\n{command.expected}\n"
            f"--- but prints (exit {done.returncode})\n{done.stdout}"
        )


RUN = [b for b in BLOCKS if not b.skip]


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else []) for b in RUN]
)
def test_block(
    block: Block, scratches: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    cwd = _scratch_for(block.doc, scratches, tmp_path_factory)
    if block.transcript:
        _run_transcript(block, cwd)
    else:
        _run_shell(block, cwd)


# What pages share on purpose: `make demo`'s images, shards and run, made by the same commands
# (a page's convert of them after `make demo` has nothing to do; its train resumes a complete
# run and trains nothing). Any other file written by two pages is a collision.
SHARED = ("data/demo/images/", "data/demo/shards/", "runs/demo/")
CLONE = ("configs", "examples", "tools")


def written(scratch: Path) -> set[str]:
    """The files a page's blocks wrote into its scratch, relative to it."""
    found = set()
    for root, dirs, files in os.walk(scratch):
        rel = Path(root).relative_to(scratch)
        if rel.parts[:1] and rel.parts[0] in CLONE:
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found |= {str(rel / name) for name in files}
    return found


def test_pages_run_one_after_another_in_one_clone(scratches: dict[str, Path]) -> None:
    """Every page runs after every other in one clone (#49): no two pages write the same file
    (fine-tuning.md's convert into make demo's `data/demo/shards` was refused; inference.md's
    `qa.jsonl`, `data/qa` and `runs/qa` were fine-tuning.md's, and its train resumed that run),
    and make demo's shards, which pages share, are made by one command.

    Checked on the files each page wrote in its own scratch folder above (after the blocks
    that ran: all of them in `make test`): a second run of every block in one shared folder
    would find the same collisions at the cost of the whole tier again (#49: 648 s more on
    the development machine, under load; CI is near its time budget).
    """
    owners: dict[str, list[str]] = {}
    for doc, scratch in scratches.items():
        for name in written(scratch):
            owners.setdefault(name, []).append(doc)
    clashes = {
        name: docs for name, docs in owners.items() if len(docs) > 1 and not name.startswith(SHARED)
    }
    assert not clashes, "pages write the same files: " + "; ".join(
        f"{name} ({', '.join(docs)})" for name, docs in sorted(clashes.items())[:20]
    )
    commands = {
        doc: json.loads(index.read_text()).get("command")
        for doc, scratch in scratches.items()
        if (index := scratch / "data" / "demo" / "shards" / "train" / "index.json").exists()
    }
    assert len(set(commands.values())) <= 1, f"make demo's shards made differently: {commands}"


def test_every_skip_says_why() -> None:
    """A block or line that is not run names a need this machine lacks."""
    reasons = [(b.id, b.skip) for b in BLOCKS if b.skip]
    reasons += [(f"{b.doc}:{c.line}", c.skip) for b in BLOCKS for c in b.commands if c.skip]
    bad = [(where, why) for where, why in reasons if why.split(":")[0] not in NEEDS]
    assert not bad, f"skips must start with one of {NEEDS}: {bad}"
    assert len(RUN) >= 8, f"only {len(RUN)} blocks run: the docs tier would test little"


def test_shell_blocks_are_tagged() -> None:
    """A bare fence that opens with a command says bash or console, so this tier runs it."""
    assert untagged_shell(ROOT, DOCS) == []


def test_every_help_shows_an_example() -> None:
    """README.md: `hpctrain VERB --help` for every verb shows examples."""
    import importlib

    from hpctrain.cli.main import VERBS

    epilogs = {v: importlib.import_module(f"hpctrain.cli.{v}").EPILOG for v in VERBS}
    lacking = [verb for verb, epilog in epilogs.items() if "example" not in epilog]
    assert not lacking, f"--help without an example: {lacking}"
