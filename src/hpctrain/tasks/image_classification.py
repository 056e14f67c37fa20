"""The built-in image classification task: one label (cross-entropy) or several (BCE).

A sample is read per the general sample contract (`hpctrain.data.decode`): its image field
(`classification.image_field`, or the sample's one non-target image field: `jpg`, `png`,
`img.jpg`...) and its target: the `cls` int for one label, or with
`classification.multi_label` a `json` list of class ids or an `npy` multi-hot vector. Shards
made by `hpctrain convert` from an image folder (`KEY.jpg`, `KEY.cls`, `KEY.json`) read as
they are. A label outside the model's classes is a `SampleError` raised in the loader worker
(handled under `data.on_error`), never a device-side assert.

Single label: evaluation reports loss, top-1 and top-5 accuracy (top-5 only with more than 5
classes: with 5 or fewer it is always 1, and `checkpoint.monitor=val_top5` is refused). Multi-label: loss, mAP
(average precision per class from score histograms, averaged over classes with positives),
and F1 at a 0.5 threshold (macro over classes, and micro): every one computed from sums that
add over batches and ranks (`summarize`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from hpctrain.config import Config, ConfigError
from hpctrain.data.decode import SampleError
from hpctrain.data.fieldnames import last_extension
from hpctrain.data.index import ShardIndex
from hpctrain.data.mixture_index import describe
from hpctrain.models import build_classifier, check_classifier_name
from hpctrain.tasks.classes import checkpoint_class_names
from hpctrain.tasks.task import Sample, masked_mean, validation_line
from hpctrain.tasks.vision import (
    MEAN,
    STD,
    as_rgb,
    check_scale,
    find_field,
    image_field,
    normalize,
)

# Score histogram bins per class for mAP: the precision/recall curve is read at 100 score
# thresholds (binned AP, as torchmetrics' `thresholds=`), so the sums have a fixed size
# and add over batches and ranks.
AP_BINS = 100


class ClassificationTransform:
    """Read the image and target fields, check the target, crop (and flip) the image.

    Training: RandomResizedCrop with `augment.scale_min/max` and, when `augment.hflip`,
    a random horizontal flip; evaluation (`train=False`): resize the short side and
    center-crop, deterministic. Returns `{"key", "image": uint8 [3, S, S], "label"}`: an int,
    or a uint8 multi-hot vector [num_classes] for multi-label tasks.
    """

    def __init__(
        self,
        size: int,
        *,
        train: bool,
        num_classes: int,
        image_field: str = "",
        target_field: str = "",
        multi_label: bool = False,
        scale: tuple[float, float] = (0.5, 1.0),
        hflip: bool = True,
        with_target: bool = True,
    ) -> None:
        self.num_classes = num_classes
        self.with_target = with_target  # False for predictions: the data may have no labels
        self.image_field = image_field
        self.target_field = target_field
        self.multi_label = multi_label
        steps: list[Any]
        if train:
            steps = [v2.RandomResizedCrop(size, scale=scale, antialias=True)]
            if hflip:
                steps.append(v2.RandomHorizontalFlip())
        else:
            steps = [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        self.transform = v2.Compose(steps)

    def __call__(self, sample: Sample) -> Sample:
        key = sample["key"]
        name = image_field(sample, self.image_field)
        image = self.transform(as_rgb(sample[name], key, name))
        if not self.with_target:
            return {"key": key, "image": image}
        label = self.multi_hot(sample) if self.multi_label else self.label(sample)
        return {"key": key, "image": image, "label": label}

    def label(self, sample: Sample) -> int:
        key = sample["key"]
        name = self.target_field or "cls"
        if name not in sample:
            fields = ", ".join(sorted(k for k in sample if k != "key"))
            raise SampleError(f"sample {key!r} has no label field {name!r} (fields: {fields})")
        label = sample[name]
        if isinstance(label, bool) or not isinstance(label, int):
            raise SampleError(f"sample {key!r}: label field {name!r} is not an integer: {label!r}")
        if not 0 <= label < self.num_classes:
            raise SampleError(
                f"sample {key!r}: label {label} (field {name!r}) is outside the model's "
                f"{self.num_classes} classes [0, {self.num_classes - 1}]"
            )
        return label

    def multi_hot(self, sample: Sample) -> torch.Tensor:
        """The target as a uint8 multi-hot [num_classes] (4-8x fewer bytes than float to move)."""
        key = sample["key"]
        candidates = [k for k in sample if last_extension(k) in ("json", "npy")]
        name = find_field(sample, self.target_field, "multi-label target", candidates)
        value = sample[name]
        if isinstance(value, list):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                raise SampleError(
                    f"sample {key!r}: field {name!r} is not a list of class ids: {value!r}"
                )
            bad = [i for i in value if not 0 <= i < self.num_classes]
            if bad:
                raise SampleError(
                    f"sample {key!r}: class ids {bad} (field {name!r}) are outside the model's "
                    f"{self.num_classes} classes"
                )
            target = torch.zeros(self.num_classes, dtype=torch.uint8)
            target[value] = 1
            return target
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            if value.shape != (self.num_classes,):
                raise SampleError(
                    f"sample {key!r}: multi-hot field {name!r} has shape {list(value.shape)}, "
                    f"expected [{self.num_classes}]"
                )
            if not ((value == 0) | (value == 1)).all():
                raise SampleError(
                    f"sample {key!r}: multi-hot field {name!r} holds values other than 0 and 1"
                )
            return value.to(torch.uint8)
        raise SampleError(
            f"sample {key!r}: field {name!r} is a {type(value).__name__}, not a list of class ids "
            "(json) or a multi-hot vector (npy)"
        )


class ImageClassification:
    """Classification of one image per sample: single label (top-1/top-5) or multi-label (mAP/F1)."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.cfg = cfg
        self.options = cfg.classification
        self.scale = check_scale(cfg.augment.scale_min, cfg.augment.scale_max)
        num_classes = cfg.model.num_classes or len(index.class_names)
        where = index.base_url or describe(cfg.data.train)
        if not index.class_names and num_classes < 2:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes}: the index {where} names no classes; set "
                "model.num_classes (a classifier needs at least 2 classes)"
            )
        if num_classes < 2:
            names = ", ".join(repr(c) for c in index.class_names)
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes}: a classifier needs at least 2 classes; the "
                f"index {where} names {len(index.class_names)} ({names}): add a folder per "
                "class and convert again"
            )
        if num_classes < len(index.class_names):  # a label would index past the model's output
            raise ConfigError(
                f"model.num_classes={num_classes}: the index {where} names {len(index.class_names)} classes"
            )
        if cfg.checkpoint.monitor == "val_top5" and not has_top5(num_classes):
            raise ConfigError(
                f"checkpoint.monitor=val_top5: with {num_classes} classes every label is among "
                "the top 5, so top-5 accuracy is not reported; monitor val_accuracy"
            )
        self.num_classes = num_classes
        self.class_names = tuple(index.class_names)

    @staticmethod
    def check_model_name(name: str, image_size: int | None = None) -> None:
        """`small_cnn`, `vit_tiny` or a torchvision classifier (see `check_classifier_name`)."""
        if name:
            check_classifier_name(name, image_size)

    @staticmethod
    def eval_metric_names(cfg: Config) -> tuple[str, ...]:
        """What `summarize` reports: top-1 and top-5 accuracy, or mAP and F1 (multi-label)."""
        if cfg.classification.multi_label:
            return ("loss", "mAP", "f1", "f1_micro")
        return ("loss", "accuracy", "top5")

    @staticmethod
    def model_card(
        tree: dict[str, Any], weights: dict[str, torch.Tensor], manifest: dict[str, Any]
    ) -> dict[str, Any] | None:
        """See `classifier_card`."""
        return classifier_card(tree, weights, manifest)

    def build_model(self) -> nn.Module:
        name = self.cfg.model.name or "small_cnn"
        return build_classifier(name, self.num_classes, self.cfg.model.image_size)

    def _transform(self, train: bool, with_target: bool = True) -> ClassificationTransform:
        return ClassificationTransform(
            self.cfg.model.image_size,
            train=train,
            num_classes=self.num_classes,
            image_field=self.options.image_field,
            target_field=self.options.target_field,
            multi_label=self.options.multi_label,
            scale=self.scale,
            hflip=self.cfg.augment.hflip,
            with_target=with_target,
        )

    def train_transform(self) -> ClassificationTransform:
        return self._transform(train=True)

    def eval_transform(self) -> ClassificationTransform:
        return self._transform(train=False)

    def predict_transform(self) -> ClassificationTransform:
        return self._transform(train=False, with_target=False)

    def class_name(self, label: int) -> str:
        return self.class_names[label] if label < len(self.class_names) else str(label)

    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Per sample: the top class and the top-5 with names and probabilities (softmax);
        multi-label: the classes at probability >= 0.5 and every class's probability."""
        logits = self._logits(model, batch)
        if self.options.multi_label:
            outputs = []
            for row in torch.sigmoid(logits).cpu().tolist():
                labels = [i for i, p in enumerate(row) if p >= 0.5]
                outputs.append(
                    {
                        "labels": labels,
                        "classes": [self.class_name(i) for i in labels],
                        "probabilities": [round(p, 6) for p in row],
                    }
                )
            return outputs
        probabilities = torch.softmax(logits, dim=1)
        top = probabilities.topk(min(5, logits.shape[1]), dim=1)
        outputs = []
        for values, labels in zip(
            top.values.cpu().tolist(), top.indices.cpu().tolist(), strict=True
        ):
            top_k = [
                {"label": label, "class": self.class_name(label), "probability": round(p, 6)}
                for p, label in zip(values, labels, strict=True)
            ]
            outputs.append({**top_k[0], "top_k": top_k})
        return outputs

    def _logits(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits: torch.Tensor = model(normalize(batch["image"], self.cfg.model.channels_last))
        return logits.float()  # losses and scores in fp32 under autocast too

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(model, batch)
        labels = batch["label"]
        valid = batch["valid"]
        if self.options.multi_label:
            targets = labels.float()
            per_sample = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
            loss = masked_mean(per_sample.mean(dim=1), valid)
            return loss, {}
        loss = masked_mean(F.cross_entropy(logits, labels, reduction="none"), valid)
        with torch.no_grad():
            accuracy = masked_mean((logits.argmax(dim=1) == labels).float(), valid)
        return loss, {"accuracy": accuracy}

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = self._logits(model, batch)
        if self.options.multi_label:
            return multi_label_sums(logits, batch["label"], batch["valid"])
        labels = batch["label"]
        valid = batch["valid"].float()
        losses = F.cross_entropy(logits, labels, reduction="none")
        sums = {"loss": (losses * valid).sum(), "count": valid.sum()}
        if not has_top5(logits.shape[1]):
            top1 = (logits.argmax(dim=1) == labels).float()
            return {**sums, "accuracy": (top1 * valid).sum()}
        topk = logits.topk(5, dim=1).indices
        top1 = (topk[:, 0] == labels).float()
        top5 = (topk == labels[:, None]).any(dim=1).float()
        return {**sums, "accuracy": (top1 * valid).sum(), "top5": (top5 * valid).sum()}

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Final metrics from the sums over all batches and ranks."""
        if self.options.multi_label:
            return summarize_multi_label(sums)
        count = max(1.0, float(sums["count"]))
        names = ("loss", "accuracy", "top5") if "top5" in sums else ("loss", "accuracy")
        return {name: float(sums[name]) / count for name in names}

    @staticmethod
    def summary_line(record: dict[str, Any]) -> str:
        """`validation accuracy: 93.75% (top-5 ..., loss ..., N samples)`; multi-label: every
        metric (`validation_line`)."""
        if "val_accuracy" not in record or "val_loss" not in record:
            return validation_line(record)
        top5 = f"top-5 {record['val_top5']:.2%}, " if "val_top5" in record else ""
        return (
            f"validation accuracy: {record['val_accuracy']:.2%} "
            f"({top5}loss {record['val_loss']:.4f}, {record['val_samples']} samples)"
        )


def has_top5(num_classes: int) -> bool:
    """Whether top-5 accuracy says anything: with 5 classes or fewer it is always 1."""
    return num_classes > 5


def classifier_card(
    tree: dict[str, Any], weights: dict[str, torch.Tensor], manifest: dict[str, Any]
) -> dict[str, Any] | None:
    """What rebuilds a built-in classification model for these weights, or None.

    The number of classes is that of the weights (`model.num_classes: 0` took it from the
    index); a model built from the card is checked to have exactly the weights' names and
    shapes (None when it has not: a changed architecture).
    """
    model_cfg = tree.get("model") or {}
    name = str(model_cfg.get("name") or "small_cnn")  # the task's default model
    image_size = int(model_cfg.get("image_size", 64))
    shapes = {key: tuple(value.shape) for key, value in weights.items()}

    def built_shapes(num_classes: int) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            model = build_classifier(name, num_classes, image_size)
        return {key: tuple(value.shape) for key, value in model.state_dict().items()}

    # The classifier's output layer is what depends on the number of classes: build with one
    # class and read the number from the weights where the shapes differ.
    probe = built_shapes(1)
    differing = [shapes[k][0] for k in shapes if k in probe and probe[k] != shapes[k]]
    num_classes = differing[0] if differing else 1
    if built_shapes(num_classes) != shapes:
        return None
    return {
        "task": "image_classification",
        "model": {
            "name": name,
            "num_classes": num_classes,
            "image_size": image_size,
            "channels_last": bool(model_cfg.get("channels_last", False)),
        },
        # the training index's, as the checkpoint stores them (empty: an older checkpoint)
        "class_names": list(checkpoint_class_names(manifest)),
        # logits: softmax over classes, or with multi_label a sigmoid per class
        "multi_label": bool((tree.get("classification") or {}).get("multi_label", False)),
        "input": {
            "layout": "NCHW RGB, resized (short side) and center-cropped to image_size",
            "scale": "uint8 values / 255",
            "mean": list(MEAN),
            "std": list(STD),
        },
        "versions": manifest.get("versions", {}),
        "rebuild": (
            "from hpctrain.models import build_classifier; "
            "model = build_classifier(name, num_classes, image_size)"
        ),
    }


def multi_label_sums(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Additive evaluation sums of a multi-label batch (padded samples, `valid=False`, left out).

    `pos_hist`/`neg_hist` [C, AP_BINS]: how many positive/negative (sample, class) pairs scored
    in each sigmoid bin; `tp`/`fp`/`fn` [C] at a 0.5 threshold; `loss` and `count`.
    """
    num_classes = logits.shape[1]
    targets = labels.float()
    weights = valid.float()[:, None]
    scores = torch.sigmoid(logits)
    bins = (scores * AP_BINS).long().clamp_(max=AP_BINS - 1)
    flat = (bins + torch.arange(num_classes, device=bins.device)[None, :] * AP_BINS).flatten()
    pos = weights * targets
    neg = weights * (1 - targets)
    size = num_classes * AP_BINS
    pos_hist = torch.zeros(size, device=logits.device).scatter_add_(0, flat, pos.flatten())
    neg_hist = torch.zeros(size, device=logits.device).scatter_add_(0, flat, neg.flatten())
    predicted = (scores >= 0.5).float()
    losses = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(dim=1)
    return {
        "loss": (losses * valid.float()).sum(),
        "count": valid.float().sum(),
        "pos_hist": pos_hist.view(num_classes, AP_BINS),
        "neg_hist": neg_hist.view(num_classes, AP_BINS),
        "tp": (predicted * pos).sum(dim=0),
        "fp": (predicted * neg).sum(dim=0),
        "fn": ((1 - predicted) * pos).sum(dim=0),
    }


def summarize_multi_label(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """`loss`, `mAP`, `f1` (macro) and `f1_micro` from `multi_label_sums` added up.

    AP of a class: the sum over thresholds (bin edges, high to low) of precision × the recall
    gained there; averaged over the classes that have positives. Macro F1 averages over the
    classes that have a positive or a prediction.
    """
    count = max(1.0, float(sums["count"]))
    pos = sums["pos_hist"].double().flip(dims=[1]).cumsum(dim=1)  # TP at each threshold
    neg = sums["neg_hist"].double().flip(dims=[1]).cumsum(dim=1)  # FP at each threshold
    positives = pos[:, -1]
    precision = pos / (pos + neg).clamp(min=1)
    recall = pos / positives[:, None].clamp(min=1)
    recall_gain = torch.diff(recall, dim=1, prepend=torch.zeros_like(recall[:, :1]))
    ap = (precision * recall_gain).sum(dim=1)
    has_positives = positives > 0
    mean_ap = float(ap[has_positives].mean()) if has_positives.any() else 0.0
    tp, fp, fn = (sums[name].double() for name in ("tp", "fp", "fn"))
    denominator = 2 * tp + fp + fn
    seen = denominator > 0
    f1 = float((2 * tp[seen] / denominator[seen]).mean()) if seen.any() else 0.0
    f1_micro = float(2 * tp.sum() / denominator.sum().clamp(min=1))
    return {"loss": float(sums["loss"]) / count, "mAP": mean_ap, "f1": f1, "f1_micro": f1_micro}
