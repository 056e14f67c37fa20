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


def test_a_peers_failure_leaves_as_a_distributed_error_exit_7() -> None:
    """What gloo and NCCL raise when another rank dies, hangs or the network fails (the texts
    of torch 2.14's gloo, seen in the SLURM tests); the job script retries those."""
    import torch.distributed as dist

    from hpctrain.checkpoint.commit import CheckpointSaveError
    from hpctrain.distributed.group import peer_failure
    from hpctrain.errors import EXIT_DISTRIBUTED, DataError
    from hpctrain.observe.hangs import CollectiveTimeout

    closed = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
        "closed by peer [127.0.0.1]:9866. This is typically caused by a remote worker crashing."
    )
    failure = peer_failure(closed)
    assert failure is not None and failure.exit_code == EXIT_DISTRIBUTED
    assert str(failure).startswith("a peer rank went away: [/__w/pytorch/")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited")
    assert peer_failure(nccl) is not None
    assert (
        peer_failure(dist.DistBackendError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN)"))
        is None
    )
    try:  # a save that failed because a peer died: the peer's failure, not the checkpoint's
        try:
            raise closed
        except RuntimeError as exc:
            raise CheckpointSaveError("step-10: save failed") from exc
    except CheckpointSaveError as save:
        assert peer_failure(save) is not None
    assert peer_failure(CollectiveTimeout("waited 10 s")) is None  # exit 7 already
    assert CollectiveTimeout("x").exit_code == EXIT_DISTRIBUTED
    assert peer_failure(DataError("/d/index.json: missing")) is None
    assert peer_failure(ValueError("a bug")) is None
