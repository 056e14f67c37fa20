"""The `slurm:` section of the config: how a training job is asked of SLURM, and what its
job script does between attempts (restarts, spares, the probe; docs/clusters.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpctrain.config.fields import _f


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    profile: str = _f("generic", "cluster profile from configs/clusters/")
    account: str = _f("", "account, e.g. abc@a100 on Jean Zay")
    partition: str = _f("", "partition; empty takes the profile's")
    constraint: str = _f("", "node constraint (-C); empty takes the profile's")
    qos: str = _f("", "quality of service; empty takes the profile's default")
    nodes: int = _f(1, "nodes", min=1)
    gpus_per_node: int = _f(0, "tasks (GPUs) per node; 0 takes the profile's", min=0)
    cpus_per_task: int = _f(0, "CPUs per task; 0 takes the profile's", min=0)
    time: str = _f("", "wall time (HH:MM:SS or minutes); empty takes the profile's default")
    max_requeues: int = _f(3, "automatic requeues after a time limit or preemption", min=0)
    max_restarts: int = _f(
        0,
        "at most this many restarts inside one allocation after failures that are not the "
        "user's, then the job requeues; 0: no count limit (restarts go on while attempts "
        "commit new checkpoints: slurm.max_no_progress, slurm.max_failure_share; "
        "docs/clusters.md)",
        min=0,
    )
    max_no_progress: int = _f(
        2,
        "stop restarting and requeueing after this many attempts in a row committed no new "
        "checkpoint (preemptions and time limits do not count); 0: never stop for that",
        min=0,
    )
    max_failure_share: float = _f(
        0.0,
        "stop when failures (attempts' lost work, restarts that trained nothing) took more "
        "than this share of the allocation's wall time, e.g. 0.25; 0: no bound",
        min=0.0,
        max=1.0,
    )
    spare_nodes: int | Literal["auto"] = _f(
        0,
        "extra nodes the job asks for; each attempt trains on slurm.nodes of the nodes that "
        "pass the health probe, the others stand by for one that goes bad; auto: the number "
        "that maximises expected goodput from the profile's mtbf_node_hours, slurm.nodes, "
        "slurm.time and the queue wait (sacct, else the profile's queue_wait_hours), chosen "
        "and explained when the job is rendered (docs/clusters.md)",
        min=0,
    )
    probe: bool = _f(
        True,
        "before each attempt, check every node (run folder, data, disks, /dev/shm, GPUs, a "
        "timed exchange between nodes) and set aside those that fail",
    )
    probe_after_kill: bool = _f(
        False,
        "probe before an attempt that follows a rank killed by SIGKILL (the OOM killer, kill "
        "-9); false: that restart skips the probe, none of whose checks explains such a death",
    )
    forkserver: bool = _f(
        True,
        "one warm process per node for the allocation, with torch and the trainer imported, "
        "forks each attempt's ranks: a restart skips the interpreter and its imports "
        "(docs/clusters.md); false: every rank starts a fresh interpreter",
    )
    require_fabric: bool = _f(
        False,
        "fail at start-up when NCCL does not use the profile's fabric (InfiniBand) but falls "
        "back to sockets; false: one warning line",
    )
    signal_margin_s: int = _f(
        120,
        "seconds before the time limit when SLURM sends the signal",
        min=1,
        max=65535,
        max_reason="sbatch --signal takes at most 65535 s",
    )
    setup: list[str] = _f([], "shell lines run before training (module load ...)")
    folder: str = _f("", "where job scripts and logs go; empty: RUN_DIR/slurm")
    container: str = _f(
        "",
        "Apptainer/Singularity image (.sif) the trainer runs in (the profile's container_runtime); empty: the host environment",
    )
    container_binds: list[str] = _f(
        [],
        "extra paths bound into the container (SRC or SRC:DEST); the run folder, data, checkpoint and config folders are bound already",
    )
