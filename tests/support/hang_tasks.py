"""Tasks that hang or straggle on purpose, for the tests of `hpctrain.observe.hangs` and of the
straggler check (`hpctrain.observe.metrics.StragglerWatch`)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.tasks.image_classification import ImageClassification


class StragglingImageClassification(ImageClassification):
    """Rank `task_options.slow_rank` (default 1) sleeps `task_options.sleep_s` per step,
    `task_options.where` its forward: `after` (where a slow GPU is slow) or `before` (a slow
    host, a slow batch: the slow rank then holds its peers in DDP's buffer broadcast at the
    forward's start, and a time measured up to the backward is the same on every rank)."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        slow = int(cfg.task_options.get("slow_rank", 1)) == int(os.environ.get("RANK", "0"))
        self.sleep_s = float(cfg.task_options.get("sleep_s", 0.15)) if slow else 0.0
        self.before = cfg.task_options.get("where", "after") == "before"

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.before:
            time.sleep(self.sleep_s)
        result = super().loss(model, batch)
        if not self.before:
            time.sleep(self.sleep_s)
        return result


class StuckImageClassification(ImageClassification):
    """Sleeps for an hour in step `task_options.stuck_step` (default 3): a hang outside collectives."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        self.stuck_step = int(cfg.task_options.get("stuck_step", 3))
        self.steps = 0

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.steps += 1
        if self.steps == self.stuck_step:
            wait_for_a_file_that_never_comes()
        return super().loss(model, batch)


def wait_for_a_file_that_never_comes() -> None:
    time.sleep(3600)
