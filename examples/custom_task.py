"""A custom task: a tiny MLP that classifies 16x16 grey thumbnails.

Use it with any image-folder shards:
    hpctrain train configs/demo.yaml task=examples.custom_task:ThumbnailMLP task_options.hidden=64

(run from the repository root, so that `examples` is importable, or put the module in your package).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.tasks.task import masked_mean
from hpctrain.tasks.vision import image_field


class Thumbnail:
    """Resize to 16x16 and add a random brightness jitter (seeded per sample by hpctrain)."""

    def __init__(self, jitter: bool) -> None:
        self.jitter = jitter
        self.resize = v2.Resize((16, 16), antialias=True)

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        # The decoded sample holds one field per tar member (`jpg` or `png`, `cls`, `json`,
        # ...) and its `key`; return only what the batch needs.
        image = self.resize(sample[image_field(sample)])
        if self.jitter:
            factor = 0.8 + 0.4 * torch.rand(())
            image = (image.float() * factor).clamp(0, 255).to(torch.uint8)
        return {"key": sample["key"], "image": image, "label": sample["cls"]}


class ThumbnailMLP:
    """The Task protocol, implemented without subclassing anything."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.num_classes = cfg.model.num_classes or len(index.class_names)
        self.hidden = int(cfg.task_options.get("hidden", 128))

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 16, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.num_classes),
        )

    def train_transform(self) -> Thumbnail:
        return Thumbnail(jitter=True)

    def eval_transform(self) -> Thumbnail:
        return Thumbnail(jitter=False)

    def _logits(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        grey = batch["image"].float().mean(dim=1) / 255.0 - 0.5  # uint8 arrives on the device
        return model(grey)

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self._logits(model, batch)
        valid = batch["valid"]  # False for padding/fillers: keep them out of the loss
        loss = masked_mean(F.cross_entropy(logits, batch["label"], reduction="none"), valid)
        return loss, {"accuracy": masked_mean((logits.argmax(1) == batch["label"]).float(), valid)}

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = self._logits(model, batch)
        valid = batch["valid"].float()
        correct = (logits.argmax(1) == batch["label"]).float()
        losses = F.cross_entropy(logits, batch["label"], reduction="none")
        return {
            "loss": (losses * valid).sum(),
            "accuracy": (correct * valid).sum(),
            "count": valid.sum(),
        }
