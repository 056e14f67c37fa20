"""Async staging: the CPU copy of a state dict that an async save makes, training paused.

Only what this rank writes is staged (issue #38 item 8). DCP writes a value held by several
ranks once, from the lowest rank holding it (`save_planner`: `dedup_save_to_lowest_rank`):
under DDP rank 0 writes the whole model and optimizer and the other ranks nothing but their
own per-rank state; under HSDP the first replica writes the shards. The stager works out the
same choice before copying: a plain tensor is written by the lowest rank whose state dict has
its path (the paths are gathered once per structure), a DTensor's local shard by the ranks at
coordinate 0 of every mesh dimension where it is replicated (meshes number ranks in order, so
they are the lowest). The values another rank writes go to DCP as meta tensors of the same
shape: the plan needs their shapes only, and drops them from this rank's writes.

The copy lands in one CPU buffer of the exact size (each tensor 64-byte aligned), allocated
once and reused by later saves of the same structure: the copy is the only time an async save
blocks training, and allocating fresh buffers each time (DCP's default stager) roughly doubles
it. With CUDA the buffer is page-locked as it is (`cudaHostRegister`), not through the caching
host allocator, which rounds every block up to a power of two.

Staged memory stays for the whole run, on every rank of a node: before the first copy, when
the node's ranks would stage more than `MEMORY_SHARE` of the node's memory (the job's cgroup
limit where there is one), `stage` raises `StagingTooLarge` and the manager saves
synchronously instead, with a warning (`CheckpointManager.save`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor, Replicate

log = logging.getLogger(__name__)
ALIGN = 64
MEMORY_SHARE = 0.5  # of a node's memory that its ranks' staging buffers may take


class StagingTooLarge(RuntimeError):
    """The node's ranks would stage more than `MEMORY_SHARE` of its memory (one line)."""


@dataclass(frozen=True)
class Leaf:
    """A tensor of the state dict: where it is, and where its copy goes (or None: another
    rank writes it)."""

    path: tuple[Any, ...]
    writes: bool  # this rank writes it (else a meta tensor of its shape goes to DCP)
    offset: int  # in the staging buffer
    nbytes: int


class ReusedBufferStager(AsyncStager):
    """Stages what this rank writes into one exact-size CPU buffer, reused by later saves.

    Args:
        group: the process group DCP saves over (None: the default group, or one process).
        pin: page-locks (ptr, nbytes) of the buffer; default `cudaHostRegister` when CUDA is
            available, nothing otherwise. Returns the matching unpin, or None.
        node_memory: the bytes of this node's memory (default: physical memory, or the job's
            cgroup limit if lower).
    """

    def __init__(self, group: Any = None, *, pin: Any = None, node_memory: Any = None) -> None:
        self.group = group
        self.pin = pin if pin is not None else (cuda_pin if torch.cuda.is_available() else None)
        self.node_memory = node_memory or node_memory_bytes
        self._signature: list[Any] | None = None
        self._leaves: list[Leaf] = []
        self._buffers: torch.Tensor | None = None  # the staging buffer
        self._unpin: Any = None
        self.staged_bytes = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict)
        if signature != self._signature:
            self._release()
            self._leaves = self._plan(state_dict)
            self._signature = signature
            self._allocate()
        staged = _copy_structure(state_dict)
        on_cuda = False
        for leaf in self._leaves:
            value = _get(state_dict, leaf.path)
            local = value.to_local() if isinstance(value, DTensor) else value
            if not leaf.writes or not leaf.nbytes:
                device = "cpu" if leaf.writes else "meta"  # an empty shard: nothing to copy
                copy = torch.empty(local.shape, dtype=local.dtype, device=device)
            else:
                assert self._buffers is not None
                raw = self._buffers[leaf.offset : leaf.offset + leaf.nbytes]
                copy = raw.view(local.dtype).view(local.shape)
                copy.copy_(local, non_blocking=True)
                on_cuda = on_cuda or local.is_cuda
            if isinstance(value, DTensor):
                copy = DTensor.from_local(
                    copy,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            _set(staged, leaf.path, copy)
        if on_cuda:
            torch.cuda.synchronize()  # the copies are done before `stage` returns
        return staged

    def _plan(self, state_dict: dict[str, Any]) -> list[Leaf]:
        """Which tensors this rank writes, and their places in the buffer; refuses a node
        whose ranks would stage too much (collective over the group, once per structure)."""
        tensors = list(_tensors(state_dict))
        plain = [path for path, value in tensors if not isinstance(value, DTensor)]
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(self.group) if distributed else 0
        holders = _gather(plain, self.group) if distributed else [plain]
        lowest: dict[tuple[Any, ...], int] = {}
        for holder, paths in enumerate(holders):
            for path in paths:
                lowest.setdefault(tuple(path), holder)
        leaves, offset, staged = [], 0, 0
        for path, value in tensors:
            local = value.to_local() if isinstance(value, DTensor) else value
            nbytes = local.numel() * local.element_size()
            if isinstance(value, DTensor):
                writes = _first_replica(value)
            else:
                writes = lowest[path] == rank
            leaves.append(Leaf(path, writes, offset, nbytes))
            if writes and nbytes:
                staged = offset + nbytes
                offset += -(-nbytes // ALIGN) * ALIGN
        total = sum(leaf.nbytes for leaf in leaves)
        self._check_memory(staged, total, distributed)
        self.staged_bytes = staged  # the buffer's exact size
        return leaves

    def _check_memory(self, staged: int, total: int, distributed: bool) -> None:
        mine = (socket.gethostname(), staged, int(self.node_memory()))
        ranks = _gather(mine, self.group) if distributed else [mine]
        per_node: dict[str, list[int]] = {}
        for host, nbytes, memory in ranks:
            per_node.setdefault(host, [0, memory, 0])
            per_node[host][0] += nbytes
            per_node[host][2] += 1
        log.info(
            "async checkpoints: this rank stages %.1f MB of its %.1f MB of state (%s)",
            staged / 1e6,
            total / 1e6,
            ", ".join(f"{h}: {n / 2**30:.2f} GiB" for h, (n, _, _) in per_node.items()),
        )
        for host, (nbytes, memory, count) in sorted(per_node.items()):
            if nbytes > MEMORY_SHARE * memory:
                raise StagingTooLarge(
                    f"checkpoint.async=true: the {count} rank(s) on {host} would keep "
                    f"{nbytes / 2**30:.1f} GiB of checkpoint state staged in memory for the "
                    f"whole run, more than {MEMORY_SHARE:.0%} of its {memory / 2**30:.1f} GiB"
                )

    def _allocate(self) -> None:
        size = self.staged_bytes
        self._buffers = torch.empty(size, dtype=torch.uint8)
        if self.pin is not None and size:
            self._unpin = self.pin(self._buffers.data_ptr(), size)

    def _release(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._buffers = None
        self._signature = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # `stage` copies before it returns: nothing to wait for

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._release()


def cuda_pin(ptr: int, nbytes: int) -> Any:
    """Page-lock `nbytes` at `ptr` exactly (`cudaHostRegister`); returns the unpin."""
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if code != 0:
        log.warning("async checkpoints: staging buffer not pinned (cudaHostRegister: %d)", code)
        return None
    return lambda: cudart.cudaHostUnregister(ptr)


def node_memory_bytes() -> int:
    """This node's memory as this job may use it: physical memory, or the cgroup's limit
    (SLURM's `--mem` under cgroup v2 or v1) when lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
    return physical


def _first_replica(value: DTensor) -> bool:
    """Whether this rank is the lowest of those holding this local shard (DCP writes it)."""
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(
        coordinate[dim] == 0
        for dim, placement in enumerate(value.placements)
        if isinstance(placement, Replicate)
    )


def _gather(obj: Any, group: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _tensors(obj: Any, path: tuple[Any, ...] = ()) -> Any:
    """(path, tensor) of every tensor in nested dicts and lists, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, i))


def _copy_structure(obj: Any) -> Any:
    """The nested dicts and lists of `obj` anew (leaves shared), for the staged values."""
    if isinstance(obj, dict):
        return {key: _copy_structure(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_structure(value) for value in obj)
    return obj


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    parent = _get(obj, path[:-1])
    if isinstance(parent, tuple):  # rebuilt with the value: tuples cannot be assigned into
        raise TypeError(f"a tensor inside a tuple at {path!r} cannot be staged")
    parent[path[-1]] = value


def _signature(obj: Any) -> list[Any]:
    """Structure of a state dict: keys, and shape/dtype of every tensor (local shard)."""
    out: list[Any] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            out.append((path, tuple(local.shape), local.dtype, local.device.type))
        elif isinstance(value, dict):
            for key in value:
                walk(value[key], f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            out.append((path, type(value).__name__, len(value)))
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}")
        else:
            out.append((path, type(value).__name__))

    walk(obj, "")
    return out
