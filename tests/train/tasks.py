"""Tasks defined for tests: the custom-task MLP, instrumented."""

from __future__ import annotations

import os
from typing import Any

import torch
from examples.custom_task import Thumbnail, ThumbnailMLP
from torch import nn

# What the last in-process run saw (tests read these after the run returns).
SEEN: dict[str, Any] = {"anomaly": [], "transform_pids": set()}


class RecordingThumbnail(Thumbnail):
    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        SEEN["transform_pids"].add(os.getpid())
        return super().__call__(sample)


class RecordingMLP(ThumbnailMLP):
    """ThumbnailMLP that records whether anomaly detection is on and where samples load."""

    def train_transform(self) -> RecordingThumbnail:
        return RecordingThumbnail(jitter=True)

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        SEEN["anomaly"].append(torch.is_anomaly_enabled())
        return super().loss(model, batch)


class OverflowingMLP(ThumbnailMLP):
    """ThumbnailMLP whose loss is scaled so far up that every fp16 step overflows (skipped)."""

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, values = super().loss(model, batch)
        return loss * 1e30, values
