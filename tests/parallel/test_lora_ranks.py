"""LoRA on 2 gloo ranks (one job: `lora_worker.py`): DDP, FSDP2 built on the meta device, HSDP
and activation checkpointing end with the same adapters, bitwise in fp32; a preempted FSDP2
run resumes to the same adapters; QLoRA under DDP and FSDP2 agree, bitwise too; 12 steps
clipped at every step (train.grad_clip) agree bitwise under DDP, FSDP2 and HSDP; bf16 on a bf16
base trains.
Compile on a CPU is refused here (no C++ compiler for inductor): tests/models/test_lora.py
traces the adapted block with a compiler backend that needs none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.models.test_hf import LM_VOCAB, save_hf
from tests.support.lm_kit import write_token_shards
from tests.support.lora_worker import CASES
from tests.support.train_kit import REPO, run_two_ranks

pytest.importorskip("transformers")
pytest.importorskip("torchao")

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-ranks")


@pytest.fixture(scope="module")
def results(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    write_token_shards(root / "shards" / "train", 1, seed=1)
    save_hf(root / "llama", "llama", vocab_size=LM_VOCAB)
    worker = REPO / "tests" / "support" / "lora_worker.py"
    run_two_ranks(worker, str(root / "llama"), str(root / "shards"), str(root), timeout=600)
    return {name: torch.load(root / f"{name}.pt", weights_only=True) for name in CASES}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def test_every_strategy_trains_the_same_adapters(results: dict) -> None:
    assert any(v.abs().sum() > 0 for k, v in results["ddp"].items() if ".lora_B." in k)
    assert len(results["ddp"]) == 2 * 7 * 2
    assert_same(results["fsdp"], results["ddp"])
    assert_same(results["hsdp"], results["ddp"])
    assert_same(results["fsdp-ac"], results["ddp"])


def test_a_preempted_fsdp2_run_resumes_exactly(results: dict) -> None:
    assert_same(results["fsdp-preempted"], results["fsdp"])


def test_qlora_under_ddp_and_fsdp2(results: dict) -> None:
    """DDP leaves the NF4 base alone: its broadcast at construction changed the values (by
    1e-5, on every rank) before `parallelize` told it to ignore them."""
    assert_same(results["fsdp-qlora"], results["ddp-qlora"])
    # a 4-bit base: other gradients than the fp32 base's
    assert not torch.equal(
        results["ddp-qlora"]["blocks.0.attention.wq.lora_B.weight"],
        results["ddp"]["blocks.0.attention.wq.lora_B.weight"],
    )


def test_clipped_steps_agree_bitwise_under_ddp_fsdp2_and_hsdp(results: dict, root: Path) -> None:
    """12 steps clipped at every step (train.grad_clip 0.01; the norm is near 0.25): one
    order of summation for the norm under every strategy (`hpctrain.parallel.grad_norm`), so
    the same clip coefficients and adapters, bitwise (with torch's clip_grad_norm_, FSDP2's
    adapters were 5e-7 from DDP's after 12 steps, and drifting)."""
    norms = {}
    for case in ("ddp-clip", "fsdp-clip", "hsdp-clip"):
        lines = (root / case / "metrics.jsonl").read_text().splitlines()
        norms[case] = [r["grad_norm"] for r in map(json.loads, lines) if r["kind"] == "train"]
        assert norms[case] and min(norms[case]) > 0.01, case  # clipping acted
    assert norms["fsdp-clip"] == norms["ddp-clip"] == norms["hsdp-clip"]
    assert_same(results["fsdp-clip"], results["ddp-clip"])
    assert_same(results["hsdp-clip"], results["ddp-clip"])


def test_bf16_on_a_bf16_base(results: dict) -> None:
    adapters = results["fsdp-bf16"]
    assert all(v.dtype == torch.float32 for v in adapters.values())  # fp32 master weights
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)
