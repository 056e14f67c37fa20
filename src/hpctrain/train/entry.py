"""`run_training(cfg)`: what every process of a run executes (local, torchrun, srun, submitit)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from hpctrain.config import Config
from hpctrain.dist import DistEnv, choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

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


def run_training(cfg: Config) -> int:
    """Train in this process as one rank of the job; returns the process exit code.

    0 when training finished, `REQUEUE_EXIT_CODE` (75) after a checkpoint made because of a
    signal or the job's deadline: the launcher requeues the job, which then resumes.
    """
    env = resolve_env()
    setup_logging(env)
    device = choose_device(env)
    # Loader workers are processes; one intra-op thread per rank avoids oversubscribing the
    # node's cores (IDRIS runs one task per GPU with its own cpus-per-task).
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and env.local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    log.info(
        "rank %d/%d on %s (%s), run folder %s",
        env.rank,
        env.world_size,
        device,
        # `hpctrain train --nproc N` sets RANK/WORLD_SIZE like torchrun, and says so here
        os.environ.get("HPCTRAIN_LAUNCHER") or env.source,
        cfg.run_dir,
    )
    # Anomaly detection names the forward op that made a NaN gradient (slow: debug mode only);
    # as a context it is switched off again when an in-process run returns.
    with (
        process_group(env, device, cfg.train.collective_timeout_s, Path(cfg.run_dir) / "hangs"),
        torch.autograd.set_detect_anomaly(cfg.train.debug),
    ):
        trainer = Trainer(cfg, env, device)
        return trainer.fit()
