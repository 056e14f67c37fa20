"""`hpctrain.train.dry_run.check_startup`: the Trainer's own checks, on the CPU, for a GPU and
a world size that are not here (the dry runs of `tools/gpu_bench.sh` and `hpctrain bench`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config import ConfigError, load_config
from hpctrain.train.dry_run import check_startup, pretend_gpu
from tests.support.train_kit import REPO, tiny_run_overrides


def demo(shards: Path, run_dir: Path, *overrides: str):
    return load_config(
        str(REPO / "configs" / "demo.yaml"), tiny_run_overrides(shards, run_dir, *overrides)
    )


def test_a_config_that_loads_but_would_not_start_is_refused(
    shapes_shards: Path, tmp_path: Path
) -> None:
    # issue #44: the demo config ranks checkpoints by val_accuracy; no evaluation data
    cfg = demo(shapes_shards, tmp_path / "run", "data.val=")
    with pytest.raises(ConfigError, match="checkpoint.monitor=val_accuracy: needs data.val"):
        check_startup(cfg, pretend_gpu())
    v100 = pretend_gpu("Tesla V100", capability=70)
    bf16 = demo(shapes_shards, tmp_path / "run", "train.precision=bf16")
    with pytest.raises(ConfigError, match=r"(compute capability 7.0)"):
        check_startup(bf16, v100)
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_run_is_planned_for_the_world_it_will_have(shapes_shards: Path, tmp_path: Path) -> None:
    cfg = demo(shapes_shards, tmp_path / "run", "train.strategy=fsdp", "train.max_steps=0")
    one = check_startup(cfg, pretend_gpu(), world_size=1)
    four = check_startup(cfg, pretend_gpu(), world_size=4, local_world_size=4)
    assert (one.strategy, one.mesh, one.precision) == ("none", "single process", "bf16")
    assert (four.strategy, four.mesh) == ("fsdp", "shard 4")
    assert four.steps_per_epoch < one.steps_per_epoch  # the epoch split over 4 ranks
    assert four.total_steps == 10 * four.steps_per_epoch  # the demo's train.max_epochs
    assert four.num_parameters == one.num_parameters > 0
    assert not (tmp_path / "run").exists()
