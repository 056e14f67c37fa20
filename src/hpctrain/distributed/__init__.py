"""Distributed environment: who am I in the job, and the process group.

`env` (world discovery, hostlists) is stdlib only and imported at once; the torch parts
(`group`, `startup`) load on first use, so the job script's steps (`hpctrain.resilience.attempts`,
the health probe) expand a hostlist without paying torch's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpctrain.distributed.env import DistEnv, expand_hostlist, port_from_job_id, resolve_env

if TYPE_CHECKING:
    from hpctrain.distributed.group import (
        all_gather_floats,
        all_gather_vectors,
        all_hostnames,
        all_reduce_max,
        all_reduce_sum,
        all_reduce_tensors,
        backend_for,
        choose_device,
        destroy_process_group,
        init_process_group,
        new_cpu_group,
        process_group,
    )
    from hpctrain.distributed.startup import setup_logging, start_process

_LAZY = {
    **dict.fromkeys(
        ("all_gather_floats", "all_gather_vectors", "all_hostnames", "all_reduce_max", "all_reduce_sum",
         "all_reduce_tensors", "backend_for", "choose_device", "destroy_process_group",
         "init_process_group", "new_cpu_group", "process_group"),
        "hpctrain.distributed.group",
    ),
    "setup_logging": "hpctrain.distributed.startup",
    "start_process": "hpctrain.distributed.startup",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DistEnv",
    "all_gather_floats",
    "all_gather_vectors",
    "all_hostnames",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_tensors",
    "backend_for",
    "choose_device",
    "destroy_process_group",
    "expand_hostlist",
    "init_process_group",
    "new_cpu_group",
    "port_from_job_id",
    "process_group",
    "resolve_env",
    "setup_logging",
    "start_process",
]
