"""The one place where DDP and FSDP2 (flat or HSDP) appear: SyncBatchNorm → checkpointing →
compile → shard/wrap.

Order matters (as in torchtitan's parallelize): checkpoint wrappers go around the blocks that
FSDP2 shards one by one, and `torch.compile` sees the blocks before they are wrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hpctrain.compat_torch import batchnorm_classes, checkpoint_wrapper, ddp_ignore
from hpctrain.config import ConfigError, TrainConfig
from hpctrain.parallel.precision import Precision, TrainingPlan

# Norm layers with running statistics: fp32 parameters under FSDP2 mixed precision (below).
FP32_NORMS = batchnorm_classes()  # BatchNorm1d/2d/3d and SyncBatchNorm


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The repeated blocks of a model as (parent, attribute name, block).

    Known layouts: `model.blocks` (hpctrain's SmallCNN, many ViTs), torchvision ResNets
    (`layer1`..`layer4`), torchvision ViT (`encoder.layers`); otherwise the top-level children.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return [(blocks, name, child) for name, child in blocks.named_children()]
    resnet_layers = [
        name for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, name)
    ]
    if resnet_layers:
        return [(model, name, getattr(model, name)) for name in resnet_layers]
    encoder = getattr(model, "encoder", None)
    layers = getattr(encoder, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return [(layers, name, child) for name, child in layers.named_children()]
    return [
        (model, name, child)
        for name, child in model.named_children()
        if any(True for _ in child.parameters())
    ]


def parallelize(
    model: nn.Module,
    cfg: TrainConfig,
    plan: TrainingPlan,
    device: torch.device,
    *,
    channels_last: bool = False,
) -> nn.Module:
    """Move `model` to `device`; apply SyncBatchNorm, activation checkpointing, compile, DDP/FSDP2.

    `plan` (from `plan_training`) has refused what cannot train and says which strategy runs.
    Every rank must have built the model from the same seed: FSDP2 does not broadcast initial
    weights (DDP does, but starting equal keeps the two strategies bitwise comparable).
    With `channels_last`, 4-d weights are stored NHWC too, so convolutions on channels_last
    inputs need no layout conversion (cuDNN's fast path for tensor cores).
    A model on the meta device (`init_from.build_model`, FSDP2 only) gets empty storage for
    each rank's shard once sharded, for the caller to fill.
    """
    if plan.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    on_meta = any(p.is_meta for p in model.parameters())
    assert not on_meta or plan.sharded, plan.strategy
    if not on_meta:
        model.to(device)
    mesh = device_mesh(plan, device)
    if plan.tp > 1:  # before the wrappers, as in torchtitan: TP, checkpointing, compile, FSDP2
        tensor_parallel(model, mesh, plan)
    sharded = plan.sharded
    if channels_last and not sharded:
        # FSDP2 refuses non-contiguous parameters ("does not support non-contiguous
        # parameters yet", torch 2.14); under it only the inputs are channels_last.
        model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        for parent, name, block in find_blocks(model):
            setattr(parent, name, checkpoint_wrapper(block))
    if cfg.compile:
        for parent, name, block in find_blocks(model):
            setattr(parent, name, torch.compile(block))
    if plan.strategy == "none":
        # DDP at world size 1 costs time per step for nothing (BENCHMARKS.md, "Figures behind
        # the code"): a single process has nobody to synchronise with.
        return model
    if plan.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # A frozen tensor subclass (QLoRA's NF4 base, models/lora.py) stays out of DDP: its
        # broadcast at construction round-trips the values (1e-5 changes, measured), and
        # every rank built the same anyway; frozen, it has no gradient to reduce.
        quantized = [n for n, p in model.named_parameters() if type(p.data) is not torch.Tensor]
        if quantized:
            ddp_ignore(model, quantized)
        # gradient_as_bucket_view: the gradients are views into the all-reduce buckets
        # instead of copies beside them (one gradient-sized buffer and one copy per step less)
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    model = shard_fsdp2(model, cfg, plan.precision, mesh=data_parallel_mesh(mesh, plan))
    if on_meta:
        model.to_empty(device=device)  # each rank's shard only, uninitialised
    return model


def device_mesh(plan: TrainingPlan, device: torch.device) -> Any:
    """The named mesh of a run, or None for FSDP2's flat default (and DDP).

    Dimensions, outermost first: `replicate` and `shard` (HSDP), or `shard` (FSDP2 with
    tensor parallelism), then `tp`. Ranks are laid out node by node (SLURM and torchrun
    number a node's tasks contiguously), so the innermost dimensions stay inside a node: a TP
    group always, and a shard group when the shard degree is the node's data-parallel ranks.
    Parameter all-gathers and gradient reduce-scatters then use the node's links, and only
    the gradient all-reduce across the replicas crosses nodes.
    """
    dims: list[int] = []
    names: list[str] = []
    if plan.strategy == "hsdp":
        dims, names = list(plan.mesh), ["replicate", "shard"]
    elif plan.tp > 1:
        dims, names = [plan.mesh[1]], ["shard"]
    if plan.tp > 1:
        dims.append(plan.tp)
        names.append("tp")
    if not dims:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, tuple(dims), mesh_dim_names=tuple(names))


def data_parallel_mesh(mesh: Any, plan: TrainingPlan) -> Any:
    """The part of `mesh` FSDP2 shards over (None: all ranks)."""
    if mesh is None:
        return None
    if plan.strategy == "hsdp":
        return mesh["replicate", "shard"] if plan.tp > 1 else mesh
    return mesh["shard"]


def check_tensor_parallel(model: nn.Module, plan: TrainingPlan) -> Any:
    """The model's tensor-parallel plan (`parallelize_tensors`), or the refusal of one it lacks.

    Raises:
        ConfigError: the model has no tensor-parallel plan (only the causal_lm GPT has one).
    """
    apply = getattr(model, "parallelize_tensors", None)
    if apply is None:
        raise ConfigError(
            f"train.tp_degree={plan.tp}: {type(model).__name__} has no tensor-parallel plan; "
            "tensor parallelism splits the causal_lm GPT only (set train.tp_degree=1)"
        )
    return apply


def tensor_parallel(model: nn.Module, mesh: Any, plan: TrainingPlan) -> None:
    """Split `model` over the mesh's `tp` dimension with its own plan (`parallelize_tensors`).

    Raises:
        ConfigError: the model has no tensor-parallel plan (only the causal_lm GPT has one).
    """
    apply = check_tensor_parallel(model, plan)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    apply(mesh["tp"])
    # SequenceParallel registers the norms' weights anew as (trainable) DTensor parameters:
    # keep `train.freeze` (applied before wrapping) on them.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def shard_fsdp2(
    model: nn.Module, cfg: TrainConfig, precision: Precision, *, mesh: Any = None
) -> nn.Module:
    """`fully_shard` the norms (mixed precision only), each block, then the root.

    `mesh`: None shards over all ranks; a 2-D (replicate, shard) mesh is HSDP: the same
    units, sharded inside each shard group and all-reduced across the groups.

    Parameters are gathered in the compute dtype and gradients reduced in fp32. BatchNorm
    layers keep fp32 parameters: `MixedPrecisionPolicy` would cast their weight and bias to
    bf16/fp16 but not their fp32 running statistics, and batch_norm refuses the mix
    ("expected scalar type BFloat16 but found Float"; torchtitan#674). As FSDP2's maintainers
    advise there, they are sharded apart with an fp32 policy: inputs cast to fp32, outputs
    back to the compute dtype, statistics accumulated in fp32 as under autocast. All norms
    form ONE group (`fully_shard([...])`), so they cost one all-gather and one
    reduce-scatter more per step, not three collectives per norm (ResNet-18 has 20). Measured
    with tools/norm_units_cost.py (ResNet-18, 2 gloo CPU ranks, 4 x 32 px, fp32 so that every
    layout runs): blocks only 14 collectives/step; + one norm group 16, step time within noise
    (-5 %); + one unit per norm 74, +20 % step time. LayerNorm and GroupNorm have no running
    statistics and accumulate in fp32 inside their kernels; they stay in their block's unit
    (the bf16 tolerance test of tests/parallel/test_matrix.py covers the ViT).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = cfg.reshard_after_forward
    policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    # A model whose blocks take side inputs that must keep their precision (the GPT's fp32
    # RoPE tables) says so: its blocks then cast nothing; their activations come in the
    # compute dtype from the root's (cast) layers.
    if not getattr(model, "fsdp_cast_block_inputs", True):
        block_policy = MixedPrecisionPolicy(
            param_dtype=precision.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    else:
        block_policy = policy
    norms: list[nn.Module] = [m for m in model.modules() if isinstance(m, FP32_NORMS)]
    if precision.dtype != torch.float32 and norms:
        fp32 = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=precision.dtype
        )
        # Under a megabyte even for ResNet-50: gathered once per step, kept through backward.
        fully_shard(norms, mesh=mesh, mp_policy=fp32, reshard_after_forward=False)
    for _, _, block in find_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard)
    # The root stays gathered after forward: its parameters (embeddings, head) are the first
    # the backward needs; FSDP2 does that by itself only when the root's value is left unset,
    # and any explicit value (ours was True) reshards it and gathers it again at once.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """Gradient accumulation: what the micro-steps before the last one skip.

    DDP skips its all-reduce (`no_sync`): its gradients are full-size on every rank anyway.
    FSDP2 still reduce-scatters every micro-step, and each rank accumulates only its shard of
    the gradient: skipping the reduce-scatter (`set_requires_gradient_sync(False)`) would keep
    a full-size unsharded gradient of every block on every rank until the last micro-step,
    in fp32 under mixed precision (+4 bytes per parameter of the whole model per GPU, ~29 GiB
    for gpt-8b). HSDP skips only the all-reduce across the replicas (FSDP2 adds the micro-
    steps' reduce-scattered shards, then all-reduces their sum once), as torchtitan does.
    """
    if not skip:
        yield
        return
    wrapped: Any = model
    if hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
        return
    if hasattr(wrapped, "set_requires_all_reduce"):  # FSDP2: no all-reduce without replicas
        wrapped.set_requires_all_reduce(False)
        try:
            yield
        finally:
            wrapped.set_requires_all_reduce(True)
        return
    yield


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward without backward (an evaluation).

    A module sharded with `reshard_after_forward=False` (`train.reshard_after_forward: false`,
    and the fp32 norm group under mixed precision) keeps its gathered copy after a forward
    under no_grad, and its next forward uses that copy as it is. Whatever writes into the
    shards in place calls this first (the EMA's swap, `hpctrain.train.ema`): without it,
    measured here, the training step after an evaluation with the EMA computed with the EMA.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's buffers to every rank under FSDP2, as DDP does before its forwards.

    FSDP2 shards parameters, not buffers: each rank's BatchNorm running statistics follow its
    own batches, so an evaluation would mix the ranks' statistics, and a checkpoint holds one
    rank's copy (DCP keeps any one of replicated tensors). Called before each evaluation and
    save, it makes both use rank 0's statistics, which follow the same course as under DDP.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1:
        for buffer in model.buffers():
            # Statistics are real numbers and counts; a bool mask or a complex RoPE table is
            # a constant (and not every backend broadcasts those dtypes).
            if buffer.is_floating_point() or buffer.dtype in (torch.int64, torch.int32):
                dist.broadcast(buffer, src=0)
