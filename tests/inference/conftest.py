"""A question-answering run shared by the answer and harness tests (trained once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config import load_config
from tests.support.answer_kit import qa_overrides, qa_shards


@pytest.fixture(scope="session")
def qa_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT trained 60 steps on `answer_kit`'s questions, evaluating (and answering 30
    validation prompts) every 20 steps, keeping the best checkpoint by val_exact_match:
    step-40 answers some, step-60 all. The shards are under RUN/../tokens."""
    from tests.train.test_trainer import build

    root = tmp_path_factory.mktemp("qa")
    tokens = qa_shards(root)
    overrides = qa_overrides(
        tokens,
        root / "run",
        "train.max_steps=60",
        "train.eval_every=20",
        "checkpoint.monitor=val_exact_match",
        "checkpoint.keep_best=1",
    )
    assert build(load_config(None, overrides)).fit() == 0
    return root / "run"
