"""HSDP (`train.strategy=hsdp`): FSDP2 over a (replicate, shard) mesh, against flat FSDP2 and
DDP on 4 gloo ranks that pretend to be two nodes of two; checkpoints across meshes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.parallel.precision import DeviceFacts, plan_training
from tests.support.train_kit import REPO, run_ranks

WORKER = REPO / "tests" / "support" / "hsdp_worker.py"


@pytest.fixture(scope="module")
def trained(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hsdp")
    logs = run_ranks(
        WORKER, str(shapes_shards), str(out), "four", nprocs=4, per_node=2, timeout=600
    )
    (out / "four.log").write_text(logs[0])
    logs = run_ranks(WORKER, str(shapes_shards), str(out), "two", nprocs=2, timeout=300)
    (out / "two.log").write_text(logs[0])
    return out


def weights(out: Path, case: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{case}.pt", weights_only=True)


def records(out: Path, case: str) -> list[dict]:
    lines = (out / case / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def losses(out: Path, case: str) -> list[float]:
    return [r["loss"] for r in records(out, case)]


def assert_close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=f"{what}: {name}")


@pytest.mark.distributed
def test_hsdp_trains_like_flat_fsdp2_and_ddp(trained: Path) -> None:
    assert len(losses(trained, "hsdp")) == 4
    for other in ("fsdp", "ddp"):
        assert losses(trained, "hsdp") == pytest.approx(losses(trained, other), rel=1e-5)
        assert_close(weights(trained, "hsdp"), weights(trained, other), 1e-6, f"hsdp vs {other}")
    # shard_degree=0 took the 2 ranks of a node: the same mesh as shard_degree=2
    assert losses(trained, "hsdp-explicit") == losses(trained, "hsdp")[:2]


@pytest.mark.distributed
def test_export_of_an_hsdp_run_equals_flat_fsdp2s(trained: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    exported = {}
    for case in ("hsdp", "fsdp"):
        out = tmp_path / f"{case}.safetensors"
        subprocess.run(
            [sys.executable, "-m", "hpctrain", "export", str(trained / case), str(out)],
            check=True,
            capture_output=True,
        )
        exported[case] = load_file(out)
    assert_close(exported["hsdp"], exported["fsdp"], 1e-6, "export")


@pytest.mark.distributed
def test_hsdp_names_its_mesh_and_fsdp_across_nodes_suggests_it(trained: Path) -> None:
    assert records(trained, "hsdp")[0]["mesh"] == "replicate 2 x shard 2"
    assert records(trained, "fsdp")[0]["mesh"] == "shard 4"
    assert records(trained, "ddp")[0]["mesh"] == "replicate 4"
    assert "mesh" not in records(trained, "hsdp")[1]
    log = (trained / "four.log").read_text()
    assert "mesh: replicate 2 x shard 2 (train.strategy=hsdp)" in log
    assert "train.strategy=fsdp over 2 nodes" in log and "train.strategy=hsdp shards" in log


@pytest.mark.distributed
def test_hsdp_with_batchnorm_mixed_precision_accumulation_and_ema(trained: Path) -> None:
    assert losses(trained, "cnn-hsdp") == pytest.approx(losses(trained, "cnn-fsdp"), rel=1e-5)
    assert_close(weights(trained, "cnn-hsdp"), weights(trained, "cnn-fsdp"), 1e-6, "cnn")
    mixed = losses(trained, "mixed-hsdp")
    assert len(mixed) == 3 and all(map(torch.isfinite, torch.tensor(mixed)))
    # bf16 compute, fp32 reductions in another order: close, not equal
    assert mixed == pytest.approx(losses(trained, "mixed-fsdp"), rel=2e-2)


@pytest.mark.distributed
def test_hsdp_without_resharding_after_forward_and_with_checkpointing(trained: Path) -> None:
    assert losses(trained, "kept-hsdp") == pytest.approx(losses(trained, "kept-fsdp"), rel=1e-5)
    assert_close(weights(trained, "kept-hsdp"), weights(trained, "kept-fsdp"), 1e-6, "kept")
    assert losses(trained, "kept-hsdp") == pytest.approx(losses(trained, "hsdp")[:3], rel=1e-5)


@pytest.mark.distributed
def test_checkpoints_move_between_meshes(trained: Path) -> None:
    # same mesh: interrupted at step 2 == uninterrupted, bitwise
    assert losses(trained, "hsdp-resumed") == losses(trained, "hsdp")[2:]
    assert_close(weights(trained, "hsdp-resumed"), weights(trained, "hsdp"), 0, "resume")
    # DDP's checkpoint continues under HSDP
    assert losses(trained, "ddp-to-hsdp") == pytest.approx(losses(trained, "ddp")[2:], rel=1e-5)
    # HSDP 2 x 2 -> flat FSDP2 on 2 ranks, as FSDP2 on 4 -> FSDP2 on 2 does
    assert records(trained, "hsdp-to-fsdp")[0]["mesh"] == "shard 2"
    assert losses(trained, "hsdp-to-fsdp") == pytest.approx(
        losses(trained, "fsdp-to-fsdp"), rel=1e-5
    )


FACTS = DeviceFacts(type="cpu")


def plan(overrides: list[str], world: int, local: int = 0):
    return plan_training(load_config(None, overrides).train, FACTS, world, local)


def test_hsdp_mesh_from_the_node_or_the_key() -> None:
    assert plan(["train.strategy=hsdp"], 8, 4).mesh == (2, 4)
    assert plan(["train.strategy=hsdp", "train.shard_degree=2"], 8, 4).mesh == (4, 2)
    assert plan(["train.strategy=hsdp"], 8, 4).describe_mesh() == "replicate 2 x shard 4"
    assert plan(["train.strategy=fsdp"], 8, 4).mesh == (1, 8)
    assert plan(["train.strategy=hsdp"], 1).strategy == "none"
    assert plan(["train.strategy=hsdp"], 4, 2).precision.sharded


def test_bad_shard_degrees_are_one_line() -> None:
    with pytest.raises(
        ConfigError, match=r"train.shard_degree=3 does not divide the 8 data-parallel ranks"
    ):
        plan(["train.strategy=hsdp", "train.shard_degree=3"], 8, 4)
    with pytest.raises(ConfigError, match=r"shard_degree=3 \(the ranks of one node\) does not"):
        plan(["train.strategy=hsdp"], 8, 3)
    with pytest.raises(ConfigError, match=r"applies to train.strategy=hsdp only"):
        plan(["train.strategy=fsdp", "train.shard_degree=2"], 8, 4)
