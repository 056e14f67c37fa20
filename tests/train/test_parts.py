"""Unit tests of the trainer's parts that need no loader or process group."""

import math
from types import SimpleNamespace

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.data.index import ShardIndex, ShardInfo
from hpctrain.models import SmallCNN, build_classifier
from hpctrain.parallel.parallelize import find_blocks
from hpctrain.tasks.image_classification import ImageClassification
from hpctrain.tasks.task import load_task
from hpctrain.tasks.vision import normalize
from hpctrain.train.optim import (
    build_optimizer,
    fused_adamw_ok,
    keep_fused_adamw,
    lr_factor,
    warmup_warning,
)

INDEX = ShardIndex(shards=(ShardInfo("a.tar", 10),), class_names=tuple("abcdefghij"))


def test_lr_schedule_warmup_then_cosine_to_zero() -> None:
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(70, 100, 10, "constant") == 1.0


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = SmallCNN(10)
    cfg = load_config(None, ["train.weight_decay=0.1"])
    opt = build_optimizer(model, cfg.train)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_is_fused_on_cuda_and_keeps_the_default_on_cpus() -> None:
    """Which parameters the fused kernel takes: faked device facts (no GPU here); the CPU
    optimizer is the real one, unchanged (its runs and resumes stay bitwise)."""
    cuda = torch.device("cuda", 0)
    on = lambda device, dtype: SimpleNamespace(device=device, dtype=dtype)  # noqa: E731
    assert fused_adamw_ok([on(cuda, torch.bfloat16), on(cuda, torch.float32)])
    assert not fused_adamw_ok([on(cuda, torch.float32), on(torch.device("cpu"), torch.float32)])
    assert not fused_adamw_ok([on(cuda, torch.int8)]) and not fused_adamw_ok([])
    opt = build_optimizer(SmallCNN(10), load_config(None, []).train)
    assert all(group["fused"] is None and group["foreach"] is None for group in opt.param_groups)


def test_a_resume_keeps_this_runs_adamw_implementation_not_the_checkpoints() -> None:
    """A loaded state brings its groups' `fused`: a GPU run's checkpoint resumed on a CPU
    (and an older one on a GPU) would change the update's implementation."""
    model = SmallCNN(10)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # as loaded from a GPU run
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    opt.step()
    keep_fused_adamw(opt)
    assert opt.param_groups[0]["fused"] is None  # CPU parameters: the default again
    opt.step()  # and it still steps
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    keep_fused_adamw(sgd)  # AdamW's only
    assert sgd.param_groups[0]["fused"] is True


def test_ddp_gradients_are_views_of_its_buckets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One gloo rank in this process: DDP's gradients live in its all-reduce buckets (no
    gradient-sized copy beside them), after a `zero_grad(set_to_none=True)` too."""
    import datetime

    import torch.distributed as dist

    from hpctrain.launch.local import free_port
    from hpctrain.parallel.parallelize import parallelize
    from hpctrain.parallel.precision import Precision, TrainingPlan

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        plan = TrainingPlan("ddp", Precision("fp32", "cpu", sharded=False), sync_batchnorm=False)
        model = parallelize(SmallCNN(3), load_config(None, []).train, plan, torch.device("cpu"))
        assert model.gradient_as_bucket_view
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(torch.randn(2, 3, 16, 16)).sum().backward()
            grads = [p.grad for p in model.parameters()]
            assert all(g is not None and g._base is not None for g in grads)  # views
    finally:
        dist.destroy_process_group()


def test_blocks_found_for_known_layouts() -> None:
    assert len(find_blocks(SmallCNN(3))) == 4
    assert [name for _, name, _ in find_blocks(build_classifier("resnet18", 3))] == [
        "layer1",
        "layer2",
        "layer3",
        "layer4",
    ]


def test_unknown_model_and_task_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="model.name='nope'"):
        build_classifier("nope", 3)
    with pytest.raises(ConfigError, match="task='no.such.module:Task'"):
        load_task(load_config(None, ["task=no.such.module:Task"]), INDEX)
    with pytest.raises(
        ConfigError, match="expected one of causal_lm, image_classification, segmentation"
    ):
        load_task(load_config(None, ["task=whatever"]), INDEX)


def test_eval_metrics_ignore_padded_samples() -> None:
    task = ImageClassification(load_config(None, ["model.image_size=16"]), INDEX)
    model = task.build_model().eval().requires_grad_(False)
    images = torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([1, 2, 3, 4])
    full = task.eval_metrics(
        model, {"image": images, "label": labels, "valid": torch.ones(4, dtype=torch.bool)}
    )
    padded = task.eval_metrics(
        model,
        {
            "image": torch.cat([images, images[:2]]),
            "label": torch.cat([labels, labels[:2]]),
            "valid": torch.tensor([True] * 4 + [False] * 2),
        },
    )
    assert padded["count"] == 4
    for name in ("loss", "accuracy", "top5"):
        assert math.isclose(float(full[name]), float(padded[name]), rel_tol=1e-5)


def test_transforms_give_fixed_size_uint8() -> None:
    task = ImageClassification(load_config(None, ["model.image_size=24"]), INDEX)
    sample = {
        "jpg": torch.randint(0, 255, (3, 40, 60), dtype=torch.uint8),
        "cls": 1,
        "key": "k",
        "json": {},
    }
    for transform in (task.train_transform(), task.eval_transform()):
        out = transform(dict(sample))
        assert out["image"].shape == (3, 24, 24) and out["image"].dtype == torch.uint8
        assert out["label"] == 1 and out["key"] == "k"
    x = normalize(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))
    assert x.dtype == torch.float32 and x.max() > 2


def test_training_loss_leaves_out_invalid_samples() -> None:
    """Fillers (on_error=skip) and re-plan padding must not pull the loss."""
    task = ImageClassification(load_config(None, ["model.image_size=16"]), INDEX)
    model = task.build_model().eval().requires_grad_(False)
    images = torch.randint(0, 255, (4, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([1, 2, 3, 4])
    clean, clean_metrics = task.loss(
        model, {"image": images, "label": labels, "valid": torch.ones(4, dtype=torch.bool)}
    )
    junk = torch.randint(0, 255, (2, 3, 16, 16), dtype=torch.uint8)
    mixed, mixed_metrics = task.loss(
        model,
        {
            "image": torch.cat([images, junk]),
            "label": torch.cat([labels, torch.tensor([7, 8])]),
            "valid": torch.tensor([True] * 4 + [False] * 2),
        },
    )
    assert torch.allclose(clean, mixed) and torch.allclose(
        clean_metrics["accuracy"], mixed_metrics["accuracy"]
    )


def test_a_warmup_as_long_as_the_run_is_warned_of() -> None:
    """configs/finetune-lora.yaml on 50 records: warmup_steps 100 against 6 steps (#49)."""
    train = load_config(None, ["train.warmup_steps=100", "train.lr=0.0002"]).train
    assert warmup_warning(train, 6) == (
        "train.warmup_steps=100 reaches the run's 6 steps: the learning rate never rises to "
        "train.lr=0.0002 and little is learnt; set train.warmup_steps below 6 (a tenth of the "
        "steps: 0)"
    )
    assert warmup_warning(train, 100) != ""
    assert warmup_warning(train, 101) == ""
    assert warmup_warning(load_config(None, ["train.warmup_steps=0"]).train, 6) == ""
