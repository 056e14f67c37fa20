"""A task whose training steps last at least `task_options.step_s` seconds.

Tests that act while a run trains (a signal at step N, a time limit over several allocations)
need steps that cannot outrun them on a fast machine: both kinds failed once the loader got
faster (1150 plain steps fit in two allocations instead of three; a signal sent once step 3
was logged arrived after the last step, 8). The sleep changes no numbers: runs with and
without it train bitwise alike.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.tasks.image_classification import ImageClassification


class SlowImageClassification(ImageClassification):
    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        self.step_s = float(cfg.task_options.get("step_s", 0.1))

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        time.sleep(self.step_s)
        return super().loss(model, batch)


class ForkserverSlowImageClassification(SlowImageClassification):
    """Slow steps, and loader workers started from multiprocessing's forkserver: what a GPU
    run does once CUDA is up (`hpctrain.data.transport.worker_start_method`), which this
    machine, without a GPU, would never choose itself."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        from hpctrain.data import loader

        loader.worker_start_method = lambda: "forkserver"  # type: ignore[assignment]
