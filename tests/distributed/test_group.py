"""Every process group of a run gets `train.collective_timeout_s` (gloo's default is 30 min)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hpctrain.checkpoint import CheckpointManager
from hpctrain.distributed import new_cpu_group
from hpctrain.launch.local import free_port


def timeout_of(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_extra_groups_take_the_configured_timeout(tmp_path):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=7),
    )
    try:
        assert dist.group.WORLD is not None
        assert timeout_of(dist.group.WORLD) == datetime.timedelta(seconds=7)
        assert timeout_of(new_cpu_group(9)) == datetime.timedelta(seconds=9)
        manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1, timeout_s=11)
        assert manager._group is not None
        assert timeout_of(manager._group) == datetime.timedelta(seconds=11)
        manager.close()
    finally:
        dist.destroy_process_group()
