"""`run_training(cfg)`: what every process of a run executes (local, torchrun, srun, submitit)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hpctrain.checkpoint.interval import DEFAULT_FAILURE_RATE, FailureRate
from hpctrain.config import Config
from hpctrain.distributed import process_group, start_process
from hpctrain.distributed.startup import log_usable_cpus
from hpctrain.observe.timeline import StartupClock
from hpctrain.train.trainer import Trainer, heartbeat_of

log = logging.getLogger("hpctrain")


def run_training(cfg: Config, *, failure_rate: FailureRate = DEFAULT_FAILURE_RATE) -> int:
    """Train in this process as one rank of the job; returns the process exit code.

    0 when training finished, `REQUEUE_EXIT_CODE` (75) after a checkpoint made because of a
    signal or the job's deadline: the launcher requeues the job, which then resumes.
    `failure_rate`: how often a node fails, for `checkpoint.every_minutes: auto` (the launch
    side works it out from the cluster profile and the run's attempts).
    """
    startup = StartupClock()  # since the process started: the interpreter and the imports
    progress = heartbeat_of(cfg)  # under a watcher: start-up has its own allowance
    progress.starting()
    env, device = start_process(deterministic=cfg.train.deterministic)
    log.info(
        "rank %d/%d on %s (%s), run folder %s",
        env.rank,
        env.world_size,
        device,
        # `hpctrain train --nproc N` sets RANK/WORLD_SIZE like torchrun, and says so here
        os.environ.get("HPCTRAIN_LAUNCHER") or env.source,
        cfg.run_dir,
    )
    log_usable_cpus(env, cfg.data.workers_per_rank)
    # Anomaly detection names the forward op that made a NaN gradient (slow: debug mode only);
    # as a context it is switched off again when an in-process run returns.
    with (
        process_group(
            env,
            device,
            cfg.train.collective_timeout_s,
            Path(cfg.run_dir) / "hangs",
            require_fabric=cfg.slurm.require_fabric,
        ),
        torch.autograd.set_detect_anomaly(cfg.train.debug),
    ):
        startup.mark("process_group")
        trainer = Trainer(
            cfg, env, device, startup=startup, failure_rate=failure_rate, progress=progress
        )
        return trainer.fit()
