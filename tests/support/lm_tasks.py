"""A causal_lm task that sends its own process SIGUSR2 during a chosen training step.

`task_options.signal_at_call: N` (rank 0 only; 0: never): the N-th `loss` call of this task
object raises the signal, as a SLURM preemption would, while the step runs. The real handler
records it and the ranks agree on it at the step boundary. The signal changes no numbers.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from hpctrain.tasks.causal_lm import CausalLM


class SignalingCausalLM(CausalLM):
    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        rank = int(os.environ.get("RANK", "0"))
        self.signal_at_call = int(cfg.task_options.get("signal_at_call", 0)) if rank == 0 else 0
        self.calls = 0

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.calls += 1
        if self.calls == self.signal_at_call:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().loss(model, batch)
