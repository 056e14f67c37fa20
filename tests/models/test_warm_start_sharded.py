"""A warm start from an hpctrain run folder into FSDP2, HSDP or FSDP2 x TP (2 gloo ranks):
each rank reads its own pieces of the checkpoint (never the whole model), on a model built
on the meta device when the checkpoint fills every tensor; a new head is built whole and
still read shard by shard. The weights (and the EMA) equal the source run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights
from hpctrain.config import Config, load_config
from hpctrain.distributed import DistEnv
from hpctrain.train.trainer import Trainer
from tests.models.test_hf_init_from import lm_overrides
from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import REPO, run_two_ranks, tiny_run_overrides


def fit(cfg: Config) -> None:
    trainer = Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    assert trainer.fit() == 0


@pytest.mark.distributed
def test_warm_starts_read_each_ranks_shards(tmp_path: Path, shapes_shards: Path) -> None:
    write_token_shards(tmp_path / "lm-shards", 1, seed=1)
    (tmp_path / "cnn-shards").symlink_to(shapes_shards)
    lm, cnn = tmp_path / "lm-source", tmp_path / "cnn-source"
    lm_run = lm_overrides(
        tmp_path / "lm-shards", lm, "train.max_steps=2", "train.lr=0.01", "train.ema_decay=0.5"
    )
    fit(load_config(None, lm_run))
    cnn_run = tiny_run_overrides(
        shapes_shards,
        cnn,
        "train.max_steps=2",
        "checkpoint.every_steps=2",
        "data.workers_per_rank=0",
    )
    fit(load_config(str(REPO / "configs" / "demo.yaml"), cnn_run))
    expected = {}
    for name, run, ema in (
        ("lm-model", lm, False),
        ("lm-ema", lm, True),
        ("cnn-model", cnn, False),
    ):
        store, step, manifest = locate_checkpoint(str(run))
        expected[name] = read_model_weights(store, step, manifest, ema=ema)
    torch.save(expected, tmp_path / "expected.pt")
    worker = REPO / "tests" / "support" / "warm_start_worker.py"
    outputs = run_two_ranks(worker, str(tmp_path), timeout=400)
    assert all("equal" in output for output in outputs), outputs
