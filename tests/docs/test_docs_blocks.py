"""The docs' shell blocks, run as a user would run them (the `docs` tier; see blocks.py).

Each document gets one scratch folder, a copy of one made once: the repo's `configs/` and
`examples/` with step caps, `tools/` and `slurm/` linked, the demo's data made smaller (300
generated images instead of 3,000, converted as `make demo` does) and the files the
language-model examples name (`corpus/`, `docs.jsonl`, `lines.txt`, `tokenizer.json`). A page
that reads a trained run trains it in a block of its own first. Its blocks then run
there in document order, so a block sees what the blocks above it made (convert, then train,
then export). A block that exits non-zero fails; a transcript fails when its output no longer
matches the shown one after masking times, dates, absolute paths and numbers.

Blocks skipped as a whole (a SLURM cluster, S3, the network, a site's modules, a long run)
are no test items, so CI's "a skip is a failure" rule does not apply to them:
`python -m tests.support.doc_blocks` lists them with the reason, and
`test_every_skip_says_why` keeps the reasons to the known needs.
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
NEEDS = ("slurm", "gpu", "s3", "network", "site", "long")
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


def _run(cmd: list[str], cwd: Path, timeout: float = BLOCK_TIMEOUT_S) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done.stdout


def _tokenizer_json(path: Path) -> None:
    """A tiny word-level tokenizer.json with an end-of-text token, as a user would save one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "def", "return", "import", "class", "self", "the", "a"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])  # the end of a document must be a special token
    tok.save(str(path))


def _scratch(base: Path) -> Path:
    for name in ("configs", "examples"):
        shutil.copytree(ROOT / name, base / name)
    for name, caps in STEP_CAPS.items():
        _cap(base / name, caps)
    for name in ("tools", "slurm"):
        (base / name).symlink_to(ROOT / name)
    py = sys.executable
    _run([py, "tools/make_demo_data.py", "data/demo/images", "--num-images", "300",
          "--size", "64", "--seed", "0"], base)  # fmt: skip
    _run(["hpctrain", "convert", "data/demo/images", "data/demo/shards", "--val-fraction", "0.1",
          "--samples-per-shard", "64", "--shuffle", "--seed", "0"], base)  # fmt: skip
    _run([py, "tools/stdlib_corpus.py", "--max-files", "100", "corpus"], base)
    rows = [{"content": f"def f{i}(self): return the {i}"} for i in range(20)]
    (base / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (base / "lines.txt").write_text("".join(f"import a{i}\n\nclass b{i}\n" for i in range(50)))
    _tokenizer_json(base / "tokenizer.json")
    return base


@pytest.fixture(scope="module")
def scratches() -> dict[str, Path]:
    """One scratch folder per document, made when its first block runs."""
    return {}


TEMPLATE = ""  # the key of the scratch made once and copied for each document


def _scratch_for(doc: str, scratches: dict[str, Path], factory: pytest.TempPathFactory) -> Path:
    if TEMPLATE not in scratches:  # generating and converting costs seconds; a copy does not
        scratches[TEMPLATE] = _scratch(factory.mktemp("template"))
    if doc not in scratches:
        folder = factory.mktemp(re.sub(r"\W", "_", doc))
        shutil.copytree(scratches[TEMPLATE], folder, symlinks=True, dirs_exist_ok=True)
        scratches[doc] = folder
    return scratches[doc]


def _run_shell(block: Block, cwd: Path) -> None:
    lines = ["set -eo pipefail",
             "trap 'echo \"docs-test: this command failed: $BASH_COMMAND\" >&2' ERR"]  # fmt: skip
    lines += [c.text for c in block.commands if not c.skip]
    done = subprocess.run(
        ["bash", "-c", "\n".join(lines)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
    )  # fmt: skip
    skipped = "".join(f"  line {c.line} not run ({c.skip}): {c.text}\n"
                      for c in block.commands if c.skip)  # fmt: skip
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
