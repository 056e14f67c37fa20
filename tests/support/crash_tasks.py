"""A task one of whose ranks dies of SIGKILL mid-run, as the OOM killer or `kill -9` would
end it: for the restart tests of the job script (tests/launch/test_slurm_restarts.py).

Rank `task_options.crash_rank` (default 1; -1: rank N mod the world size for the N-th crash,
so that each crash is another rank's) kills itself in the `task_options.crash_after`-th step of
each attempt (default 5), at most `task_options.crashes` times over the run (default: every
attempt); the crashes so far are files in RUN_DIR/crashes, made before each kill. The kill
changes no numbers: a run that resumes after it trains bitwise like one that never died.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.data.index import ShardIndex
from tests.support.slow_tasks import SlowImageClassification


class CrashingImageClassification(SlowImageClassification):
    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        super().__init__(cfg, index)
        options = cfg.task_options
        self.crashes = Path(cfg.run_dir) / "crashes"
        self.limit = int(options.get("crashes", 1 << 30))
        self.after = int(options.get("crash_after", 5))
        rank = int(options.get("crash_rank", 1))
        if rank == -1:
            done = len(list(self.crashes.iterdir())) if self.crashes.is_dir() else 0
            rank = done % int(os.environ.get("SLURM_NTASKS", "1"))
        mine = rank == int(os.environ.get("SLURM_PROCID", "0"))
        self.steps = 0 if mine else -(1 << 30)  # the other ranks never reach it

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.steps += 1
        if self.steps == self.after:
            self.crashes.mkdir(exist_ok=True)
            done = len(list(self.crashes.iterdir()))
            if done < self.limit:
                (self.crashes / str(done + 1)).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)
