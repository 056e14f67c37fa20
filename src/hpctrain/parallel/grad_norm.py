"""The global gradient norm and `train.grad_clip`, with the same bits under DDP, FSDP2 and HSDP.

torch's `clip_grad_norm_` reduces each gradient where it lies: whole under DDP, each rank's
shard under FSDP2, whose shards' norms are then summed over the ranks. The sums run in other
orders, so the norm differs in its last bits, and with it the clip coefficient: two runs that
differ only in their strategy drift apart from the first step that clips (after 300 steps of a
LoRA fine-tune, an exact match of 0.7625 under DDP and 0.675 under FSDP2).

`global_grad_norm` sums squares in an order no strategy changes:
- per row: each row of a gradient (its first dimension; each element of a 1-D one), which
  DDP holds whole and FSDP2 and HSDP never split (they shard the first dimension), has its
  fp32 norm computed by one reduction over its elements, whose order depends on the row's
  length only (two rows at least: torch splits a reduction with a single output over
  threads), squared in float64;
- over rows, exactly: each row's sum is rounded to an integer of a scale every rank shares
  (set by the largest row sum in the job, all-reduced, and the number of rows), and the
  integers are added in int64, whose sums do not depend on their order, then over the ranks
  that hold other rows (one all-reduce over each mesh dimension that shards them).

So DDP, FSDP2 and HSDP compute the same norm, bit for bit, on a CPU
(`tests/parallel/test_lora_ranks.py`, 12 clipped steps). On GPUs a reduction's order may
depend on how many rows it holds, so the last bits may still differ there. The rounding to
integers loses at most (rows^2 / 2^61) of the norm's square relative to its largest row
(rows: of the whole model), and usually far less; a tensor-parallel gradient (a placement
other than sharding rows) goes to torch's `clip_grad_norm_` as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.compat_torch import foreach_mul_


def row_norms(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 norm of each row of `grad` (see the module): one reduction over the row, in
    the order a row of its length always has."""
    count = grad.shape[0] if grad.dim() > 1 else grad.numel()
    if not grad.numel():  # an empty shard (fewer rows than ranks), or rows of no elements
        return torch.zeros(count, dtype=torch.float32, device=grad.device)
    rows = grad.reshape(count, -1) if grad.dim() > 1 else grad.reshape(-1, 1)
    if rows.shape[0] == 1:  # two rows at least: one output would be split
        return row_norms(torch.cat([rows, torch.zeros_like(rows)]))[:1]  # over threads
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)


def times_power_of_two(values: torch.Tensor, exponent: int) -> torch.Tensor:
    """`values` * 2^exponent, exact (in steps a float64 power of two can hold)."""
    while exponent:
        step = max(-1000, min(1000, exponent))
        values = values * 2.0**step
        exponent -= step
    return values


def num_rows(shape: torch.Size) -> int:
    return shape[0] if len(shape) > 1 else max(1, math.prod(shape))


def sharded_dims(grad: torch.Tensor) -> tuple[int, ...] | None:
    """The mesh dimensions over which a gradient's rows are split: () for a plain tensor or a
    replicated DTensor, None for a placement this module does not order (tensor parallelism)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(grad, DTensor):
        return ()
    dims = []
    for dim, placement in enumerate(grad.placements):
        if type(placement) is Shard and placement.dim == 0:
            dims.append(dim)
        elif not isinstance(placement, Replicate):
            return None
    return tuple(dims)


def global_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of every gradient of `parameters` together (fp32, on the gradients'
    device), the same on every rank and under every strategy (see the module)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if any(sharded_dims(g) is None for g in grads):  # tensor parallelism: torch's order
        norm = torch.nn.utils.get_total_norm(grads)
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm
    if not grads:
        return torch.tensor(0.0)
    out = grads[0].device
    # the rows' norms, grouped by the mesh dimensions their rows are split over (() : none)
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    meshes: dict[tuple[int, ...], tuple[Any, tuple[int, ...]]] = {}
    for g in grads:
        dims = sharded_dims(g)
        assert dims is not None
        local = g
        key: tuple[int, ...] = ()
        if isinstance(g, DTensor):
            local = g.to_local()
            if dims:
                key = (id(g.device_mesh), *dims)
                meshes[key] = (g.device_mesh, dims)
        groups.setdefault(key, []).append(row_norms(local).to(out))
    squares = {k: torch.cat(norms).to(torch.float64).square() for k, norms in groups.items()}
    device = comm_device(meshes, out)
    largest = max((float(v.max()) for v in squares.values() if v.numel()), default=0.0)
    if meshes and dist.is_initialized():  # the scale: the largest row of the job
        peak = torch.tensor([largest], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        largest = float(peak)
    if not math.isfinite(largest) or largest == 0.0:
        return torch.tensor(largest, dtype=torch.float32, device=out)
    rows = sum(num_rows(g.shape) for g in grads)  # DTensor shapes are the global ones
    scale = 62 - math.frexp(largest)[1] - rows.bit_length()
    total = 0
    for key, values in squares.items():
        fixed = torch.round(times_power_of_two(values, scale)).to(torch.int64).sum()
        if key:  # rows held by other ranks: summed over those ranks, exactly
            mesh, dims = meshes[key]
            fixed = fixed.to(device)
            for dim in dims:
                dist.all_reduce(fixed, group=mesh.get_group(dim))
        total += int(fixed)
    return torch.tensor(math.sqrt(math.ldexp(total, -scale)), dtype=torch.float32, device=out)


def comm_device(meshes: dict[Any, tuple[Any, Any]], fallback: torch.device) -> torch.device:
    """Where the all-reduces run: the meshes' device type (the current GPU for CUDA)."""
    if not meshes:
        return fallback
    mesh, _ = next(iter(meshes.values()))
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch's
    `clip_grad_norm_` does, with the norm of `global_grad_norm`; returns the norm."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if any(sharded_dims(p.grad) is None for p in params if p.grad is not None):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # tensor parallelism
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm
    norm = global_grad_norm(params)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        assert grad is not None
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        grouped.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), grads in grouped.items():
        foreach_mul_(grads, coefficient.to(device))
    return norm
