"""Device and backend choice, process-group set-up and teardown."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hpctrain.dist.env import DistEnv


def choose_device(env: DistEnv, prefer: str = "auto") -> torch.device:
    """One device per task: `cuda:<local index>` when GPUs are visible, else CPU.

    Under SLURM with `--gpus-per-task` or a gres binding each task may see only its own GPU;
    then the index is 0, otherwise the local rank.
    """
    if prefer == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = env.local_rank if count > 1 else 0
    if index >= count:
        raise RuntimeError(f"local rank {env.local_rank} has no GPU: only {count} visible")
    return torch.device("cuda", index)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


DEFAULT_TIMEOUT_S = 600.0  # train.collective_timeout_s


def init_process_group(
    env: DistEnv, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Join the job's process group through `env://` (a no-op for a single process).

    `timeout_s` bounds every collective on the group: a rank that waits longer for a peer
    (hung, stopped, or dead without closing its connections) raises instead of holding the
    allocation. Groups made later need it again (`new_cpu_group`): torch gives them its own
    default (30 min for gloo), not this group's.
    """
    if not env.is_distributed or dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend_for(device),
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def new_cpu_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """A gloo group of every rank with the same collective timeout as the main group."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group


@contextmanager
def process_group(
    env: DistEnv, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Iterator[None]:
    """Init on entry, always tear down on exit (also on errors, so no rank lingers)."""
    init_process_group(env, device, timeout_s)
    try:
        yield
    finally:
        destroy_process_group()


def all_reduce_max(value: float, device: torch.device) -> float:
    """The max of `value` over ranks (`value` itself without a process group)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums of `values` over ranks."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_tensors(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Element-wise sums over ranks of tensors of any shape, in one all-reduce.

    Every rank must hold the same names and shapes (the same task on every rank does).
    """
    if not dist.is_initialized() or not sums:
        return sums
    names = sorted(sums)
    flat = torch.cat([sums[name].reshape(-1) for name in names])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    totals, offset = {}, 0
    for name in names:
        size = sums[name].numel()
        totals[name] = flat[offset : offset + size].view(sums[name].shape)
        offset += size
    return totals
