"""What FSDP2 keeps and builds, on 2 gloo ranks (issue #38): gradient accumulation holds no
full-size gradient between micro-steps (item 5); a fresh run builds on the meta device and
initialises its shards with the CPU build's values (item 6); the root stays gathered after the
forward and the GPT's RoPE tables stay fp32 in its blocks (low items). One job for all of it:
`tests/support/fsdp_memory_worker.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import REPO, run_two_ranks

WORKER = REPO / "tests" / "support" / "fsdp_memory_worker.py"


@pytest.fixture(scope="module")
def job(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp-memory")
    tokens = write_token_shards(out / "tokens", 2, seed=3)
    run_two_ranks(WORKER, str(shapes_shards), str(tokens), str(out), timeout=600)
    return out


def facts(out: Path) -> dict:
    return json.loads((out / "facts.json").read_text())


def assert_close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp-fp32", "hsdp-fp32", "fsdp-bf16"])
def test_accumulation_reduce_scatters_every_micro_step(job: Path, case: str) -> None:
    now, before = facts(job)["accumulation"][case], facts(job)["before"][case]
    assert len(now["between"]) == 3  # one look between the 2 micro-steps of each step
    # No full-size gradient waits for the last micro-step; each rank holds its shards only.
    assert all(seen["unsharded_bytes"] == 0 for seen in now["between"]), now
    assert all(seen["reduced"] > 0 for seen in now["between"]), now
    # What the accumulation of before held (so this test fails without the fix).
    assert all(seen["unsharded_bytes"] > 0 for seen in before["between"]), before
    assert all(seen["reduced"] == 0 for seen in before["between"]), before
    # The same training, to float rounding (sums in another order).
    weights = torch.load(job / f"{case}.pt", weights_only=True)
    reference = torch.load(job / f"{case}-before.pt", weights_only=True)
    if case.endswith("bf16"):
        assert now["losses"] == pytest.approx(before["losses"], rel=2e-2)
        assert_close(weights, reference, atol=1e-3, rtol=1e-2)
    else:
        assert now["losses"] == pytest.approx(before["losses"], rel=1e-5)
        assert_close(weights, reference, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["gpt-fsdp-fp32", "cnn-hsdp-bf16"])
def test_a_fresh_sharded_run_builds_on_meta_with_todays_weights(job: Path, case: str) -> None:
    assert facts(job)["meta"][case]["on_meta"]
    built = torch.load(job / f"{case}.pt", weights_only=True)
    assert_close(built["trainer"], built["cpu"], atol=0)  # bitwise: same seed, same draws
    assert len(facts(job)["meta"][case]["losses"]) == 2


@pytest.mark.distributed
def test_the_root_stays_gathered_and_rope_tables_stay_fp32(job: Path) -> None:
    seen = facts(job)["gathered"]
    assert seen["root_after_forward"] == "gathered"
    # the residual stream in bf16 (from the embedding), cos and sin in fp32, the mask as it is
    assert seen["block_inputs"][:3] == ["torch.bfloat16", "torch.float32", "torch.float32"]
