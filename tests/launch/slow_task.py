"""A task whose training steps last at least `task_options.step_s` seconds.

The time-limit test needs a run that outlasts several allocations on any machine: with a
floor on the step time, the number of requeues no longer shrinks as the loader or the machine
gets faster (it did: 1150 plain steps once fit in two allocations instead of three).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.train.image_classification import ImageClassification


class SlowImageClassification(ImageClassification):
    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        self.step_s = float(cfg.task_options.get("step_s", 0.1))

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        time.sleep(self.step_s)
        return super().loss(model, batch)
