"""The loss of an optimizer step is the mean over all its targets (#37 items 3 and 4).

Gradient accumulation and data-parallel ranks must give the loss and the gradients of one
large batch when micro-batches hold different numbers of targets (instruction data's masks,
padding, ignored pixels); steps and ranks without any target must not pull the logged loss
towards 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import load_config
from hpctrain.tasks.task import count_targets
from hpctrain.train.trainer import Trainer
from tests.support.targets_kit import TARGETS, gradients, lm_index, lm_overrides, rows, stack
from tests.support.train_kit import REPO, run_two_ranks
from tests.train.test_trainer import CPU, build, make_config, weights


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_index(tmp_path_factory.mktemp("lm"))


def lm_trainer(index: Path, run_dir: Path, *extra: str) -> Trainer:
    return build(load_config(None, lm_overrides(index, run_dir, *extra)))


def masked_mean_loss(trainer: Trainer, batch: dict[str, Any]) -> float:
    """The loss of `batch` as one batch, from the model's per-token losses (before a step)."""
    with torch.no_grad():
        losses = trainer.task.token_losses(trainer.model, batch["tokens"])  # type: ignore[attr-defined]
    targets = batch["loss_mask"][:, 1:]
    return float(losses[targets].mean())


def test_accumulated_micro_batches_give_the_loss_and_gradients_of_the_large_batch(
    index: Path, tmp_path: Path
) -> None:
    # rows of 32, 3, 0 and 12 targets: averaging each micro-batch over its own targets and
    # then over the micro-batches gave the row of 3 targets the weight of the row of 32
    whole = lm_trainer(index, tmp_path / "whole", "data.batch_size=4")
    accumulated = lm_trainer(
        index, tmp_path / "accumulated", "data.batch_size=1", "train.grad_accum_steps=4"
    )
    expected = masked_mean_loss(whole, stack(rows()))
    whole.train_step(iter([stack(rows())]))
    accumulated.train_step(iter(rows()))
    reference = gradients(whole.model)
    assert reference and all(g.abs().sum() > 0 for g in reference.values())
    for name, grad in gradients(accumulated.model).items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7)
    for trainer in (whole, accumulated):
        record = trainer.meter.summarize(CPU, 1)
        assert record["loss"] == pytest.approx(expected, rel=1e-5)
        assert record["targets"] == sum(TARGETS) and record["empty_steps"] == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_give_the_loss_and_gradients_of_the_large_batch(
    index: Path, tmp_path: Path
) -> None:
    run_two_ranks(REPO / "tests" / "support" / "targets_worker.py", str(index), str(tmp_path))
    cases = torch.load(tmp_path / "cases.pt", weights_only=True)
    whole = lm_trainer(index, tmp_path / "whole", "data.batch_size=4")
    expected = masked_mean_loss(whole, stack(rows()))
    two_rows = stack(rows()[:2])
    expected_first_two = masked_mean_loss(whole, two_rows)
    whole.train_step(iter([stack(rows())]))
    reference = gradients(whole.model)
    alone = lm_trainer(index, tmp_path / "alone", "data.batch_size=2")
    alone.train_step(iter([two_rows]))
    first_two = gradients(alone.model)
    for strategy in ("ddp", "fsdp"):
        for layout in ("2x2", "2x1x2"):  # 2 ranks of batch 2; 2 ranks of 2 micro-batches of 1
            case = cases[f"{strategy}-{layout}"]
            assert case["loss"] == pytest.approx(expected, rel=1e-5), layout
            assert case["targets"] == sum(TARGETS)
            for name, grad in case["grads"].items():
                torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7)
        # a rank whose batch holds no target: the loss and gradients of the other's alone
        # (the loss was halved: the empty rank's 0.0 averaged in)
        case = cases[f"{strategy}-empty-rank"]
        assert case["loss"] == pytest.approx(expected_first_two, rel=1e-5)
        for name, grad in case["grads"].items():
            torch.testing.assert_close(grad, first_two[name], rtol=1e-5, atol=1e-7)


def test_a_step_without_targets_changes_nothing_and_is_left_out_of_the_logged_loss(
    index: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = lm_trainer(index, tmp_path, "data.batch_size=1", "train.max_steps=2")
    row_with_3, row_without = rows()[1], rows()[2]
    expected = masked_mean_loss(trainer, row_with_3)
    trainer.train_step(iter([row_with_3]))
    before = weights(trainer)
    with caplog.at_level(logging.WARNING):
        trainer.train_step(iter([row_without]))  # a prompt that fills the whole sequence
    after = weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "an empty step moved weights"
    record = trainer.meter.summarize(CPU, 1)
    assert record["loss"] == pytest.approx(expected, rel=1e-5)  # was half of it
    assert record["empty_steps"] == 1 and record["targets"] == 1.5
    assert "1 of the 2 steps so far had no target on any rank" in caplog.text
    # an interval of empty steps alone: no loss to log, not 0.0
    trainer.meter.reset()
    trainer.train_step(iter([row_without]))
    assert trainer.meter.summarize(CPU, 1)["loss"] != trainer.meter.summarize(CPU, 1)["loss"]


def test_padding_in_image_batches_counts_as_in_one_large_batch(
    shapes_shards: Path, tmp_path: Path
) -> None:
    # the classification sibling: valid flags (padding, fillers of lost samples) per micro-batch
    common = ("train.optimizer=sgd", "train.lr=0.1", "data.val=", "data.batch_size=4")
    whole = build(make_config(shapes_shards, tmp_path / "a", *common))
    halves = build(make_config(shapes_shards, tmp_path / "b", *common, "train.grad_accum_steps=2"))
    whole.loader.set_epoch(0)
    batch = next(iter(whole.loader))
    batch["valid"] = torch.tensor([True, False, True, True])
    half = [{k: v[i * 2 : i * 2 + 2] for k, v in batch.items()} for i in range(2)]
    whole.train_step(iter([batch]))
    halves.train_step(iter(half))
    reference = gradients(whole.model)
    for name, grad in gradients(halves.model).items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7)
    for trainer in (whole, halves):
        assert trainer.meter.summarize(CPU, 1)["targets"] == 3


def test_every_built_in_task_counts_the_targets_its_loss_averages_over() -> None:
    """`loss * count_targets` is the sum of the per-target losses: the step's weighing is
    exact for causal_lm (masked or not), classification and segmentation (ignored pixels)."""
    from tests.tasks.test_tasks import segmentation

    seg = segmentation()
    torch.manual_seed(0)
    model = seg.build_model()
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(0, 3, (3, 16, 16), generator=g)
    mask[0, :8] = 255  # ignored pixels (segmentation.ignore_index's default)
    mask[2] = 255  # a sample without a labelled pixel
    batch = {
        "image": torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=g),
        "mask": mask,
        "valid": torch.tensor([True, True, False]),
    }
    loss, _ = seg.loss(model, batch)
    count = count_targets(seg, batch)
    assert count == 16 * 8 + 16 * 16  # the labelled pixels of the valid samples
    sums = seg.eval_metrics(model, batch)
    assert float(loss) * count == pytest.approx(float(sums["loss"]), rel=1e-5)
