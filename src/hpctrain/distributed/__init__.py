"""Distributed environment: who am I in the job, and the process group."""

from hpctrain.distributed.env import DistEnv, expand_hostlist, port_from_job_id, resolve_env
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
