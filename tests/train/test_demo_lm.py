"""`make demo-lm`'s pieces end to end at a tiny scale: three stdlib modules copied by
tools/stdlib_corpus.py → `hpctrain convert --tokenizer bytes` → 3 steps of configs/demo-lm.yaml
→ tools/lm_report.py (bits per byte against the unigram baseline) → `hpctrain plot` →
`hpctrain generate`.

Every piece runs in this process (one torch import for all); the demo's full length and its
figures are in docs/benchmark-log.md.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hpctrain.cli.main import main
from tests.support.train_kit import REPO


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def _keep_logging() -> Iterator[None]:
    """`hpctrain train` configures the root logger for its process; give pytest's back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_stdlib_corpus_is_the_top_level_modules(tmp_path: Path) -> None:
    corpus = load_tool("stdlib_corpus")
    modules = corpus.stdlib_modules()
    names = [p.name for p in modules]
    assert names == sorted(names) and len(names) > 100
    assert "os.py" in names and all(p.parent == modules[0].parent for p in modules)
    copies = corpus.copy_corpus(tmp_path / "text", max_files=2)
    assert [p.read_bytes() for p in copies] == [p.read_bytes() for p in modules[:2]]
    sources = (tmp_path / "text" / "SOURCES.txt").read_text().splitlines()
    assert sources[0].startswith("Python 3.") and sources[1:] == names[:2]


@pytest.mark.usefixtures("_keep_logging")
def test_demo_lm_pieces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load_tool("stdlib_corpus").copy_corpus(tmp_path / "text", max_files=3)
    shards, run_dir = tmp_path / "shards", tmp_path / "run"
    assert (
        main(
            [
                *("convert", str(tmp_path / "text"), str(shards)),
                *("--tokenizer", "bytes", "--text-glob", "*.py", "--val-fraction", "0.34"),
                *("--seed", "0", "--samples-per-shard", "1", "--progress", "plain"),
            ]
        )
        == 0
    )
    index = json.loads((shards / "train" / "index.json").read_text())
    assert index["tokenizer"]["name"] == "bytes" and index["num_tokens"] > 1000
    assert (
        main(
            [
                *("train", str(REPO / "configs" / "demo-lm.yaml"), f"run_dir={run_dir}"),
                f"data.train={shards / 'train' / 'index.json'}",
                f"data.val={shards / 'val' / 'index.json'}",
                *("data.seq_len=32", "data.batch_size=4", "data.workers_per_rank=0"),
                *("train.max_steps=3", "train.log_every=1", "checkpoint.every_steps=0"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bits_per_byte" in out and "step 3/3 epoch " in out and " tokens/s " in out

    assert main(["plot", str(run_dir)]) == 0  # as `make demo-lm` does (#43 item 14)
    assert "bits_per_byte.png" in capsys.readouterr().out
    assert (run_dir / "bits_per_byte.png").stat().st_size > 1000

    text, beaten = load_tool("lm_report").report(run_dir)
    lines = text.splitlines()
    assert lines[0].startswith("validation: ") and " bits per byte at step 3" in lines[0]
    assert lines[1].startswith("unigram baseline: training split entropy ")
    entropy = float(lines[1].split("entropy ")[1].split()[0])
    assert 3.5 < entropy < 6.0  # Python source, byte by byte
    assert lines[2].startswith("model / unigram baseline = ")
    assert beaten == (" (below the baseline)" in lines[2])

    assert main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.startswith("def ")
