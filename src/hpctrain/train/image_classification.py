"""The built-in image classification task: torchvision models by name, or a small CNN for CPUs."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from hpctrain.config import Config, ConfigError
from hpctrain.data.index import ShardIndex
from hpctrain.train.task import masked_mean

# ImageNet statistics; images arrive as uint8 and are normalized on the device.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class SmallCNN(nn.Module):
    """Four conv blocks and a linear head: trains in minutes on a CPU at 32–64 px."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        channels = [3, width, 2 * width, 4 * width, 4 * width]
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2) if i < 3 else nn.Identity(),
            )
            for i, (cin, cout) in enumerate(itertools.pairwise(channels))
        )
        self.head = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def vit_tiny(num_classes: int, image_size: int) -> nn.Module:
    """A DeiT-Tiny-sized ViT (192 wide, 12 blocks, 3 heads): torchvision's VisionTransformer.

    Patches of 16 px from 128 px up (196 tokens at 224 px), 4 px below (64 tokens at 32 px,
    as CIFAR ViTs do), so it also trains on a CPU at small sizes.
    """
    from torchvision.models.vision_transformer import VisionTransformer

    patch_size = 16 if image_size >= 128 else 4
    if image_size % patch_size:
        raise ConfigError(
            f"model.image_size={image_size}: vit_tiny needs a multiple of its {patch_size} px patches"
        )
    return VisionTransformer(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=12,
        num_heads=3,
        hidden_dim=192,
        mlp_dim=768,
        num_classes=num_classes,
    )


def build_classifier(name: str, num_classes: int, image_size: int = 224) -> nn.Module:
    """`small_cnn`, `vit_tiny` or any torchvision classification model, randomly initialised.

    No pretrained weights: compute nodes have no internet. Load weights from a checkpoint instead.
    `image_size` matters to ViTs only (their position embeddings have one entry per patch).
    """
    if name == "small_cnn":
        return SmallCNN(num_classes)
    if name == "vit_tiny":
        return vit_tiny(num_classes, image_size)
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name!r}: not small_cnn, vit_tiny nor a torchvision model (e.g. resnet18, resnet50, vit_b_16)"
        )
    if name.startswith("vit_"):
        return torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, image_size=image_size
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


class TrainTransform:
    """Random resized crop + horizontal flip on uint8 tensors (tensor-first: faster than PIL)."""

    def __init__(self, size: int) -> None:
        self.transform = v2.Compose(
            [
                v2.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True),
                v2.RandomHorizontalFlip(),
            ]
        )

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        sample["image"] = self.transform(sample["image"])
        return sample


class EvalTransform:
    """Resize the short side then center-crop, deterministic."""

    def __init__(self, size: int) -> None:
        self.transform = v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        sample["image"] = self.transform(sample["image"])
        return sample


_STATS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std (0-255 scale) on `device`, made once: a `torch.tensor(list, device=cuda)`
    per step is a blocking host-to-device copy."""
    if device not in _STATS:
        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        _STATS[device] = (mean.to(device), std.to(device))
    return _STATS[device]


def normalize(images: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 NCHW → float normalized with the ImageNet statistics, on the images' device."""
    mean, std = _stats(images.device)
    x = (images.float() - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


class ImageClassification:
    """Cross-entropy classification with top-1/top-5 accuracy."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.cfg = cfg
        num_classes = cfg.model.num_classes or len(index.class_names)
        if num_classes < 2:
            raise ConfigError(
                f"model.num_classes=0: the index {index.base_url or '(pattern)'} names no classes; set model.num_classes"
            )
        if num_classes < len(index.class_names):  # a label would index past the model's output
            raise ConfigError(
                f"model.num_classes={num_classes}: the index {index.base_url or '(pattern)'} names {len(index.class_names)} classes"
            )
        self.num_classes = num_classes

    def build_model(self) -> nn.Module:
        return build_classifier(self.cfg.model.name, self.num_classes, self.cfg.model.image_size)

    def train_transform(self) -> TrainTransform:
        return TrainTransform(self.cfg.model.image_size)

    def eval_transform(self) -> EvalTransform:
        return EvalTransform(self.cfg.model.image_size)

    def _logits(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits: torch.Tensor = model(normalize(batch["image"], self.cfg.model.channels_last))
        return logits

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(model, batch)
        labels = batch["label"]
        valid = batch["valid"]
        loss = masked_mean(F.cross_entropy(logits.float(), labels, reduction="none"), valid)
        with torch.no_grad():
            accuracy = masked_mean((logits.argmax(dim=1) == labels).float(), valid)
        return loss, {"accuracy": accuracy}

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = self._logits(model, batch).float()
        labels = batch["label"]
        valid = batch["valid"].float()
        losses = F.cross_entropy(logits, labels, reduction="none")
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices
        top1 = (topk[:, 0] == labels).float()
        top5 = (topk == labels[:, None]).any(dim=1).float()
        return {
            "loss": (losses * valid).sum(),
            "accuracy": (top1 * valid).sum(),
            "top5": (top5 * valid).sum(),
            "count": valid.sum(),
        }
