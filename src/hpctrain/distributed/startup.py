"""What every process of a job does first, for training and for eval/predict alike."""

from __future__ import annotations

import logging
import os
import sys

import torch

from hpctrain.distributed.env import DistEnv, resolve_env
from hpctrain.distributed.group import choose_device


def setup_logging(env: DistEnv) -> None:
    """Rank-prefixed log lines; only rank 0 says more than warnings."""
    level = logging.INFO if env.is_main else logging.WARNING
    fmt = (
        f"%(asctime)s [rank {env.rank}] %(levelname)s %(message)s"
        if env.is_distributed
        else "%(asctime)s %(levelname)s %(message)s"
    )
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)


# cuBLAS's fixed workspace for repeatable results (NVIDIA's cuBLAS documentation, "Results
# reproducibility"; torch's reproducibility notes): 8 buffers of 4 MiB.
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS_WORKSPACE = ":4096:8"


def start_process(*, deterministic: bool = False) -> tuple[DistEnv, torch.device]:
    """(where this process sits in the job, its device), with its logging and CPU threads set.

    Call once per process, before any process group (`process_group`) or model.
    `deterministic` (`train.deterministic`): cuBLAS's workspace is fixed before CUDA starts
    (a user's own `CUBLAS_WORKSPACE_CONFIG` is kept).
    """
    env = resolve_env()
    setup_logging(env)
    if deterministic:
        os.environ.setdefault(CUBLAS_WORKSPACE, DETERMINISTIC_CUBLAS_WORKSPACE)
    device = choose_device(env)
    # Loader workers are processes; one intra-op thread per rank avoids oversubscribing the
    # node's cores (IDRIS runs one task per GPU with its own cpus-per-task).
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and env.local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    return env, device
