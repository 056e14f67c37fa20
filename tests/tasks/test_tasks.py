"""The built-in tasks on hand-made decoded samples and batches (no loader, no processes)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.data.decode import SampleError
from hpctrain.data.index import ShardIndex, ShardInfo
from hpctrain.models import UNet, build_segmenter
from hpctrain.parallel.parallelize import find_blocks
from hpctrain.tasks.image_classification import (
    AP_BINS,
    ImageClassification,
    summarize_multi_label,
)
from hpctrain.tasks.segmentation import Segmentation, confusion_matrix, iou_and_accuracy
from hpctrain.tasks.task import divide_by_count, load_task

INDEX = ShardIndex(shards=(ShardInfo("a.tar", 10),), class_names=tuple("abcd"))
NO_CLASSES = ShardIndex(shards=(ShardInfo("a.tar", 10),))


def image(h: int = 20, w: int = 30) -> torch.Tensor:
    return torch.randint(0, 255, (3, h, w), dtype=torch.uint8)


def classification(*overrides: str) -> ImageClassification:
    task = load_task(load_config(None, ["model.image_size=16", *overrides]), INDEX)
    assert isinstance(task, ImageClassification)
    return task


# ---------------------------------------------------------------- image classification


def test_classification_reads_the_single_image_field_and_cls() -> None:
    task = classification()
    for field in ("jpg", "png", "img.jpg"):
        sample = {"key": "k1", field: image(), "cls": 2, "json": {"source": "x"}}
        out = task.eval_transform()(sample)
        assert set(out) == {"key", "image", "label"}
        assert out["image"].shape == (3, 16, 16) and out["label"] == 2
    # a target image beside the image does not make it ambiguous
    out = task.eval_transform()({"key": "k", "jpg": image(), "mask.png": image()[0], "cls": 1})
    assert out["image"].shape == (3, 16, 16)


def test_classification_grey_image_becomes_rgb() -> None:
    out = classification().eval_transform()({"key": "k", "pgm": image()[:1], "cls": 0})
    assert out["image"].shape == (3, 16, 16)


def test_classification_field_errors_name_the_key() -> None:
    transform = classification().train_transform()
    with pytest.raises(SampleError, match=r"'k7' has several image fields \(left.jpg, right.jpg\)"):
        transform({"key": "k7", "left.jpg": image(), "right.jpg": image(), "cls": 1})
    with pytest.raises(SampleError, match="'k8' has no image field"):
        transform({"key": "k8", "cls": 1})
    with pytest.raises(SampleError, match="'k9' has no label field 'cls'"):
        transform({"key": "k9", "jpg": image()})
    chosen = classification("classification.image_field=left.jpg").train_transform()
    sample = {"key": "k", "left.jpg": image(), "right.jpg": image(), "cls": 1}
    assert chosen(sample)["image"].shape == (3, 16, 16)
    with pytest.raises(SampleError, match="'k' has no image field 'left.jpg'"):
        chosen({"key": "k", "jpg": image(), "cls": 1})


@pytest.mark.parametrize("label", [4, -1, 99])
def test_label_outside_the_classes_is_a_sample_error(label: int) -> None:
    with pytest.raises(
        SampleError, match=rf"'bad': label {label} .* outside the model's 4 classes"
    ):
        classification().train_transform()({"key": "bad", "jpg": image(), "cls": label})


def test_horizontal_flip_is_configurable() -> None:
    """Left half dark, right half bright; crops keep the whole square image (scale 1)."""
    square = torch.zeros(3, 16, 16, dtype=torch.uint8)
    square[:, :, 8:] = 255

    def left_column_bright(*overrides: str) -> set[bool]:
        transform = classification("augment.scale_min=1", *overrides).train_transform()
        seen = set()
        for seed in range(20):
            torch.manual_seed(seed)
            out = transform({"key": "k", "jpg": square.clone(), "cls": 0})
            seen.add(bool(out["image"][0, 8, 0] > 128))
        return seen

    assert left_column_bright() == {False, True}
    assert left_column_bright("augment.hflip=false") == {False}


def test_inverted_crop_scale_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="augment.scale_min=0.9 is above augment.scale_max=0.5"):
        classification("augment.scale_min=0.9", "augment.scale_max=0.5")


@pytest.mark.parametrize("num_classes", [4, 5, 6])
def test_top5_accuracy_is_reported_only_above_five_classes(num_classes: int) -> None:
    """#43 item 15: with 5 classes or fewer every label is in the top 5 (val_top5 always 1)."""
    index = ShardIndex(shards=(ShardInfo("a.tar", 10),), class_names=tuple("abcdef")[:num_classes])
    task = load_task(load_config(None, ["model.image_size=16"]), index)
    model = task.build_model().eval()
    batch = {
        "image": torch.stack([image(16, 16) for _ in range(4)]),
        "label": torch.tensor([0, 1, 2, 3]),
        "valid": torch.ones(4, dtype=torch.bool),
    }
    with torch.no_grad():
        metrics = task.summarize(task.eval_metrics(model, batch))  # type: ignore[attr-defined]
    expected = {"loss", "accuracy", "top5"} if num_classes > 5 else {"loss", "accuracy"}
    assert set(metrics) == expected
    monitor = ["model.image_size=16", "checkpoint.monitor=val_top5"]
    if num_classes > 5:
        load_task(load_config(None, monitor), index)
    else:
        with pytest.raises(ConfigError, match=rf"monitor=val_top5: with {num_classes} classes"):
            load_task(load_config(None, monitor), index)


def test_multi_label_targets_from_json_or_npy() -> None:
    transform = classification("classification.multi_label=true").eval_transform()
    out = transform({"key": "k", "jpg": image(), "labels.json": [0, 3]})
    assert out["label"].tolist() == [1, 0, 0, 1] and out["label"].dtype == torch.uint8
    hot = np.array([0, 1, 1, 0], dtype=np.int64)
    assert transform({"key": "k", "jpg": image(), "npy": hot})["label"].tolist() == [0, 1, 1, 0]
    with pytest.raises(SampleError, match=r"'k': class ids \[4\]"):
        transform({"key": "k", "jpg": image(), "json": [1, 4]})
    with pytest.raises(SampleError, match=r"shape \[3\], expected \[4\]"):
        transform({"key": "k", "jpg": image(), "npy": np.ones(3)})
    with pytest.raises(SampleError, match="several multi-label target fields"):
        transform({"key": "k", "jpg": image(), "json": [1], "npy": hot})
    with pytest.raises(SampleError, match="not a list of class ids"):
        transform({"key": "k", "jpg": image(), "json": {"labels": [1]}})


def exact_average_precision(scores: list[float], positive: list[bool]) -> float:
    """AP as the mean precision at the rank of each positive (distinct scores)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    hits, total = 0, 0.0
    for rank, i in enumerate(order, start=1):
        if positive[i]:
            hits += 1
            total += hits / rank
    return total / max(1, sum(positive))


def test_multi_label_metrics_add_over_batches_and_match_exact_ap() -> None:
    """Scores in distinct histogram bins: binned AP equals exact AP; F1 at 0.5 by hand."""
    task = classification("classification.multi_label=true")
    torch.manual_seed(0)
    num_samples = 12
    # distinct bin centres per class, so no two samples share a bin
    probabilities = torch.stack(
        [(torch.randperm(AP_BINS)[:num_samples].double() + 0.5) / AP_BINS for _ in range(4)], 1
    )
    logits = torch.logit(probabilities).float()
    labels = (torch.rand(num_samples, 4) < 0.5).to(torch.uint8)
    labels[0] = 1  # every class has a positive
    valid = torch.ones(num_samples, dtype=torch.bool)
    model = lambda images: logits[: len(images)]  # noqa: E731 (the scores are the point)
    task._logits = lambda model, batch: batch["logits"]  # type: ignore[method-assign]

    def sums(lo: int, hi: int, pad: int = 0) -> dict[str, torch.Tensor]:
        batch = {
            "logits": torch.cat([logits[lo:hi], logits[:pad]]),
            "label": torch.cat([labels[lo:hi], 1 - labels[:pad]]),
            "valid": torch.cat([valid[lo:hi], torch.zeros(pad, dtype=torch.bool)]),
        }
        return task.eval_metrics(model, batch)  # type: ignore[arg-type]

    whole = sums(0, num_samples)
    halves = [sums(0, 5, pad=3), sums(5, num_samples, pad=2)]  # padding must not count
    added = {name: halves[0][name] + halves[1][name] for name in whole}
    assert summarize_multi_label(added) == pytest.approx(summarize_multi_label(whole))
    metrics = summarize_multi_label(whole)
    expected_ap = np.mean(
        [
            exact_average_precision(probabilities[:, c].tolist(), labels[:, c].bool().tolist())
            for c in range(4)
        ]
    )
    assert metrics["mAP"] == pytest.approx(expected_ap)
    predicted = probabilities >= 0.5
    positive = labels.bool()
    f1s = []
    for c in range(4):
        tp = int((predicted[:, c] & positive[:, c]).sum())
        fp = int((predicted[:, c] & ~positive[:, c]).sum())
        fn = int((~predicted[:, c] & positive[:, c]).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn))
    assert metrics["f1"] == pytest.approx(np.mean(f1s))
    assert task.summarize(whole) == metrics


def test_multi_label_loss_and_perfect_scores() -> None:
    task = classification("classification.multi_label=true")
    model = task.build_model()
    batch = {
        "image": torch.randint(0, 255, (3, 3, 16, 16), dtype=torch.uint8),
        "label": torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.uint8),
        "valid": torch.tensor([True, True, False]),
    }
    loss, _ = task.loss(model, batch)
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item())
    perfect = summarize_multi_label(
        {
            "loss": torch.tensor(0.0),
            "count": torch.tensor(2.0),
            "pos_hist": torch.zeros(4, AP_BINS).index_fill_(1, torch.tensor([AP_BINS - 1]), 1),
            "neg_hist": torch.zeros(4, AP_BINS).index_fill_(1, torch.tensor([0]), 1),
            "tp": torch.ones(4),
            "fp": torch.zeros(4),
            "fn": torch.zeros(4),
        }
    )
    assert perfect["mAP"] == 1.0 and perfect["f1"] == 1.0 and perfect["f1_micro"] == 1.0


def test_default_summarize_divides_scalars_and_refuses_tensors() -> None:
    assert divide_by_count({"loss": torch.tensor(6.0), "count": torch.tensor(3.0)}) == {"loss": 2.0}
    with pytest.raises(ValueError, match=r"'confusion' of shape \[2, 2\]: .* define summarize"):
        divide_by_count({"confusion": torch.zeros(2, 2), "count": torch.tensor(1.0)})


# ---------------------------------------------------------------- segmentation


def segmentation(*overrides: str) -> Segmentation:
    cfg = load_config(
        None, ["task=segmentation", "model.image_size=16", "model.num_classes=3", *overrides]
    )
    task = load_task(cfg, NO_CLASSES)
    assert isinstance(task, Segmentation)
    return task


def test_segmentation_needs_a_class_count() -> None:
    with pytest.raises(ConfigError, match="set model.num_classes"):
        load_task(load_config(None, ["task=segmentation"]), NO_CLASSES)


def test_paired_augmentation_moves_image_and_mask_together() -> None:
    """The image's red channel encodes the mask (class c ↔ 100·c): after any crop and flip
    they still agree pixel for pixel."""
    transform = segmentation().train_transform()
    mask = torch.zeros(40, 40, dtype=torch.uint8)
    mask[5:20, 10:35] = 1
    mask[25:38, 3:15] = 2
    mask[0:3, :] = 255  # unlabelled
    picture = torch.zeros(3, 40, 40, dtype=torch.uint8)
    picture[0] = torch.where(mask == 255, 250, mask * 100)
    for seed in range(10):
        torch.manual_seed(seed)
        out = transform({"key": "k", "img.jpg": picture.clone(), "mask.png": mask.clone()})
        assert out["image"].shape == (3, 16, 16) and out["mask"].shape == (16, 16)
        assert out["mask"].dtype == torch.uint8 and set(out) == {"key", "image", "mask"}
        # nearest for the mask, antialiased bilinear for the image: compare away from edges,
        # where the mask's 5x5 neighbourhood holds one class
        expected = torch.where(out["mask"] == 255, 250, out["mask"].int() * 100).float()
        window = expected[None, None]
        uniform = (
            torch.nn.functional.max_pool2d(window, 5, 1, 2)
            == -torch.nn.functional.max_pool2d(-window, 5, 1, 2)
        )[0, 0]
        uniform[[0, -1], :] = uniform[:, [0, -1]] = False  # the crop's edge: what lies beyond?
        assert uniform.sum() > 10
        difference = (out["image"][0].float() - expected).abs()[uniform]
        assert difference.max() < 30, seed


def test_mask_values_outside_the_classes_are_sample_errors() -> None:
    transform = segmentation().eval_transform()
    mask = torch.zeros(20, 30, dtype=torch.uint8)
    mask[0, 0] = 255  # ignore_index: fine
    assert transform({"key": "k", "jpg": image(), "mask.png": mask})["mask"].shape == (16, 16)
    mask[1, 1] = 3
    with pytest.raises(SampleError, match=r"'k': mask field 'mask.png' holds class ids \[3\]"):
        transform({"key": "k", "jpg": image(), "mask.png": mask})
    with pytest.raises(SampleError, match="not class ids"):
        transform({"key": "k", "jpg": image(), "mask.png": image()})  # a colour mask
    with pytest.raises(SampleError, match=r"mask \[10, 10\] and image \[20, 30\] differ"):
        transform({"key": "k", "jpg": image(), "mask.png": torch.zeros(10, 10, dtype=torch.uint8)})
    with pytest.raises(SampleError, match="'k' has no mask field"):
        transform({"key": "k", "jpg": image()})


def test_masks_from_npy_and_named_fields() -> None:
    transform = segmentation(
        "segmentation.image_field=left.png", "segmentation.mask_field=classes.npy"
    ).eval_transform()
    sample = {
        "key": "k",
        "left.png": image(),
        "right.png": image(),
        "classes.npy": np.full((20, 30), 2, dtype=np.int64),
    }
    assert transform(sample)["mask"].unique().tolist() == [2]


def test_confusion_matrix_iou_and_accuracy() -> None:
    targets = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 1]])
    predictions = torch.tensor([[0, 1, 1, 1], [2, 0, 0, 1]])
    labelled = targets != 255
    confusion = confusion_matrix(predictions, targets, labelled, 3)
    assert confusion.tolist() == [[1, 1, 0], [0, 3, 0], [1, 0, 1]]
    iou, accuracy = iou_and_accuracy(confusion.double())
    assert iou.tolist() == pytest.approx([1 / 3, 3 / 4, 1 / 2])
    assert accuracy == pytest.approx(5 / 7)


def test_segmentation_metrics_leave_out_padding_and_ignored_pixels() -> None:
    task = segmentation()
    model = task.build_model().eval().requires_grad_(False)
    images = torch.randint(0, 255, (2, 3, 16, 16), dtype=torch.uint8)
    masks = torch.randint(0, 3, (2, 16, 16), dtype=torch.uint8)
    masks[:, 0] = 255
    clean = task.eval_metrics(
        model, {"image": images, "mask": masks, "valid": torch.ones(2, dtype=torch.bool)}
    )
    padded = task.eval_metrics(
        model,
        {
            "image": torch.cat([images, images[:1]]),
            "mask": torch.cat([masks, masks[:1]]),
            "valid": torch.tensor([True, True, False]),
        },
    )
    assert torch.equal(clean["confusion"], padded["confusion"])
    assert int(clean["confusion"].sum()) == int(clean["pixels"]) == 2 * 15 * 16
    assert int(padded["count"]) == 2
    metrics = task.summarize({name: value.double() for name, value in padded.items()})
    assert set(metrics) == {"loss", "mIoU", "pixel_accuracy"}
    assert 0 <= metrics["mIoU"] <= 1 and 0 <= metrics["pixel_accuracy"] <= 1
    loss, values = task.loss(
        model.train().requires_grad_(True),
        {"image": images, "mask": masks, "valid": torch.tensor([True, False])},
    )
    loss.backward()
    assert math.isfinite(loss.item()) and 0 <= float(values["pixel_accuracy"]) <= 1


@pytest.mark.parametrize("size", [16, 21])
def test_unet_keeps_the_input_resolution(size: int) -> None:
    model = UNet(5)
    assert model(torch.randn(2, 3, size, size + 3)).shape == (2, 5, size, size + 3)
    assert len(find_blocks(model)) == 7  # 4 encoder + 3 decoder blocks, sharded one by one


def test_torchvision_segmentation_models_by_name() -> None:
    task = segmentation("model.name=lraspp_mobilenet_v3_large")
    model = task.build_model().eval()
    batch = {
        "image": torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8),
        "mask": torch.zeros(1, 32, 32, dtype=torch.uint8),
        "valid": torch.ones(1, dtype=torch.bool),
    }
    with torch.no_grad():
        assert task.eval_metrics(model, batch)["confusion"].shape == (3, 3)
    with pytest.raises(
        ConfigError, match="model.name='resnet18': not unet nor a torchvision segmentation"
    ):
        build_segmenter("resnet18", 3)


def test_model_names_checked_per_task_without_building() -> None:
    from hpctrain.tasks.task import check_model_name

    for task, name in [
        ("image_classification", ""),
        ("image_classification", "vit_tiny"),
        ("image_classification", "resnet18"),
        ("segmentation", "unet"),
        ("segmentation", "fcn_resnet50"),
        ("mypkg.tasks:Mine", "anything"),
    ]:
        check_model_name(task, name)
    with pytest.raises(ConfigError, match="model.name='unet': task image_classification takes"):
        check_model_name("image_classification", "unet")
    with pytest.raises(ConfigError, match="model.name='resnet18': task segmentation takes unet"):
        check_model_name("segmentation", "resnet18")


def test_a_one_class_index_says_a_classifier_needs_two_classes() -> None:
    one = ShardIndex(shards=(ShardInfo("a.tar", 10),), base_url="data/one", class_names=("star",))
    for overrides, shown in (([], "model.num_classes=0"), (["model.num_classes=1"], "=1")):
        with pytest.raises(
            ConfigError,
            match=rf"{shown}: a classifier needs at least 2 classes; the index data/one names "
            r"1 \('star'\)",
        ):
            load_task(load_config(None, overrides), one)
    with pytest.raises(ConfigError, match=r"=0: the index data/one names no classes; set model"):
        load_task(load_config(None, []), replace(one, class_names=()))


# ---------------------------------------------------------------- the optional hooks
def test_each_task_owns_its_summary_line() -> None:
    from hpctrain.tasks.task import summary_line

    record = {"val_loss": 0.12344, "val_accuracy": 0.9375, "val_top5": 1.0, "val_samples": 80}
    assert summary_line(classification(), record) == (
        "validation accuracy: 93.75% (top-5 100.00%, loss 0.1234, 80 samples)"
    )
    multi = {"val_loss": 0.5, "val_mAP": 0.25, "val_samples": 8}  # multi-label: no accuracy
    assert summary_line(classification(), multi) == "validation: loss 0.5000, mAP 0.2500, samples 8"
    segmentation = load_task(load_config(None, ["task=segmentation", "model.num_classes=3"]), INDEX)
    assert summary_line(segmentation, record).startswith("validation: loss 0.1234, accuracy")


def test_class_hooks_are_read_without_a_task_or_an_import() -> None:
    from hpctrain.models import build_classifier
    from hpctrain.tasks.task import check_model_name, model_card

    with pytest.raises(ConfigError, match="model.name='gpt-9t': task causal_lm takes gpt-tiny"):
        check_model_name("causal_lm", "gpt-9t")
    check_model_name("causal_lm", "gpt-125m")
    weights = build_classifier("small_cnn", 3, 16).state_dict()
    tree = {"task": "image_classification", "model": {"name": "small_cnn", "image_size": 16}}
    card = model_card(tree, weights, {"step": 1})
    assert card is not None and card["model"]["num_classes"] == 3 and "step" not in card
    assert model_card({**tree, "task": "segmentation"}, weights, {}) is None  # no hook
    assert model_card({**tree, "task": "not_installed.tasks:Mine"}, weights, {}) is None
