"""What every process of a job does first, for training and for eval/predict alike."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import torch

from hpctrain.distributed.env import DistEnv, resolve_env
from hpctrain.distributed.group import choose_device

log = logging.getLogger("hpctrain")


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


def log_usable_cpus(
    env: DistEnv,
    workers_per_rank: int,
    affinity: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
) -> int:
    """Log the CPUs this rank may run on next to its loader workers; warn when too few.

    srun from SLURM 22.05 to 23.11 ignores the job's `--cpus-per-task` unless srun gets it
    on its own command line (the job scripts pass it, and export SRUN_CPUS_PER_TASK): a rank
    and all its workers then share one CPU, and the loader crawls without another sign.
    Said in SLURM jobs only (elsewhere the CPUs are the user's own choice). Returns the count.
    """
    cpus = len(affinity())
    if not env.job_id:
        return cpus
    wanted = workers_per_rank + 1  # the workers, and the rank itself
    if cpus < wanted:
        log.warning(
            "rank %d may use %d CPU(s) (sched_getaffinity) for itself and data.workers_per_rank=%d "
            "loader workers: they share CPUs; ask for --cpus-per-task=%d on srun (or export "
            "SRUN_CPUS_PER_TASK), or lower data.workers_per_rank",
            env.rank,
            cpus,
            workers_per_rank,
            wanted,
        )
    else:
        log.info(
            "CPUs: %d usable by each rank (sched_getaffinity), data.workers_per_rank=%d",
            cpus,
            workers_per_rank,
        )
    return cpus
