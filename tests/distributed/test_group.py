"""Process groups: every group of a run gets `train.collective_timeout_s` (gloo's default is
30 min); one GPU per task, checked before NCCL starts; the chosen GPU is the current one."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from hpctrain.checkpoint import CheckpointManager
from hpctrain.distributed import DistEnv, choose_device, new_cpu_group
from hpctrain.distributed.group import SharedGPUError, check_own_gpus
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


def one_rank_per_thread(world_size: int, work) -> list[BaseException | None]:
    """`work(rank)` in one thread per rank; what each raised (None: nothing)."""
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


def env_of(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, rank, world_size, world_size, "127.0.0.1", 0, "torchrun")


@pytest.mark.parametrize(
    ("gpus", "hosts", "refused"),
    [
        (["GPU-a", "GPU-a", "GPU-b"], ["n1", "n1", "n1"], [0, 1]),  # one visible GPU, shared
        (["GPU-a", "GPU-b", "GPU-c"], ["n1", "n1", "n1"], []),  # --gpus-per-task: all cuda:0
        (["GPU-a", "GPU-a", "GPU-a"], ["n1", "n2", "n3"], []),  # same UUID text, other nodes
    ],
)
def test_tasks_sharing_one_gpu_are_refused_in_one_line_before_nccl(
    gpus: list[str], hosts: list[str], refused: list[int]
) -> None:
    """Ranks as threads sharing a real store (the rendezvous store's kind); GPU UUIDs and
    host names are given (no GPU here). NCCL would fail later with "Duplicate GPU detected"."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    errors = one_rank_per_thread(
        3, lambda rank: check_own_gpus(store, env_of(rank, 3), hosts[rank], gpus[rank], 0)
    )
    assert [rank for rank, error in enumerate(errors) if error is not None] == refused
    for rank in refused:
        error = errors[rank]
        assert isinstance(error, SharedGPUError) and error.exit_code == 6
        assert str(error).startswith(
            "2 tasks on n1 use the same GPU (cuda:0, GPU-a): each task needs its own"
        )
        assert "srun --gpus-per-task=1" in str(error) and "\n" not in str(error)


def test_the_chosen_gpu_is_the_current_device_even_in_a_single_process(monkeypatch) -> None:
    """A fake of torch.cuda's answers (no GPU here): with LOCAL_RANK=1 and no process group
    the device was cuda:1 while CUDA's current device stayed 0 (contexts, streams and
    triton's launches on GPU 0)."""
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    single = DistEnv(0, 1, 1, 1, "127.0.0.1", 0, "torchrun")
    assert choose_device(single) == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --gpus-per-task: its own
    assert choose_device(single) == torch.device("cuda", 0)
    assert current[-1] == torch.device("cuda", 0)


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
