"""CUDA out-of-memory snapshots (`profile.oom_snapshot`, `profile.memory_history`).

When a training step raises `torch.OutOfMemoryError` on a GPU, the rank writes the caching
allocator's snapshot (`torch.cuda.memory._dump_snapshot`: every segment and block, and the
allocation history when recorded) to `RUN_DIR/profile/oom-rank-<r>-step-<N>.pickle`, N being
the step that failed (counted like `step` in `metrics.jsonl`), then fails with a message that
names the file. Drop the file on https://pytorch.org/memory_viz to see what held the memory.

Writing the snapshot costs nothing until an OOM happens, so it is on by default. The
allocation history with Python stack traces (`profile.memory_history: N`, the last N events)
is what shows *which code* allocated each block, but recording it costs host time on every
allocation and free of the step (PyTorch's docs: "recording... stack traces adds overhead"),
so it is off by default: switch it on to chase an OOM, as torchtitan does with its
`enable_memory_snapshot` flag.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from hpctrain.compat_torch import dump_memory_snapshot, record_memory_history
from hpctrain.errors import EXIT_CONFIG, HpctrainError

log = logging.getLogger("hpctrain")


class StepOutOfMemoryError(HpctrainError):
    """A training step ran out of accelerator memory (the message names the snapshot).

    Exit code 2 like a config error: the fix is a setting (smaller `data.batch_size`,
    `train.activation_checkpointing`, `train.strategy=fsdp`, bf16).
    """

    exit_code = EXIT_CONFIG
    label = "out of memory"


def can_snapshot(device: torch.device) -> bool:
    """Whether the allocator of `device` keeps snapshots (CUDA's caching allocator does)."""
    return device.type == "cuda"


class OOMSnapshots:
    """Records allocation history when asked and writes a snapshot when a step hits an OOM.

    Args:
        device: the rank's device; nothing happens unless it is a CUDA device.
        run_dir: the run folder (snapshots go to its `profile/`).
        rank: this process's rank, in the file name.
        enabled: `profile.oom_snapshot`.
        history: `profile.memory_history`, allocation events recorded (0: none).
    """

    def __init__(
        self, device: torch.device, run_dir: Path, rank: int, *, enabled: bool, history: int
    ) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.enabled = enabled and can_snapshot(device)
        self.recording = bool(history) and can_snapshot(device)
        if self.recording:
            self.recording = record_memory_history(history)

    def path(self, step: int) -> Path:
        return self.run_dir / "profile" / f"oom-rank-{self.rank}-step-{step}.pickle"

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Around training step `step` (1-based): an OOM in it becomes `StepOutOfMemoryError`."""
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise self.failure(step, exc) from exc

    def failure(self, step: int, exc: torch.OutOfMemoryError) -> HpctrainError:
        """Write the snapshot of this OOM (when enabled) and return the error to raise."""
        reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
        advice = (
            "lower data.batch_size, or try train.activation_checkpointing=true, "
            "train.strategy=fsdp, train.precision=bf16"
        )
        if not self.enabled:
            return StepOutOfMemoryError(f"step {step} on rank {self.rank}: {reason}; {advice}")
        path = self.path(step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            dump_memory_snapshot(str(path))
        except Exception as dump_exc:  # the report must not hide the OOM itself
            log.error("could not write the memory snapshot %s: %s", path, dump_exc)
            return StepOutOfMemoryError(
                f"step {step} on rank {self.rank}: {reason}; {advice} "
                f"(writing the memory snapshot {path} failed: {dump_exc})"
            )
        history = "" if self.recording else " (set profile.memory_history to see what allocated)"
        return StepOutOfMemoryError(
            f"step {step} on rank {self.rank}: {reason}; memory snapshot: {path} "
            f"(open it on https://pytorch.org/memory_viz{history}); {advice}"
        )

    def close(self) -> None:
        """Stop recording the allocation history (frees its buffer)."""
        if self.recording:
            record_memory_history(None)
            self.recording = False
