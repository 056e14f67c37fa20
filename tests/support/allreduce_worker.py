"""A 2-rank gloo all-reduce run as a SLURM task: proves srun, rendezvous and ranks work."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from hpctrain.distributed import resolve_env


def main() -> None:
    env = resolve_env()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
    )
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    value = torch.tensor([env.rank + 1.0])
    dist.all_reduce(value)
    print(
        f"allreduce rank={env.rank} world={env.world_size} sum={value.item():g} node={node}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
