"""`train.freeze` and `train.lr_groups`: the optimizer's groups and their scheduled rates, the
parameter counts logged, bad patterns refused in one line, frozen weights left bitwise as
they were, and exact resume with an EMA: in this process, and under DDP and FSDP2 on 2 gloo
ranks (one job: `finetune_worker.py`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.config import ConfigError, load_config
from hpctrain.inference.export import export_weights
from hpctrain.train.optim import lr_factor, named_parameters
from tests.support.finetune_worker import FINETUNE, TASK
from tests.support.train_kit import REPO, run_two_ranks
from tests.train.test_trainer import build, make_config, train_records

FROZEN = ("1.weight", "1.bias", "3.weight")
SCALED = ("5.weight", "5.bias")


def finetune_config(shards: Path, run_dir: Path, *overrides: str) -> Any:
    return make_config(
        shards,
        run_dir,
        f"task={TASK}",
        "task_options.hidden=16",
        "data.val=",
        *FINETUNE,
        *overrides,
    )


def group_names(trainer: Any) -> list[list[str]]:
    names = {id(param): names[0] for names, param in named_parameters(trainer.model)}
    return [[names[id(p)] for p in group["params"]] for group in trainer.optimizer.param_groups]


def close(trainer: Any) -> None:
    trainer.checkpoints.close()
    trainer.loader.close()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # no training here
def test_frozen_and_scaled_groups_keep_their_ratio_through_the_schedule(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        trainer = build(finetune_config(shapes_shards, tmp_path / "run", "train.weight_decay=0.1"))
    try:
        params = dict(trainer.model.named_parameters())
        assert [name for name, p in params.items() if not p.requires_grad] == list(FROZEN)
        # 256 x 16 + 16 + 16 x 16 frozen; 16 + 16 x 10 + 10 trainable (10 classes of shapes)
        assert "parameters: 186 trainable, 4,368 frozen (train.freeze)" in caplog.text
        # base rate (no decay: the decayed half is empty), then 10x (decay, no decay); frozen
        # parameters nowhere
        assert group_names(trainer) == [["3.bias"], ["5.weight"], ["5.bias"]]
        groups = trainer.optimizer.param_groups
        assert [(g["weight_decay"], g["lr_scale"]) for g in groups] == [
            (0.0, 1.0),
            (0.1, 10.0),
            (0.0, 10.0),
        ]
        for step in range(4):  # warmup 2 steps, then cosine to step 4
            factor = lr_factor(step, 4, 2, "cosine")
            assert [g["lr"] for g in groups] == pytest.approx(
                [0.01 * factor, 0.1 * factor, 0.1 * factor], rel=1e-12
            )
            trainer.scheduler.step()
    finally:
        close(trainer)


def test_frozen_weights_stay_bitwise_and_a_resume_is_exact(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """Strategy none (one process), with the EMA: straight to step 4 against a resume from
    the straight run's step-2 checkpoint in a second run folder."""
    straight = build(
        finetune_config(shapes_shards, tmp_path / "straight", "checkpoint.every_steps=2")
    )
    initial = {k: v.detach().clone() for k, v in straight.model.named_parameters()}
    assert straight.fit() == 0
    step2 = tmp_path / "straight" / "checkpoints" / "step-2"
    resumed = build(
        finetune_config(shapes_shards, tmp_path / "resumed", f"checkpoint.resume={step2}")
    )
    assert resumed.fit() == 0
    try:
        final = dict(straight.model.named_parameters())
        for name in FROZEN:
            assert torch.equal(final[name], initial[name]), name
        for name in ("3.bias", *SCALED):
            assert not torch.equal(final[name], initial[name]), name
        for name, weight in resumed.model.named_parameters():
            assert torch.equal(weight, final[name]), name
        assert straight.ema is not None and resumed.ema is not None
        assert straight.ema.names == ["3.bias", *SCALED]  # the EMA follows what trains
        for name, weight in resumed.ema.state_dict().items():
            assert torch.equal(weight, straight.ema.state_dict()[name]), name
        optimizer = resumed.optimizer
        assert [g["lr"] for g in optimizer.param_groups] == [
            g["lr"] for g in straight.optimizer.param_groups
        ]
        assert {id(p) for p in optimizer.state} == {
            id(p) for p in resumed.model.parameters() if p.requires_grad
        }
        # The EMA export: averaged trained parameters, frozen ones as they were.
        exported = export_weights(str(tmp_path / "straight"), tmp_path / "ema.pt", ema=True)
        ema_weights = torch.load(exported.out, weights_only=True)
        assert ema_weights.keys() == final.keys()
        for name in FROZEN:
            assert torch.equal(ema_weights[name], initial[name]), name
        for name in SCALED:
            assert torch.equal(ema_weights[name], straight.ema.state_dict()[name]), name
        saved = dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
        assert {"app.model.1.weight", "app.optim.state.5.weight.exp_avg"} <= saved.keys()
        assert not [k for k in saved if k.startswith(("app.optim.state.1.", "app.optim.state.3.w"))]
        # Other groups than the checkpoint's: refused in one line naming the key (without the
        # check, a new lr_scale was kept silently at the saved one, a new pattern failed in
        # DCP with "zip() argument 2 is longer than argument 1").
        for override, key in [
            ("train.lr_groups=[{pattern: '5.*', lr_scale: 2}]", "train.lr_groups"),
            ("train.lr_groups=[{pattern: '5.weight', lr_scale: 10}]", "train.lr_groups"),
            ("train.freeze=['1.*']", "train.freeze"),
        ]:
            changed = build(
                finetune_config(
                    shapes_shards, tmp_path / "changed", f"checkpoint.resume={step2}", override
                )
            )
            try:
                with pytest.raises(ConfigError) as info:
                    changed.fit()
                assert str(info.value).startswith(f"{key}=")
                assert "the checkpoint of step 2 was saved with" in str(info.value)
                assert not (tmp_path / "changed" / "config.yaml").exists()
            finally:
                close(changed)
    finally:
        close(straight)
        close(resumed)


def test_the_logged_lr_is_train_lr_when_every_trained_parameter_is_scaled(
    shapes_shards: Path, tmp_path: Path
) -> None:
    trainer = build(
        finetune_config(
            shapes_shards, tmp_path / "run", "train.freeze=['1.*', '3.*']", "train.max_steps=2"
        )
    )
    assert trainer.fit() == 0
    close(trainer)
    assert [g["lr_scale"] for g in trainer.optimizer.param_groups] == [10.0, 10.0]
    logged = [r["lr"] for r in train_records(tmp_path / "run")]
    assert logged == pytest.approx([0.01 * lr_factor(s, 2, 2, "cosine") for s in range(2)])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.freeze=['1.*', 'head.*']"],
            "train.freeze[1]='head.*': matches no parameter of the model (its names: '1.weight', "
            "'1.bias', '3.weight', '3.bias' and 2 more)",
        ),
        (["train.freeze=['*']"], "train.freeze=['*']: leaves no parameter of the model to train"),
        (
            ["train.freeze=[]", "train.lr_groups=[{pattern: '7.*', lr_scale: 2}]"],
            "train.lr_groups[0].pattern='7.*': matches no parameter of the model",
        ),
        (
            ["train.lr_groups=[{pattern: '1.*', lr_scale: 2}]"],
            "train.lr_groups[0].pattern='1.*': every parameter it matches is frozen",
        ),
        (
            ["train.lr_groups=[{pattern: '5.*', lr_scale: 2}, {pattern: '5.bias', lr_scale: 3}]"],
            "train.lr_groups[1].pattern='5.bias': every parameter it matches is frozen "
            "(train.freeze) or taken by an earlier entry",
        ),
    ],
)
def test_a_pattern_that_selects_nothing_is_one_line_naming_it(
    shapes_shards: Path, tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build(finetune_config(shapes_shards, tmp_path / "run", *overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_lr_groups_and_freeze_are_typed_in_the_config() -> None:
    for override, message in [
        ("train.lr_groups=[{pattern: 'a.*', lr_scale: 0}]", "lr_groups[0].lr_scale=0.0"),
        ("train.lr_groups=[{pattern: 'a.*', scale: 2}]", "unknown key 'train.lr_groups[0].scale'"),
        ("train.lr_groups=['a.*']", "train.lr_groups[0]='a.*' (command line): expected a mapping"),
        ("train.freeze=blocks.0.*", "train.freeze='blocks.0.*' (command line): expected a list"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert message in str(info.value)


def test_names_are_the_models_own_under_activation_checkpointing(
    shapes_shards: Path, tmp_path: Path
) -> None:
    trainer = build(
        make_config(
            shapes_shards,
            tmp_path / "run",
            "task=image_classification",
            "model.name=small_cnn",
            "data.val=",
            "train.activation_checkpointing=true",
            "train.freeze=['blocks.0.*']",
            "train.lr_groups=[{pattern: 'blocks.1.*', lr_scale: 3}]",
        )
    )
    try:
        wrapped = [n for n, p in trainer.model.named_parameters() if not p.requires_grad]
        assert wrapped and all(
            n.startswith("blocks.0._checkpoint_wrapped_module.") for n in wrapped
        )
        scaled = [
            names
            for names, g in zip(group_names(trainer), trainer.optimizer.param_groups, strict=True)
            if g["lr"] == pytest.approx(3 * 0.01)
        ]
        assert scaled and all(n.startswith("blocks.1.") for names in scaled for n in names)
    finally:
        close(trainer)


@pytest.fixture(scope="module")
def two_ranks(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("finetune")
    run_two_ranks(
        REPO / "tests" / "support" / "finetune_worker.py", str(shapes_shards), str(out), timeout=300
    )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_freeze_scale_and_resume_exactly(two_ranks: Path, strategy: str) -> None:
    """FSDP2 shards the frozen unit (layer 1) and the mixed one (layer 3) like the others."""
    straight = torch.load(two_ranks / f"{strategy}.pt", weights_only=True)
    resumed = torch.load(two_ranks / f"{strategy}-interrupted.pt", weights_only=True)
    initial, final = straight["initial"], straight["final"]
    for name in FROZEN:
        assert torch.equal(final[name], initial[name]), name
    for name in ("3.bias", *SCALED):
        assert not torch.equal(final[name], initial[name]), name
    for key in ("initial", "final", "ema"):
        assert straight[key].keys() == resumed[key].keys()
        for name, tensor in straight[key].items():
            assert torch.equal(resumed[key][name], tensor), (key, name)
    assert list(straight["ema"]) == ["3.bias", *SCALED]
    assert straight["with_state"] == resumed["with_state"] == sorted(["3.bias", *SCALED])
    assert straight["rates"] == resumed["rates"]  # the rate each step used, by group
    for step, rates in enumerate(straight["rates"]):  # 0.5, 1, 1, 0.5 of the peak
        factor = lr_factor(step, 4, 2, "cosine")
        assert rates == pytest.approx([0.05 * factor, 0.5 * factor, 0.5 * factor])
    ddp = torch.load(two_ranks / "ddp.pt", weights_only=True)
    for name, tensor in ddp["final"].items():  # and the two strategies agree bitwise
        assert torch.equal(final[name], tensor), name
