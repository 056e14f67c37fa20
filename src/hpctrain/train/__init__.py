"""Training: the Task protocol, parallelism and precision, the loop, metrics, preemption.

`run_training` is imported lazily so that light modules (`train.preemption`, `train.task`)
can be imported without pulling in the data and checkpoint stacks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_training"]


def __getattr__(name: str) -> Any:
    if name == "run_training":
        from hpctrain.train.entry import run_training

        return run_training
    raise AttributeError(name)
