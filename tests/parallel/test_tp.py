"""Tensor parallelism (`train.tp_degree`) of the causal_lm GPT, with FSDP2 and HSDP on the
data-parallel ranks: gloo on CPU, 2 and 4 processes (`tp_worker.py`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.parallel.precision import DeviceFacts, plan_training
from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import REPO, run_ranks

WORKER = REPO / "tests" / "support" / "tp_worker.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shards = tmp_path_factory.mktemp("tp-shards")
    write_token_shards(shards / "train", 4, seed=1)
    write_token_shards(shards / "val", 1, seed=2)
    out = tmp_path_factory.mktemp("tp")
    run_ranks(WORKER, str(shards), str(out), "two", nprocs=2, timeout=300)
    logs = run_ranks(WORKER, str(shards), str(out), "four", nprocs=4, per_node=2, timeout=600)
    (out / "four.log").write_text(logs[0])
    run_ranks(WORKER, str(shards), str(out), "one", nprocs=1, timeout=300)
    return out


def records(out: Path, case: str, kind: str = "train") -> list[dict]:
    lines = (out / case / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == kind]


def losses(out: Path, case: str) -> list[float]:
    return [r["loss"] for r in records(out, case)]


def weights(out: Path, case: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{case}.pt", weights_only=True)


@pytest.mark.distributed
def test_a_split_gpt_computes_the_whole_ones_logits(trained: Path) -> None:
    assert (trained / "split-logits.ok").exists()


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("tp", "flat"),
    [("fsdp-tp", "fsdp"), ("fsdp-tp-tied", "fsdp-tied"), ("hsdp-tp", "fsdp")],
)
def test_fsdp2_and_hsdp_with_tp_train_like_flat_fsdp2(trained: Path, tp: str, flat: str) -> None:
    assert len(losses(trained, tp)) == 4
    assert losses(trained, tp) == pytest.approx(losses(trained, flat), rel=1e-3)
    a, b = weights(trained, tp), weights(trained, flat)
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-3, msg=name)
    # the evaluation counts each sequence once, not once per TP rank
    assert (
        records(trained, tp, "eval")[-1]["val_samples"]
        == records(trained, flat, "eval")[-1]["val_samples"]
    )
    assert records(trained, tp, "eval")[-1]["val_loss"] == pytest.approx(
        records(trained, flat, "eval")[-1]["val_loss"], rel=1e-3
    )


@pytest.mark.distributed
def test_tp_with_bf16_accumulation_clipping_and_ema(trained: Path) -> None:
    mixed = losses(trained, "fsdp-tp-mixed")
    assert len(mixed) == 3 and all(map(math.isfinite, mixed))
    # bf16 compute, fp32 reductions in another order: close to flat FSDP2's, not equal
    assert mixed == pytest.approx(losses(trained, "fsdp-mixed"), rel=2e-2)
    assert records(trained, "fsdp-tp-mixed", "eval")[-1]["weights"] == "ema"


@pytest.mark.distributed
def test_a_tp_group_reads_one_batch_and_logs_it_once(trained: Path) -> None:
    assert records(trained, "fsdp-tp")[0]["mesh"] == "shard 2 x tp 2"
    assert records(trained, "hsdp-tp")[0]["mesh"] == "replicate 2 x shard 1 x tp 2"
    for case in ("fsdp-tp", "hsdp-tp"):
        logs = sorted(p.name for p in (trained / case / "samples").iterdir())
        assert logs == ["rank-0.jsonl", "rank-1.jsonl"]  # per data-parallel rank
        for log in logs:
            assert (trained / case / "samples" / log).read_text() == (
                trained / "fsdp" / "samples" / log
            ).read_text()
    assert [r["samples_seen"] for r in records(trained, "fsdp-tp")] == [
        r["samples_seen"] for r in records(trained, "fsdp")
    ]


@pytest.mark.distributed
def test_a_tp_checkpoint_continues_in_one_process(trained: Path) -> None:
    assert len(losses(trained, "tp-to-one")) == 2
    assert losses(trained, "tp-to-one") == pytest.approx(losses(trained, "fsdp-to-one"), rel=1e-3)
    samples = [
        json.loads(line)
        for log in sorted((trained / "tp-to-one" / "samples").iterdir())
        for line in log.read_text().splitlines()
    ]
    keys = [k for record in samples for k in record["keys"]]
    assert len(keys) == len(set(keys))  # every sequence at most once across the two meshes


@pytest.mark.distributed
def test_bad_tp_degrees_are_one_line(trained: Path) -> None:
    heads = (trained / "heads.refused").read_text()
    assert "train.tp_degree=2: must divide causal_lm.n_kv_heads=1" in heads
    vision = (trained / "vision.refused").read_text()
    assert "train.tp_degree=2 with task=image_classification" in vision
    assert "causal_lm GPT only" in vision


def plan(overrides: list[str], world: int, local: int = 0):
    return plan_training(load_config(None, overrides).train, DeviceFacts(type="cpu"), world, local)


def test_tp_plans_and_refusals() -> None:
    p = plan(["train.strategy=fsdp", "train.tp_degree=2"], 8, 4)
    assert (p.mesh, p.tp, p.data_parallel_size, p.data_parallel_rank(5)) == ((1, 4), 2, 4, 2)
    p = plan(["train.strategy=hsdp", "train.tp_degree=2"], 8, 4)
    assert (p.mesh, p.describe_mesh()) == ((2, 2), "replicate 2 x shard 2 x tp 2")
    with pytest.raises(ConfigError, match=r"tp_degree=3: must divide the 4 ranks of a node"):
        plan(["train.strategy=fsdp", "train.tp_degree=3"], 12, 4)
    with pytest.raises(ConfigError, match=r"tp_degree=2 with train.strategy=ddp"):
        plan(["train.strategy=ddp", "train.tp_degree=2"], 4, 4)
    with pytest.raises(ConfigError, match=r"tp_degree=2 with train.strategy=none and 1 rank"):
        plan(["train.strategy=fsdp", "train.tp_degree=2"], 1, 1)


@pytest.mark.distributed
def test_eval_of_a_tp_run_in_one_process_and_on_two_ranks(trained: Path) -> None:
    from tests.support.train_kit import run_hpctrain

    final = records(trained, "fsdp-tp", "eval")[-1]
    for nproc in ("1", "2"):  # the whole model in each process: no TP split to evaluate
        done = run_hpctrain("eval", str(trained / "fsdp-tp"), "--nproc", nproc)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["step"] == final["step"] and result["world_size"] == int(nproc)
        assert result["val_loss"] == pytest.approx(final["val_loss"], rel=1e-4), (nproc, result)
