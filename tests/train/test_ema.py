"""`train.ema_decay` / `train.ema_eval` / `export --ema`: the EMA's arithmetic, its layout under
DDP and FSDP2 (2 gloo ranks, one job: `ema_worker.py`), exact resume after SIGUSR2, resharding
2 ranks -> 1, evaluation with the EMA, exports loaded without hpctrain, and a checkpoint saved
without an EMA resumed with one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint import CheckpointError
from hpctrain.cli.main import main
from hpctrain.config import ConfigError
from hpctrain.inference.export import export_weights
from hpctrain.train.ema import WeightEMA, plain_name
from tests.support.train_kit import REPO, run_two_ranks
from tests.train.test_trainer import build, make_config, read_jsonl


def test_ema_follows_the_weights_as_computed_by_hand() -> None:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    ema = WeightEMA(model, decay=0.75)
    expected = torch.tensor([[1.0, -2.0]])
    for new in ([3.0, 2.0], [-1.0, 0.0], [5.0, 4.0]):
        with torch.no_grad():
            model.weight.copy_(torch.tensor([new]))
        ema.update()
        expected = 0.75 * expected + 0.25 * torch.tensor([new])
        assert torch.allclose(ema.weights[0], expected)
    # 1 -> 1.5 -> 0.875 -> 1.90625; -2 -> -1 -> -0.75 -> 0.4375
    assert ema.weights[0].tolist() == [[1.90625, 0.4375]]
    ema.swap()
    assert model.weight.tolist() == [[1.90625, 0.4375]]
    ema.swap()
    assert model.weight.tolist() == [[5.0, 4.0]] and ema.weights[0].tolist() == [[1.90625, 0.4375]]
    ema.reset()
    assert ema.weights[0].tolist() == [[5.0, 4.0]]
    assert list(ema.state_dict()) == ["weight"]


def test_ema_is_fp32_and_names_drop_wrapper_parts() -> None:
    model = nn.Linear(2, 2).to(torch.bfloat16)
    ema = WeightEMA(model, decay=0.5)
    assert {w.dtype for w in ema.weights} == {torch.float32}
    ema.update()  # bf16 weights, fp32 average
    assert plain_name("module.b.0._checkpoint_wrapped_module._orig_mod.w") == "module.b.0.w"
    with pytest.raises(ValueError, match="decay"):
        WeightEMA(model, decay=1.0)


@pytest.fixture(scope="module")
def two_ranks(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ema")
    run_two_ranks(
        REPO / "tests" / "support" / "ema_worker.py", str(shapes_shards), str(out), timeout=240
    )
    return out


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp", "fsdp-kept"])
def test_ddp_and_fsdp2_give_bitwise_equal_fp32_emas(two_ranks: Path, case: str) -> None:
    """`fsdp-kept`: reshard_after_forward=false, where an evaluation leaves the parameters
    gathered; the steps after it must train the weights, not the EMA swapped in for it."""
    ddp, fsdp = load(two_ranks / "ddp.ema.pt"), load(two_ranks / f"{case}.ema.pt")
    assert list(ddp) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    for name in ddp:
        assert ddp[name].dtype == torch.float32
        assert torch.equal(ddp[name], fsdp[name]), name


@pytest.mark.distributed
def test_fsdp2_bf16_ema_is_fp32_and_sharded_like_the_parameters(two_ranks: Path) -> None:
    facts = json.loads((two_ranks / "fsdp-bf16.json").read_text())
    assert facts == {
        "ema_dtypes": ["torch.float32"],
        "param_dtypes": ["torch.float32"],  # FSDP2 keeps the sharded parameters fp32
        "same_placements": True,
    }


@pytest.mark.distributed
def test_sigusr2_and_resume_give_the_ema_of_the_uninterrupted_run(two_ranks: Path) -> None:
    straight, resumed = load(two_ranks / "fsdp.ema.pt"), load(two_ranks / "fsdp-interrupted.ema.pt")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    steps = sorted((two_ranks / "fsdp-interrupted" / "checkpoints").glob("step-*"))
    assert [p.name for p in steps] == ["step-2", "step-4"]


@pytest.mark.distributed
def test_evaluation_with_the_ema_says_so(two_ranks: Path) -> None:
    evals = {
        case: [r for r in read_jsonl(two_ranks / case / "metrics.jsonl") if r["kind"] == "eval"]
        for case in ("ddp", "fsdp", "fsdp-kept")
    }
    assert [r["step"] for r in evals["ddp"]] == [2, 4]  # every 2 steps: the last one once
    assert all(r["weights"] == "ema" and r["val_samples"] == 80 for r in evals["ddp"])
    # FSDP2 evaluated the same (EMA) weights: the swap reached the shards forward gathers.
    for ddp, fsdp, kept in zip(evals["ddp"], evals["fsdp"], evals["fsdp-kept"], strict=True):
        for record in (fsdp, kept):
            assert record["weights"] == "ema"
            assert record["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-6)


@pytest.mark.distributed
def test_fsdp2_checkpoint_resumes_on_one_rank_with_its_ema(
    two_ranks: Path, shapes_shards: Path, tmp_path: Path
) -> None:
    """2 FSDP2 ranks -> 1 plain process: the EMA reshards like the model."""
    cfg = make_config(
        shapes_shards,
        tmp_path / "one",
        "data.val=",
        "task_options.hidden=16",
        "train.ema_decay=0.7",
        f"checkpoint.resume={two_ranks / 'fsdp' / 'checkpoints' / 'step-4'}",
    )
    trainer = build(cfg)
    try:
        trainer.resume()
        assert trainer.ema is not None and trainer.state.step == 4
        saved = load(two_ranks / "fsdp.ema.pt")
        for name, weight in trainer.ema.state_dict().items():
            assert torch.equal(weight, saved[name]), name
    finally:
        trainer.checkpoints.close()
        trainer.loader.close()


@pytest.mark.distributed
def test_export_ema_as_pt_and_safetensors_loads_without_hpctrain(
    two_ranks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    saved = load(two_ranks / "fsdp.ema.pt")
    run_dir = two_ranks / "fsdp"
    assert main(["export", str(run_dir), str(tmp_path / "ema.safetensors"), "--ema"]) == 0
    assert "(step 4, EMA)" in capsys.readouterr().out
    result = export_weights(str(run_dir), tmp_path / "ema.pt", ema=True)
    plain = export_weights(str(run_dir), tmp_path / "model.pt", ema=False)  # ema_eval: EMA
    for weights in (load_file(str(tmp_path / "ema.safetensors")), load(result.out)):
        assert weights.keys() == saved.keys()
        for name in saved:
            assert torch.equal(weights[name], saved[name]), name
    trained = load(plain.out)
    assert not torch.equal(trained["1.weight"], saved["1.weight"]), "the EMA is not the weights"


def test_checkpoint_without_ema_resumes_with_one_started_from_its_weights(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    first = build(make_config(shapes_shards, run_dir, "data.val=", "train.max_steps=2"))
    assert first.fit() == 0
    trained = {k: v.detach().clone() for k, v in first.model.named_parameters()}
    second = build(
        make_config(shapes_shards, run_dir, "data.val=", "train.max_steps=3", "train.ema_decay=0.9")
    )
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert second.fit() == 0
    assert "the checkpoint of step 2 has no EMA" in caplog.text
    assert second.ema is not None
    # One step after the resume: ema = 0.9 * (weights at step 2) + 0.1 * (weights at step 3).
    now = dict(second.model.named_parameters())
    for name, weight in second.ema.state_dict().items():
        torch.testing.assert_close(weight, 0.9 * trained[name] + 0.1 * now[name].detach())
    with pytest.raises(CheckpointError, match="no EMA weights"):
        export_weights(str(run_dir / "checkpoints" / "step-2"), tmp_path / "x.pt", ema=True)


def test_ema_eval_without_ema_decay_is_refused(shapes_shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.ema_decay"):
        build(make_config(shapes_shards, tmp_path / "r", "train.ema_eval=true"))


@pytest.mark.distributed
def test_gpu_counters_reduce_over_two_ranks(two_ranks: Path) -> None:
    """Written by the same 2-rank job, with NVML mocked there (see ema_worker.py)."""
    assert json.loads((two_ranks / "gpu-stats.json").read_text()) == {
        "gpu_util_pct": 35.0,
        "gpu_util_pct_worst": 10.0,
        "gpu_memory_used_mb": 150.0,
        "gpu_memory_used_mb_worst": 200.0,
        "gpu_memory_total_mb": 1024.0,
    }


def test_ema_eval_measures_the_ema_and_leaves_the_weights(
    shapes_shards: Path, tmp_path: Path
) -> None:
    trainer = build(
        make_config(
            shapes_shards,
            tmp_path / "run",
            "train.max_steps=2",
            "train.ema_decay=0.5",
            "train.ema_eval=true",
        )
    )
    assert trainer.fit() == 0
    ema = trainer.ema
    assert ema is not None
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    with_ema = trainer.evaluate()
    assert with_ema["weights"] == "ema"
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before), "swapped back bitwise"
    trainer.ema = None  # the same evaluation of the trained weights
    trained = trainer.evaluate()
    ema.swap()  # and of the EMA put in by hand
    by_hand = trainer.evaluate()
    assert "weights" not in trained
    assert by_hand["val_loss"] == with_ema["val_loss"] != trained["val_loss"]


def test_ema_names_are_the_checkpoint_names_under_activation_checkpointing(
    shapes_shards: Path, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    trainer = build(
        make_config(
            shapes_shards,
            tmp_path / "run",
            "task=image_classification",
            "model.name=small_cnn",
            "train.activation_checkpointing=true",
            "train.ema_decay=0.9",
        )
    )
    try:
        assert trainer.ema is not None
        names = set(get_model_state_dict(trainer.model))
        assert any("_checkpoint_wrapped_module" in n for n, _ in trainer.model.named_parameters())
        assert set(trainer.ema.names) <= names and len(trainer.ema.names) > 4
    finally:
        trainer.loader.close()
        if trainer.val_loader is not None:
            trainer.val_loader.close()
