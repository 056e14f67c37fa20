"""`profile.steps`: a torch.profiler trace of a few training steps, then full speed again.

Each rank in `profile.ranks` records CPU activity (and CUDA kernels on GPUs) of optimizer
steps START..END (counted like `step` in `metrics.jsonl`: the first step is 1) and writes
`RUN_DIR/profile/rank-<r>.steps-<START>-<END>.pt.trace.json`, a Chrome trace that Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin open. Outside those
steps no profiler runs. A run resumed inside the range records the steps left of it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from hpctrain.config import ConfigError

log = logging.getLogger("hpctrain")

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_steps(text: str) -> tuple[int, int] | None:
    """`"10-12"` -> (10, 12); `""` -> None; anything else is a ConfigError naming the key."""
    if not text:
        return None
    match = _RANGE.match(text)
    if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ConfigError(
            f"profile.steps={text!r}: must be START-END with 1 <= START <= END (e.g. 10-12)"
        )
    return int(match.group(1)), int(match.group(2))


class StepProfiler:
    """Starts and stops torch.profiler around steps START..END on the chosen ranks.

    Call `at_step(done)` before every training step with the number of steps done so far,
    and `close()` when training ends (it writes the trace if the range was cut short).
    """

    def __init__(
        self,
        steps: str,
        ranks: list[int],
        *,
        rank: int,
        world_size: int,
        run_dir: Path,
        device: torch.device,
    ) -> None:
        self.range = parse_steps(steps)
        outside = [r for r in ranks if not 0 <= r < world_size]
        if self.range is not None and outside:
            raise ConfigError(
                f"profile.ranks={ranks}: the run has {world_size} rank(s), 0..{world_size - 1}"
            )
        self.active = self.range is not None and (not ranks or rank in ranks)
        self.rank, self.run_dir, self.device = rank, run_dir, device
        self.profiler: Any = None
        self.first_step = 0

    @property
    def path(self) -> Path:
        assert self.range is not None
        start, end = self.range
        return self.run_dir / "profile" / f"rank-{self.rank}.steps-{start}-{end}.pt.trace.json"

    def at_step(self, done: int) -> None:
        """Before a training step, `done` steps having been done: start or stop recording."""
        if not self.active:
            return
        assert self.range is not None
        start, end = self.range
        if self.profiler is None and start - 1 <= done < end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            if not torch.cuda.is_available():
                # Kineto (torch's profiler library) asks the CUDA driver for its devices when
                # it collects a trace, also of CPU activity only, and logs "ERROR: ...
                # gpuGetDeviceCount failed" where there is none: harmless, and alarming.
                # Level 5 hides its messages up to ERROR (read at its first use in the
                # process); a KINETO_LOG_LEVEL of the user's own wins.
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
            self.first_step = done + 1
        elif self.profiler is not None and done >= end:
            self._finish(done)

    def close(self) -> None:
        """Stop a recording still running (the run ended or was preempted inside the range)."""
        if self.profiler is not None:
            self._finish(None)

    def _finish(self, done: int | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels belong in the trace
        self.profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        self.active = False  # once per run: full speed from here on
        last = "the end" if done is None else f"step {done}"
        log.info("profile of steps %d..%s written: %s", self.first_step, last, self.path)
