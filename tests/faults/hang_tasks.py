"""Tasks that hang on purpose, for the tests of `hpctrain.train.hangs`."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.train.tasks.image_classification import ImageClassification


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
