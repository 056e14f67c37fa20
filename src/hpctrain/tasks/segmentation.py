"""The built-in semantic segmentation task: an image and a class-id mask per sample.

A sample holds an image field (`segmentation.image_field`, or the sample's one non-target
image field: `jpg`, `png`, `img.jpg`...) and a mask field (`segmentation.mask_field`, or
its one target image field: `mask.png`, `seg.png`...). Masks are class ids per pixel: a
palette PNG's indices or a greyscale PNG's values (the default decoders keep them raw for
target fields), or an integer `npy` array [H, W]. Pixels equal to `segmentation.ignore_index`
(default 255) count in neither the loss nor the metrics; any other value outside the model's
classes is a `SampleError` raised in the loader worker (handled under `data.on_error`).

Augmentations are paired: the image and the mask are `torchvision.tv_tensors` (Image, Mask),
so one random crop and flip apply to both (the mask resized with nearest neighbours taken at
pixel centres, so that it stays aligned with the image: `resize_mask`).
Evaluation reports the loss per labelled pixel, mean IoU (over the classes present in the
targets or predictions) and pixel accuracy, from one confusion matrix summed over batches and
ranks (padded samples, `valid=False`, left out).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision import tv_tensors
from torchvision.transforms import v2

from hpctrain.config import Config, ConfigError
from hpctrain.data.decode import SampleError
from hpctrain.data.fieldnames import is_image_field, is_target_field
from hpctrain.data.index import ShardIndex
from hpctrain.models import build_segmenter, check_segmenter_name
from hpctrain.tasks.task import Sample
from hpctrain.tasks.vision import as_rgb, check_scale, find_field, image_field, normalize


def resize_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A class-id mask [..., H, W] resized with `nearest-exact` (pixel centres).

    torchvision's v2 kernels resize masks with `nearest` (the top-left source pixel of each
    output pixel), which puts the mask up to half an output pixel off the image they resize
    bilinearly: on 50 random crops of a two-shape mask, 3x as many pixels disagreed with
    the image as with `nearest-exact`.
    """
    flat = mask.reshape(-1, 1, *mask.shape[-2:])
    wide = flat if flat.dtype == torch.uint8 else flat.float()  # interpolate has no int32 kernel
    resized = F.interpolate(wide, size=size, mode="nearest-exact").to(mask.dtype)
    return resized.reshape(*mask.shape[:-2], *size)


class AlignedRandomResizedCrop(v2.RandomResizedCrop):
    """RandomResizedCrop whose masks are resized by `resize_mask` (aligned with the image)."""

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not isinstance(inpt, tv_tensors.Mask):
            return super().transform(inpt, params)
        top, left, height, width = (params[k] for k in ("top", "left", "height", "width"))
        crop = inpt.as_subclass(torch.Tensor)[..., top : top + height, left : left + width]
        return tv_tensors.wrap(resize_mask(crop, tuple(self.size)), like=inpt)


class AlignedResize(v2.Resize):
    """Resize of the short side to `size` whose masks are resized by `resize_mask`."""

    def __init__(self, size: int) -> None:
        super().__init__(size, antialias=True)
        self.short_side = size

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not isinstance(inpt, tv_tensors.Mask):
            return super().transform(inpt, params)
        height, width = inpt.shape[-2:]
        # torchvision's rule for the long side: int(size * long / short)
        if height <= width:
            size = (self.short_side, int(self.short_side * width / height))
        else:
            size = (int(self.short_side * height / width), self.short_side)
        return tv_tensors.wrap(resize_mask(inpt.as_subclass(torch.Tensor), size), like=inpt)


def mask_field(sample: Sample, configured: str = "") -> str:
    """The sample's mask: `configured`, or its one target image field (`mask.png`, `seg.png`)."""
    candidates = [k for k in sample if is_image_field(k) and is_target_field(k)]
    return find_field(sample, configured, "mask", candidates)


class SegmentationTransform:
    """Read and check the image and mask, then crop/flip (training) or resize (evaluation) both.

    Returns `{"key", "image": uint8 [3, S, S], "mask": [S, S]}`, the mask in `mask_dtype`
    (uint8 when every class id and the ignore index fit: 8x fewer bytes than int64 to move).
    """

    def __init__(
        self,
        size: int,
        *,
        train: bool,
        num_classes: int,
        ignore_index: int,
        image_field: str = "",
        mask_field: str = "",
        scale: tuple[float, float] = (0.5, 1.0),
        hflip: bool = True,
        with_mask: bool = True,
    ) -> None:
        self.num_classes = num_classes
        self.with_mask = with_mask  # False for predictions: the data may have no masks
        self.ignore_index = ignore_index
        self.image_field = image_field
        self.mask_field = mask_field
        self.mask_dtype = torch.uint8 if max(num_classes - 1, ignore_index) <= 255 else torch.int32
        steps: list[Any]
        if train:
            steps = [AlignedRandomResizedCrop(size, scale=scale, antialias=True)]
            if hflip:
                steps.append(v2.RandomHorizontalFlip())
        else:
            steps = [AlignedResize(size), v2.CenterCrop(size)]
        self.transform = v2.Compose(steps)

    def __call__(self, sample: Sample) -> Sample:
        key = sample["key"]
        name = image_field(sample, self.image_field)
        image = as_rgb(sample[name], key, name)
        if not self.with_mask:
            resized = self.transform(tv_tensors.Image(image))
            return {"key": key, "image": resized.as_subclass(torch.Tensor)}
        mask = self.read_mask(sample)
        if mask.shape != image.shape[1:]:
            raise SampleError(
                f"sample {key!r}: mask {list(mask.shape)} and image {list(image.shape[1:])} "
                "differ in size"
            )
        image, mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
        return {
            "key": key,
            "image": image.as_subclass(torch.Tensor),
            "mask": mask.as_subclass(torch.Tensor),
        }

    def read_mask(self, sample: Sample) -> torch.Tensor:
        """The mask as [H, W] class ids in `mask_dtype`; values out of range are a SampleError."""
        key = sample["key"]
        name = mask_field(sample, self.mask_field)
        mask = sample[name]
        if isinstance(mask, np.ndarray):
            mask = torch.from_numpy(mask)
        if not isinstance(mask, torch.Tensor):
            raise SampleError(
                f"sample {key!r}: mask field {name!r} is a {type(mask).__name__}, not an array"
            )
        if mask.ndim == 3 and mask.shape[0] == 1:
            mask = mask[0]
        if mask.ndim != 2 or mask.is_floating_point() or mask.dtype == torch.bool:
            raise SampleError(
                f"sample {key!r}: mask field {name!r} is {mask.dtype} {list(mask.shape)}, not "
                "class ids [H, W] (a colour PNG? save masks as palette or greyscale images)"
            )
        wide = mask.to(torch.int64)  # uint16 masks have few ops; compare in int64
        bad = (wide >= self.num_classes) & (wide != self.ignore_index)
        if bad.any():
            values = sorted(set(wide[bad].unique().tolist()))[:5]
            raise SampleError(
                f"sample {key!r}: mask field {name!r} holds class ids {values} outside the "
                f"model's {self.num_classes} classes (segmentation.ignore_index="
                f"{self.ignore_index} is ignored)"
            )
        if (wide < 0).any():
            raise SampleError(f"sample {key!r}: mask field {name!r} holds negative class ids")
        return wide.to(self.mask_dtype)


class Segmentation:
    """Per-pixel cross-entropy; evaluation mean IoU and pixel accuracy."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.cfg = cfg
        self.options = cfg.segmentation
        self.scale = check_scale(cfg.augment.scale_min, cfg.augment.scale_max)
        num_classes = cfg.model.num_classes or len(index.class_names)
        if num_classes < 2:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes}: segmentation needs the number of "
                f"classes (the index {index.base_url or '(pattern)'} names none); set model.num_classes"
            )
        self.num_classes = num_classes
        self.ignore_index = self.options.ignore_index

    @staticmethod
    def check_model_name(name: str, image_size: int | None = None) -> None:
        """`unet` or a torchvision segmentation model (see `check_segmenter_name`)."""
        if name:
            check_segmenter_name(name)

    @staticmethod
    def eval_metric_names(cfg: Config) -> tuple[str, ...]:
        """What `summarize` reports."""
        return ("loss", "mIoU", "pixel_accuracy")

    def build_model(self) -> nn.Module:
        return build_segmenter(self.cfg.model.name or "unet", self.num_classes)

    def _transform(self, train: bool, with_mask: bool = True) -> SegmentationTransform:
        return SegmentationTransform(
            self.cfg.model.image_size,
            train=train,
            num_classes=self.num_classes,
            ignore_index=self.ignore_index,
            image_field=self.options.image_field,
            mask_field=self.options.mask_field,
            scale=self.scale,
            hflip=self.cfg.augment.hflip,
            with_mask=with_mask,
        )

    def train_transform(self) -> SegmentationTransform:
        return self._transform(train=True)

    def eval_transform(self) -> SegmentationTransform:
        return self._transform(train=False)

    def predict_transform(self) -> SegmentationTransform:
        return self._transform(train=False, with_mask=False)

    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Per sample: the predicted class-id mask at the model's input size (`mask.png`: a
        PNG member in shards, run-length encoded in JSONL) and the classes it holds."""
        predicted = self._logits(model, batch).argmax(dim=1)
        dtype = torch.uint8 if self.num_classes <= 256 else torch.int32
        masks = predicted.to(dtype).cpu()
        return [{"mask.png": mask, "classes": mask.unique().tolist()} for mask in masks]

    def _logits(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        out = model(normalize(batch["image"], self.cfg.model.channels_last))
        if isinstance(out, dict):  # torchvision's segmentation models: {"out": logits, ...}
            out = out["out"]
        logits: torch.Tensor = out
        return logits.float()

    def _labelled(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets as int64 and the pixels that count: labelled pixels of valid samples."""
        targets = batch["mask"].long()
        labelled = (targets != self.ignore_index) & batch["valid"][:, None, None]
        return targets, labelled

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(model, batch)
        targets, labelled = self._labelled(batch)
        weights = labelled.float()
        losses = F.cross_entropy(logits, targets, ignore_index=self.ignore_index, reduction="none")
        num_pixels = weights.sum().clamp(min=1)
        loss = (losses * weights).sum() / num_pixels
        with torch.no_grad():
            correct = (logits.argmax(dim=1) == targets).float()
            pixel_accuracy = (correct * weights).sum() / num_pixels
        return loss, {"pixel_accuracy": pixel_accuracy}

    def count_targets(self, batch: dict[str, Any]) -> int:
        """The labelled pixels of valid samples, which `loss` averages over (the trainer
        weighs micro-batches and ranks by it). Counted on the host for every micro-batch,
        with numpy: 3.5 ms for 16 masks of 512 x 512 on the 2-core development machine,
        where torch's comparison and count took 24 ms (its bool sum alone 87 ms)."""
        masks = batch["mask"].numpy()[batch["valid"].numpy()]
        return int(np.count_nonzero(masks != self.ignore_index))

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = self._logits(model, batch)
        targets, labelled = self._labelled(batch)
        losses = F.cross_entropy(logits, targets, ignore_index=self.ignore_index, reduction="none")
        return {
            "loss": (losses * labelled.float()).sum(),
            "pixels": labelled.sum(),
            "count": batch["valid"].sum(),
            "confusion": confusion_matrix(
                logits.argmax(dim=1), targets, labelled, self.num_classes
            ),
        }

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Loss per labelled pixel, mean IoU and pixel accuracy over everything evaluated."""
        confusion = sums["confusion"].double()
        iou, pixel_accuracy = iou_and_accuracy(confusion)
        metrics = {
            # no labelled pixel at all: no loss to report, not a perfect 0.0
            "loss": float(sums["loss"]) / float(sums["pixels"]) if sums["pixels"] else math.nan,
            "mIoU": float(iou.nanmean()) if not iou.isnan().all() else 0.0,
            "pixel_accuracy": pixel_accuracy,
        }
        return metrics


def confusion_matrix(
    predictions: torch.Tensor, targets: torch.Tensor, labelled: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """[num_classes, num_classes] int64 counts, row = target class, column = predicted class,
    over the `labelled` pixels only."""
    index = (targets[labelled] * num_classes + predictions[labelled]).flatten()
    counts = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=predictions.device)
    # scatter_add_, not bincount: bincount has no deterministic CUDA kernel
    counts.scatter_add_(0, index, torch.ones_like(index))
    return counts.view(num_classes, num_classes)


def iou_and_accuracy(confusion: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-class IoU (NaN for a class in neither targets nor predictions) and pixel accuracy."""
    hits = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - hits
    iou = torch.where(union > 0, hits / union.clamp(min=1), torch.full_like(hits, float("nan")))
    total = float(confusion.sum())
    return iou, float(hits.sum()) / total if total else 0.0
