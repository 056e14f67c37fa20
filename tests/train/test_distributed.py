"""DDP and FSDP2 on 2 gloo processes × fp32 and bf16, and export from both kinds of checkpoint.

One 2-rank job (`dist_worker.py`) runs every case in-process; the assertions live here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.train_kit import REPO, run_two_ranks


@pytest.fixture(scope="module")
def trained(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run_two_ranks(
        REPO / "tests" / "support" / "dist_worker.py", str(shapes_shards), str(out), timeout=240
    )
    return out


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.distributed
def test_ddp_and_fsdp2_fp32_end_bitwise_equal(trained: Path) -> None:
    ddp, fsdp = load(trained / "ddp-fp32.pt"), load(trained / "fsdp-fp32.pt")
    assert ddp.keys() == fsdp.keys() and ddp
    for name in ddp:
        assert torch.equal(ddp[name], fsdp[name]), f"{name} differs between DDP and FSDP2"
    # The logged global gradient norm: a plain tensor under DDP, a DTensor reduced under FSDP2.
    norms = {
        case: [
            json.loads(line)["grad_norm"]
            for line in (trained / case / "metrics.jsonl").read_text().splitlines()
            if '"kind": "train"' in line
        ]
        for case in ("ddp-fp32", "fsdp-fp32")
    }
    assert len(norms["ddp-fp32"]) == 3 and all(n > 0 for n in norms["ddp-fp32"])
    assert norms["ddp-fp32"] == norms["fsdp-fp32"]  # one order of summation: the same bits


@pytest.mark.distributed
def test_bf16_runs_are_finite_and_near_fp32(trained: Path) -> None:
    reference = load(trained / "ddp-fp32.pt")
    for case in ("ddp-bf16", "fsdp-bf16"):
        weights = load(trained / f"{case}.pt")
        for name, value in weights.items():
            assert value.dtype == torch.float32, f"{case}: master weights must stay fp32"
            assert torch.isfinite(value).all(), f"{case}: {name} is not finite"
            # bf16 compute differs from fp32 but must train the same model, not diverge
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0.1)
        metrics = (trained / case / "metrics.jsonl").read_text()
        assert "NaN" not in metrics and "Infinity" not in metrics
        records = [json.loads(line) for line in metrics.splitlines()]
        evals = [r for r in records if r["kind"] == "eval"]
        assert evals[-1]["val_samples"] == 80, "padded validation samples counted"
        for r in records:
            if r["kind"] == "train":
                assert 0.0 <= r["data_wait_fraction"] <= r["data_wait_fraction_worst"] <= 1.0
                assert r["grad_norm"] > 0.1, "the norm before clipping to 0.1: clipping acted"


@pytest.mark.distributed
def test_gradient_accumulation_under_ddp_matches_the_larger_batch(trained: Path) -> None:
    one_step = load(trained / "ddp-fp32.pt")
    accumulated = load(trained / "ddp-fp32-accum.pt")
    for name in one_step:
        torch.testing.assert_close(accumulated[name], one_step[name], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_export_from_ddp_and_fsdp2_checkpoints_loads_into_the_plain_model(
    trained: Path, tmp_path: Path
) -> None:
    from examples.custom_task import ThumbnailMLP

    from hpctrain.cli.main import main
    from hpctrain.config import load_config
    from hpctrain.data.index import ShardIndex, ShardInfo

    sources = {
        "ddp-fp32": str(trained / "ddp-fp32"),  # a run folder: its newest checkpoint
        "fsdp-fp32": str(trained / "fsdp-fp32" / "checkpoints" / "step-3"),  # one step folder
    }
    index = ShardIndex(shards=(ShardInfo("a.tar", 1),), class_names=tuple("abcdefghij"))
    cfg = load_config(None, ["task_options.hidden=32"])
    for case, source in sources.items():
        out = tmp_path / f"{case}.pt"
        assert main(["export", source, str(out)]) == 0
        exported = torch.load(out, weights_only=True)
        model = ThumbnailMLP(cfg, index).build_model()
        model.load_state_dict(exported)  # strict: the plain model's names, nothing more
        expected = load(trained / f"{case}.pt")
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), f"{case}: {name}"
    assert main(["export", str(tmp_path), str(tmp_path / "x.pt")]) == 4


@pytest.mark.distributed
def test_fsdp2_cnn_with_activation_checkpointing_exports_to_the_plain_model(
    trained: Path, tmp_path: Path
) -> None:
    from hpctrain.cli.main import main
    from hpctrain.models import SmallCNN

    out = tmp_path / "cnn.pt"
    assert main(["export", str(trained / "fsdp-cnn" / "checkpoints"), str(out)]) == 0
    model = SmallCNN(10)
    model.load_state_dict(torch.load(out, weights_only=True))  # no wrapper names left
    expected = load(trained / "fsdp-cnn.pt")
    for name, value in model.state_dict().items():
        assert torch.isfinite(value.float()).all()
        if name in expected:
            assert torch.equal(value, expected[name]), name
