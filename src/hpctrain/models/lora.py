"""LoRA: low-rank adapters on a model's linear layers (`model.lora.*`, docs/fine-tuning.md).

`apply_lora` runs on the built model before `parallelize` (STYLE.md: adapters are a model
concern, applied before the one ordered parallelize function): each targeted `nn.Linear` is
replaced by a `LoRALinear` that keeps the same `weight` and `bias` parameters (so the base's
names, the Hugging Face mapping and `model.init_from` are unchanged) and adds two trainable
matrices, `lora_A` (rank x in) and `lora_B` (out x rank), as `nn.Linear` modules:

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T

Every other parameter is frozen (no gradient, no optimizer state, not in checkpoints), except
the modules named by `model.lora.modules_to_save` and a head `model.init_from` re-initialises,
which train in full. The adapters' names are peft's (`<module>.lora_A.weight`), so an adapter
exported for peft is this state under peft's prefix (`hpctrain.models.lora_base`).

The base may be held in bf16 (`base_dtype`), or, for QLoRA, the adapted layers' base weights in
4-bit NormalFloat (`quantize_base: nf4`). The NF4 backend is torchao's `NF4Tensor`: written in
PyTorch operations (no CUDA-only kernels), it runs wherever torch runs, CPU included, and
implements FSDP2's all-gather hooks, as torchtune's QLoRA uses it; bitsandbytes' 4-bit layers
are their own `nn.Linear` classes (not a weight of ours) and need its native library per device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import ConfigError
from hpctrain.config.schema import LoraConfig
from hpctrain.errors import install_hint
from hpctrain.models.hf import ADAPTERS, canonical_name

# The adapted layers of the built-in models when `model.lora.targets` is empty: the attention
# and MLP projections of the GPT (and so of imported Llama/Mistral/Qwen2 folders), the MLP of
# torchvision's ViTs (their attention is nn.MultiheadAttention, whose projections are not
# called as modules: see `linear_layers`).
GPT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
VIT_TARGETS = ("mlp.0", "mlp.3")
NF4_BLOCK = 64  # weights per NF4 scale (QLoRA's and torchao's default)
NF4_SCALER_BLOCK = 256  # scales per second-level (double quantization) scale, at most
NF4_MIN_GROUPS = 8  # second-level groups a layer keeps at least (FSDP2 splits them)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module doc)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: names and values unchanged
        self.bias = base.bias
        self.rank, self.scale = rank, alpha / rank
        device = base.weight.device  # the meta device for a model built there
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        if not self.lora_B.weight.is_meta:
            nn.init.zeros_(self.lora_B.weight)  # the layer starts as its base
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if is_nf4(weight):
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            out = linear_nf4(x, weight)  # dequantized to x's dtype, one layer at a time
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        else:
            if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
                weight = weight.to(x.dtype)  # a bf16 base under FSDP2's fp32 gather: no-op
            out = F.linear(x, weight, self.bias)
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, scale={self.scale:g}"


def is_nf4(tensor: Any) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def matches(name: str, pattern: str) -> bool:
    """A module-name glob: `fnmatch` on the full name, or on its end (`wq` matches
    `blocks.0.attention.wq`, as peft's `target_modules` names do)."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}")


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter matrix (`...wq.lora_A.weight`)."""
    return any(part in ADAPTERS for part in name.split("."))


def adapted_module(name: str) -> str:
    """`blocks.0.attention.wq.lora_A.weight` -> `blocks.0.attention.wq`."""
    parts = name.split(".")
    return ".".join(parts[: next(i for i, p in enumerate(parts) if p in ADAPTERS)])


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's `nn.Linear` modules by name that an adapter can wrap.

    Left out: the projections of `nn.MultiheadAttention` (torchvision's ViT), which reads
    their `weight` directly instead of calling them, so an adapter there would never run.
    """
    inside_attention = {
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention)
        for child, _ in module.named_children()
    }
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in inside_attention and not is_adapter(name)
    }


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """`model.lora.targets`' default for a built-in model.

    Raises:
        ConfigError: a model without one (a custom task's: name its layers).
    """
    from hpctrain.models.gpt import GPT

    if isinstance(model, GPT):
        return GPT_TARGETS
    kind = type(model)
    if kind.__name__ == "VisionTransformer" and kind.__module__.startswith("torchvision"):
        return VIT_TARGETS
    names = list(linear_layers(model))
    raise ConfigError(
        f"model.lora.targets is empty and {kind.__name__} has no default: name the linear "
        f"layers to adapt (its linear layers: {shown(names)})"
    )


def shown(names: list[str], limit: int = 4) -> str:
    """A few names for a message, `'a', 'b' and 3 more`."""
    text = ", ".join(repr(n) for n in names[:limit]) or "none"
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


@dataclass(frozen=True)
class Adapted:
    """What `apply_lora` did to a model."""

    modules: tuple[str, ...]  # the adapted linear layers, by name
    trained_in_full: tuple[str, ...]  # parameters trained beside the adapters (a new head)
    num_trainable: int  # parameter elements that train (adapters and the above)
    num_total: int  # all parameter elements, base included
    quantized: bool  # the adapted layers' base weights are NF4
    buffers: tuple[str, ...] = ()  # the model's buffers (never held in base_dtype)

    def describe(self) -> str:
        fraction = self.num_trainable / max(1, self.num_total)
        line = (
            f"LoRA on {len(self.modules)} linear layers: {self.num_trainable:,} of "
            f"{self.num_total:,} parameters train ({fraction:.2%})"
        )
        if self.trained_in_full:
            line += f"; in full: {shown(list(self.trained_in_full))}"
        return line + ("; base in NF4" if self.quantized else "")


def select_targets(model: nn.Module, lora: LoraConfig) -> list[str]:
    """The names of the linear layers `model.lora.targets` (or the default) names.

    Raises:
        ConfigError: a pattern that matches no linear layer, listing a few that exist.
    """
    layers = list(linear_layers(model))
    key = "model.lora.targets"
    patterns = list(lora.targets) or list(default_targets(model))
    chosen: list[str] = []
    for i, pattern in enumerate(patterns):
        found = [name for name in layers if matches(name, pattern)]
        if not found:
            where = f"{key}[{i}]={pattern!r}" if lora.targets else f"{key} default {pattern!r}"
            raise ConfigError(
                f"{where}: matches no linear layer of {type(model).__name__} (its linear "
                f"layers: {shown(layers)})"
            )
        chosen.extend(name for name in found if name not in chosen)
    return sorted(chosen, key=layers.index)


def apply_lora(model: nn.Module, lora: LoraConfig, *, fresh: Iterable[str] = ()) -> Adapted:
    """Freeze `model` and put adapters on its `model.lora.targets` layers, in place.

    Args:
        model: the task's model as built (plain: before `parallelize`), possibly on the meta
            device; for `quantize_base: nf4` with its base weights loaded.
        lora: the `model.lora` settings (rank > 0).
        fresh: parameter names `model.init_from` re-initialises (a head of another number of
            classes): they train in full, like `model.lora.modules_to_save`.

    Raises:
        ConfigError: targets or modules_to_save that match nothing; a base NF4 cannot hold.
    """
    targets = select_targets(model, lora)
    saved = modules_to_save(model, lora.modules_to_save)
    for param in model.parameters():
        param.requires_grad_(False)
    in_full = sorted({*fresh, *saved})
    named = dict(model.named_parameters())
    for name in in_full:
        named[name].requires_grad_(True)
    if lora.base_dtype == "bf16":
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(torch.bfloat16)
    if lora.quantize_base == "nf4":
        require_nf4()
    for name in targets:
        parent, _, leaf = name.rpartition(".")
        base = model.get_submodule(name)
        assert isinstance(base, nn.Linear)
        if lora.quantize_base == "nf4":
            base.weight = nn.Parameter(to_nf4(base.weight.data, name), requires_grad=False)
        layer = LoRALinear(base, lora.rank, lora.alpha, lora.dropout)
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Adapted(
        modules=tuple(targets),
        trained_in_full=tuple(in_full),
        num_trainable=trainable,
        num_total=total,
        quantized=lora.quantize_base == "nf4",
        buffers=tuple(name for name, _ in model.named_buffers()),
    )


def modules_to_save(model: nn.Module, patterns: list[str]) -> list[str]:
    """The parameter names under the modules `model.lora.modules_to_save` names.

    Raises:
        ConfigError: a pattern that matches no module with parameters.
    """
    modules = [
        name for name, m in model.named_modules() if name and any(True for _ in m.parameters())
    ]
    names: list[str] = []
    for i, pattern in enumerate(patterns):
        found = [m for m in modules if matches(m, pattern)]
        if not found:
            raise ConfigError(
                f"model.lora.modules_to_save[{i}]={pattern!r}: matches no module of "
                f"{type(model).__name__} (some: {shown(modules)})"
            )
        for module in found:
            names.extend(f"{module}.{p}" for p, _ in model.get_submodule(module).named_parameters())
    return sorted(set(names))


def require_nf4() -> None:
    """Refuse `quantize_base: nf4` in one line where no NF4 backend runs (torchao missing).

    Raises:
        ConfigError: torchao is not installed, or too old to hold NF4 weights.
    """
    try:
        from torchao.quantization import NF4Tensor  # noqa: F401
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (  # noqa: F401
            linear_nf4,
        )
    except ImportError:
        raise ConfigError(
            "model.lora.quantize_base=nf4: no NF4 backend runs here (torchao's NF4Tensor is "
            f"not importable): {install_hint('qlora')}, or set model.lora.quantize_base none"
        ) from None


def to_nf4(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` as torchao's NF4Tensor: blocks of 64 weights, the block scales quantized
    again in groups of up to 256 (QLoRA's double quantization).

    Raises:
        ConfigError: a weight whose size is not a multiple of the 64-weight blocks.
    """
    from torchao.quantization import NF4Tensor

    numel = weight.numel()
    if weight.is_meta or numel % NF4_BLOCK:
        raise ConfigError(
            f"model.lora.quantize_base=nf4: {name}'s weight ({list(weight.shape)}) cannot be "
            f"held in NF4 (its size is not a multiple of {NF4_BLOCK})"
        )
    scales = numel // NF4_BLOCK
    # FSDP2 splits the second-level scales over the ranks too: a small layer gets smaller
    # groups, so there are enough of them to split (real layers keep 256: 1,024 groups and up)
    scaler_block = NF4_SCALER_BLOCK
    while scaler_block > 1 and (scales % scaler_block or scales // scaler_block < NF4_MIN_GROUPS):
        scaler_block //= 2
    return NF4Tensor.from_tensor(weight, NF4_BLOCK, scaler_block)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters of a (possibly wrapped) model, by plain name."""
    return {
        canonical_name(name): param
        for name, param in model.named_parameters()
        if is_adapter(canonical_name(name))
    }


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh values of every adapter, the same on every rank and under every strategy:
    `lora_A` as `nn.Linear` initialises a weight (Kaiming-uniform, a = sqrt(5)) from a
    generator seeded with `seed`, layer after layer in name order, `lora_B` zero (so the model
    starts as its base). Made whole on the CPU and copied into each rank's shard, so a model
    built on the meta device starts like one built in memory."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for name, param in sorted(adapter_parameters(model).items()):
        shape = tuple(param.shape)
        if ".lora_A." in f".{name}.":
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) of nn.Linear
            values[name] = torch.empty(shape).uniform_(-bound, bound, generator=generator)
        else:
            values[name] = torch.zeros(shape)
    return values


@torch.no_grad()
def set_adapters(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors (plain names) into the model's (possibly sharded) adapters.

    Raises:
        ConfigError: names or shapes that are not the model's adapters (naming a few).
    """
    params = adapter_parameters(model)
    missing = sorted(set(params) - set(values))
    unexpected = sorted(set(values) - set(params))
    wrong = sorted(k for k in set(params) & set(values) if params[k].shape != values[k].shape)
    if missing or unexpected or wrong:
        problems = [
            f"{label}: {shown(keys, 3)}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
            if keys
        ]
        raise ConfigError(f"the adapters do not fit the model's ({'; '.join(problems)})")
    for name, param in params.items():
        copy_whole(param, values[name])


def copy_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor `full` into `param`, a plain tensor or this rank's part of a
    DTensor (FSDP2's shard), without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        piece = distribute_tensor(
            full.to(param.device, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,  # every rank holds `full`: each keeps its piece
        )
        param.to_local().copy_(piece.to_local())
    else:
        param.copy_(full)


def merge_adapters(
    base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """A LoRA run's plain weights: the base's, with `W + scale B A` for every adapted layer
    and the run's other trained entries (heads, `modules_to_save`, buffers) in place of the
    base's. Computed in fp32; `trained` holds the checkpoint's entries (plain names)."""
    merged = {name: tensor.float() for name, tensor in base.items()}
    for name, tensor in trained.items():
        if not is_adapter(name):
            merged[name] = tensor
    for name in sorted(trained):
        if not name.endswith(".lora_A.weight"):
            continue
        module = adapted_module(name)
        a, b = trained[name].float(), trained[f"{module}.lora_B.weight"].float()
        weight = f"{module}.weight"
        if weight not in merged:
            raise ConfigError(f"the base has no {weight} for the adapter {name}")
        merged[weight] = merged[weight] + scale * (b @ a)
    return merged
