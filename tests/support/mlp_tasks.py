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


class HookedMLP(ThumbnailMLP):
    """ThumbnailMLP with all three optional hooks; each leaves a trace the batch or the
    evaluation record carries back (workers run in other processes)."""

    def decode(self, key: str, members: dict[str, Any]) -> dict[str, Any]:
        from hpctrain.data.decode import decode_sample

        sample = decode_sample(key, members)
        sample["num_members"] = len(members)  # jpg or png, and cls
        return sample

    def train_transform(self) -> Thumbnail:
        return KeepMembers(jitter=True)

    def eval_transform(self) -> Thumbnail:
        return KeepMembers(jitter=False)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "key": [s["key"] for s in samples],
            "image": torch.stack([s["image"] for s in samples]),
            "label": torch.tensor([s["label"] for s in samples]),
            "num_members": torch.tensor([s["num_members"] for s in samples]),
            "collated_by": "HookedMLP",
        }

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch["collated_by"] == "HookedMLP", batch.keys()
        loss, values = super().loss(model, batch)
        return loss, {**values, "members": batch["num_members"].float().mean()}

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        sums = super().eval_metrics(model, batch)
        valid = batch["valid"]
        # a non-scalar sum: only a summarize hook can turn it into metrics
        sums["labels_seen"] = torch.bincount(batch["label"][valid], minlength=self.num_classes)
        return sums

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        count = float(sums["count"])
        return {
            "accuracy": float(sums["accuracy"]) / count,
            "classes_seen": float((sums["labels_seen"] > 0).sum()),
            "counted": float(sums["labels_seen"].sum()),
        }


class KeepMembers(Thumbnail):
    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        out = super().__call__(sample)
        out["num_members"] = sample["num_members"]
        return out
