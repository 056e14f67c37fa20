"""A decoder-only transformer (GPT, Llama-style) in plain PyTorch, readable in one file.

token embedding → `n_layers` × Block(RMSNorm → causal self-attention with rotary position
embeddings → residual; RMSNorm → SwiGLU MLP → residual) → RMSNorm → output projection
(optionally tied to the embedding). Attention is `F.scaled_dot_product_attention(is_causal=True)`
(flash kernels on GPUs), with grouped-query attention when `n_kv_heads < n_heads`.

Packed documents (`model(tokens, positions)`): `positions` [B, T] is each token's position in
its document, 0 where a document starts. RoPE then rotates by those positions and attention
is block-causal: a token sees only the earlier tokens of its own document (`document_mask`).

The repeated blocks are `model.blocks` (an `nn.ModuleList`): `parallel/parallelize.py` shards,
checkpoints and compiles them one by one. The embedding, final norm and output projection
stay in the root: with tied embeddings the one shared matrix belongs to one FSDP2 unit. Tied
embeddings do not register a second module: the output is `F.linear(h, embedding.weight)`, so
the state dict holds the matrix once (`tok_embeddings.weight`), as safetensors wants.

`flops_per_token` gives the training FLOPs per token that MFU is measured against.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import ConfigError
from hpctrain.distributed.signals import start_compile_workers
from hpctrain.models.kv_cache import KVCache, LayerCache
from hpctrain.toolchain import find_toolchain

log = logging.getLogger("hpctrain")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a GPT. `n_kv_heads=0` means `n_heads` (plain multi-head attention)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int = 0
    ffn_dim: int = 0  # 0: SwiGLU's 8/3·dim rounded up to a multiple of 256 (of 32 below dim 512)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    # Llama 3's RoPE scaling (`rope_type: llama3`); factor 0: none.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192

    def __post_init__(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"causal_lm.{name}={getattr(self, name)}: must be at least 1")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"causal_lm.dim={self.dim}: must be a multiple of causal_lm.n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"causal_lm.dim / causal_lm.n_heads = {self.dim // self.n_heads}: rotary "
                "embeddings "
                "need an even head dimension"
            )
        if self.n_heads % kv:
            raise ConfigError(
                f"causal_lm.n_kv_heads={kv}: must divide causal_lm.n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size: `ffn_dim`, or 8/3·dim rounded up (the parameter count of a
        4·dim GELU MLP, as in PaLM and Llama)."""
        if self.ffn_dim:
            return self.ffn_dim
        multiple = 256 if self.dim >= 512 else 32
        return multiple * math.ceil(8 * self.dim / 3 / multiple)


# Shapes by name. The vocabulary comes from the index's tokenizer (causal_lm.vocab_size overrides).
# The 1B/3B/8B shapes are Llama 3.2 1B, 3B and Llama 3 8B; 125M/350M are GPT-3's small and
# medium shapes with SwiGLU (about 85M/300M parameters besides a 50k-token embedding).
PRESETS: dict[str, dict[str, int | bool]] = {
    "gpt-tiny": {"dim": 128, "n_layers": 4, "n_heads": 4, "tie_embeddings": True},
    "gpt-125m": {"dim": 768, "n_layers": 12, "n_heads": 12, "tie_embeddings": True},
    "gpt-350m": {"dim": 1024, "n_layers": 24, "n_heads": 16, "tie_embeddings": True},
    "gpt-1b": {
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_dim": 8192,
        "tie_embeddings": True,
    },
    "gpt-3b": {
        "dim": 3072,
        "n_layers": 28,
        "n_heads": 24,
        "n_kv_heads": 8,
        "ffn_dim": 8192,
        "tie_embeddings": True,
    },
    "gpt-8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336},
}
DEFAULT_PRESET = "gpt-tiny"


def gpt_config(name: str, vocab_size: int, **overrides: int | bool) -> GPTConfig:
    """The preset `name` (empty: gpt-tiny) with `overrides` applied where they are non-zero.

    `tie_embeddings` overrides only when given as a bool.

    Raises:
        ConfigError: an unknown preset (naming the known ones) or an impossible shape.
    """
    name = name or DEFAULT_PRESET
    if name not in PRESETS:
        raise ConfigError(f"model.name={name!r}: not a GPT preset ({', '.join(PRESETS)})")
    cfg = GPTConfig(vocab_size=vocab_size, **PRESETS[name])  # type: ignore[arg-type]
    changes: dict[str, Any] = {
        key: value
        for key, value in overrides.items()
        if (isinstance(value, bool) and key == "tie_embeddings")
        or (value and key != "tie_embeddings")
    }
    return replace(cfg, **changes) if changes else cfg


def check_tensor_parallel(cfg: GPTConfig, tp: int) -> None:
    """Refuse a `train.tp_degree` that does not divide the heads and KV heads (each rank
    computes whole heads); `hpctrain preflight` runs it before the queue wait."""
    for key, heads in (("causal_lm.n_heads", cfg.n_heads), ("causal_lm.n_kv_heads", cfg.kv_heads)):
        if heads % tp:
            raise ConfigError(
                f"train.tp_degree={tp}: must divide {key}={heads} (each rank computes whole heads)"
            )


def num_params(cfg: GPTConfig, *, embedding: bool = True) -> int:
    """Parameters of the model built from `cfg` (the tied matrix once); without the
    input embedding table when `embedding=False`."""
    d, kv_dim, hidden = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim
    per_block = 2 * d * d + 2 * d * kv_dim + 3 * d * hidden + 2 * d  # attention, MLP, norms
    if cfg.qkv_bias:
        per_block += d + 2 * kv_dim
    total = cfg.n_layers * per_block + d  # + the final norm
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * d  # the output projection, a matrix of its own
    if embedding:
        total += cfg.vocab_size * d
    return total


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6·N + 12·L·d·T.

    N is every parameter that a token's matmuls touch: all parameters except the input
    embedding table (a lookup, no FLOPs), with the output projection's vocab×dim matrix always
    counted, tied or not (its matmul runs for every token either way). 6·N: 2 FLOPs per
    multiply-add in the forward, twice that in the backward (Kaplan et al. 2020, section 2.1).
    12·L·d·T: the attention scores and their weighted sum, 2·2·T·d multiply-adds per layer
    forward, ×3 with the backward (PaLM, Chowdhery et al. 2022, appendix B: 6N + 12·L·H·Q·T,
    H·Q = d). Like PaLM and torchtitan it counts the full T×T score matrix although a causal
    mask makes half of it unnecessary, so MFU figures compare with theirs.
    """
    n = num_params(cfg, embedding=False)
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.dim
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 (as under autocast) and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_frequencies(cfg: GPTConfig, device: torch.device) -> torch.Tensor:
    """The rotary angular frequencies [head_dim / 2], fp32: theta^(-2i/head_dim), with Llama
    3's scaling when `cfg.rope_scaling_factor` is set (as transformers' `rope_type: llama3`):
    wavelengths above original_max_positions / low_freq_factor are stretched by the factor,
    those below original_max_positions / high_freq_factor kept, those between interpolated."""
    head_dim = cfg.head_dim
    inv_freq = cfg.rope_theta ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    factor = cfg.rope_scaling_factor
    if not factor:
        return inv_freq
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(
    seq_len: int,
    cfg: GPTConfig,
    device: torch.device,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim] (fp32) of rotary position embeddings (Su et al. 2021).

    Channel pairs (i, i + head_dim/2) rotate by the angle position · frequency i
    (`rope_frequencies`): the "half-split" layout of GPT-NeoX and Hugging Face's Llama. Made
    per forward from `arange`: cheap next to attention, and no buffer for checkpoints or
    FSDP2 to carry. With `positions` (int [B, seq_len], positions in each document) the
    tables are [B, 1, seq_len, head_dim] (one per row, broadcast over the heads) instead.
    """
    inv_freq = rope_frequencies(cfg, device)
    if positions is None:
        where = torch.arange(seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(where, inv_freq)
    else:
        angles = (positions.to(torch.float32)[..., None] * inv_freq)[:, None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, heads, T, head_dim] by the tables [T, head_dim]; in fp32, cast back."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


AttentionKernel = Literal["auto", "flex", "sdpa"]


def _flex() -> Any:
    """`torch.nn.attention.flex_attention` and `create_block_mask`, or None (older torch)."""
    try:
        from torch.nn.attention import flex_attention as flex
    except ImportError:
        return None
    return flex


_COMPILED_FLEX: Any = None


def _flex_attention() -> Any:
    """flex_attention compiled (once per process): uncompiled it materialises the whole score
    matrix (it warns as much); compiled it is a fused kernel that skips fully masked blocks."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        start_compile_workers()  # before torch starts them at the first call: signals
        _COMPILED_FLEX = torch.compile(_flex().flex_attention, dynamic=False)
    return _COMPILED_FLEX


@functools.lru_cache(maxsize=1)
def flex_toolchain_missing() -> tuple[str, ...]:
    """What this node lacks for triton to build flex attention's kernels (once per process,
    said in one log line when something is missing; see `hpctrain.toolchain`)."""
    missing = tuple(find_toolchain().missing(cuda=True))
    if missing:
        log.warning(
            "per-document attention: SDPA with a dense mask instead of flex_attention (same "
            "results, more memory and time): triton cannot build kernels on this node: %s",
            "; ".join(missing),
        )
    return missing


def choose_kernel(
    device: torch.device, head_dim: int, capability: tuple[int, int] | None = None
) -> Literal["flex", "sdpa"]:
    """flex_attention on CUDA where it runs well, else SDPA with a dense mask (see
    `document_mask`). Flex needs torch to have it, a head dimension of at least 16 (Triton's
    tl.dot) and here an Ampere or newer GPU (`capability`, looked up when None): its Triton
    kernels are sized for their shared memory, and a V100's (sm_70) is smaller (pytorch#133254
    shows the backward running out of it on 100 KB GPUs), so V100s take SDPA's masked kernel.

    A node where triton cannot build kernels (no C compiler, Python.h or libcuda.so.1:
    `flex_toolchain_missing`) falls back to SDPA's masked kernel with one log line rather
    than refusing to train: the masked path computes the same function, only slower and with
    a [B, 1, T, T] mask, so a run without `module load gcc` still trains correctly (and
    `train.compile=true`, which cannot run there at all, is refused by `plan_training`).
    """
    if device.type != "cuda" or head_dim < 16 or _flex() is None:
        return "sdpa"
    major, _ = capability or torch.cuda.get_device_capability(device)
    if major < 8 or flex_toolchain_missing():
        return "sdpa"
    return "flex"


def document_mask(positions: torch.Tensor, kernel: AttentionKernel = "sdpa") -> Any:
    """The block-causal mask of packed documents: query i sees key j when j <= i and both
    lie in the same document (a position 0 starts a new one; the tokens before a row's first 0
    continue a document begun in an earlier sequence and form one too).

    Which kernel (`choose_kernel`): on CUDA (Ampere and newer) flex_attention with a block
    mask: it skips the blocks that cross documents and never builds a T×T tensor, where SDPA
    with a dense mask loses the flash kernel (it takes no arbitrary mask) and falls back to the
    memory-efficient or math kernel. On CPUs, V100s and a torch without flex_attention, SDPA
    with an explicit boolean mask [B, 1, T, T]: flex_attention runs on CPUs only unfused
    (eager) or after a C++ compile, and SDPA's CPU flash kernel takes a mask. Both compute the
    same function (tests/models/test_gpt.py). `kernel="flex"` gives a block mask, any other a
    boolean mask; `GPT.attention_kernel` may force one (flex then runs eagerly off CUDA, as in
    the tests).
    """
    documents = (positions == 0).cumsum(dim=1)  # [B, T]: a new id at every document start
    b, t = positions.shape
    on_cuda = positions.device.type == "cuda"
    if kernel == "flex":

        def same_document_causal(
            batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, k: torch.Tensor
        ) -> torch.Tensor:
            return (q >= k) & (documents[batch, q] == documents[batch, k])

        # compiled on CUDA: eagerly it would build [B, T, T] intermediates to find the blocks
        if on_cuda:
            start_compile_workers()
        return _flex().create_block_mask(
            same_document_causal, b, None, t, t, device=positions.device, _compile=on_cuda
        )
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


# Whether SDPA has a fused CUDA kernel for grouped-query attention with a dense mask. Flash
# takes no mask; the memory-efficient kernel (the one V100s, and Ampere+ GPUs where flex does
# not run, get for a mask) takes K/V with fewer heads from torch 2.14: its forward checks
# "Number of heads in key/value must divide number of heads in query" and its backward
# "`shared_storage_dqdkdv` does not support grouped query attention" (strings of 2.14.1's
# libtorch_cuda.so; pytorch#191085). Before, SDPA sent a masked GQA call to the math kernel
# (pytorch#139586: GQA "only enabled on the flash attention backend"), which builds the fp32
# score matrix of every head.
FUSED_MASKED_GQA = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 14)


def expands_kv_for_masks(device: torch.device) -> bool:
    """Whether masked attention on `device` repeats K/V to the query heads (see above)."""
    return device.type == "cuda" and not FUSED_MASKED_GQA


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, expand_kv: bool
) -> torch.Tensor:
    """SDPA with a dense boolean `mask`, K/V of fewer heads than `q` (grouped-query) shared
    by groups of query heads; `expand_kv` repeats them to every query head first, so that a
    torch whose fused masked kernel takes no GQA keeps a fused kernel (the same function)."""
    groups = q.shape[1] // k.shape[1]
    if expand_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`mask`: None (plain causal), or a `document_mask` (bool tensor or block mask).
        `cache`: decoding (`hpctrain.models.kv_cache`), which brings its own mask."""
        b, t, _ = x.shape
        # -1: this rank's heads (all of them, or n_heads / train.tp_degree under TP)
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # decoding: attend over the cached keys and these
            return self.wo(cache.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))
        gqa = self.kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, torch.Tensor):
            out = masked_attention(q, k, v, mask, expand_kv=expands_kv_for_masks(q.device))
        elif mask.kv_indices.device.type == "cuda":
            out = _flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:  # a forced flex mask off CUDA (tests): eager, unfused
            out = _flex().flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) · w3 x) (Shazeer 2020)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        # `cache` by keyword: tensor parallelism prepares the four positional inputs only
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """`model(tokens [B, T] int64, positions=None) -> logits [B, T, vocab_size]`.

    Without `positions`, position t sees tokens ≤ t. With `positions` (int [B, T], a token's
    position in its document, 0 at a document's first token), t sees only tokens ≤ t of its
    own document and RoPE rotates by `positions` (see `document_mask`).
    """

    # FSDP2 mixed precision: a block's inputs are not cast to the compute dtype
    # (`parallel/parallelize.py`): the residual stream already is (the embedding's output),
    # and the RoPE tables must stay fp32 (in bf16, angles at large positions lose their digits).
    fsdp_cast_block_inputs = False

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention_kernel: AttentionKernel = "auto"  # for document masks, see there
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; the projections that write into the residual stream (`wo`,
        `w2`) scaled by 1/sqrt(2·n_layers) so that its variance stays put with depth (GPT-2,
        Radford et al. 2019, section 2.3); norms at 1."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, 0.0, residual_std if last in ("wo", "w2") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def parallelize_tensors(self, mesh: Any) -> None:
        """Split the GPT over the 1-D device `mesh` (`train.tp_degree` ranks of a node).

        Megatron-style: q/k/v and the MLP's w1/w3 column-wise (each rank computes its heads
        and its part of the hidden layer), `wo` and `w2` row-wise (their partial sums reduced).
        The norms run sequence-parallel (each rank normalises its part of the sequence, so
        their activations are split too), the embedding is split by vocabulary rows, the
        untied output layer by vocabulary columns; the logits come back whole on every rank.
        Layouts as in torchtitan's Llama plan; the residual stream between blocks is this
        rank's slice of the sequence.

        Raises:
            ConfigError: heads or KV heads that the degree does not divide.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp = mesh.size()
        check_tensor_parallel(self.cfg, tp)
        root: dict[str, Any] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
        }
        if self.output is not None:
            root["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        parallelize_module(self, mesh, root)
        for block in self.blocks:
            parallelize_module(
                block,
                mesh,
                {
                    "attention_norm": SequenceParallel(),
                    # (x, cos, sin, mask): only x is split
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None, None),
                        desired_input_layouts=(Replicate(), None, None, None),
                    ),
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    "mlp_norm": SequenceParallel(),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "mlp.w1": ColwiseParallel(),
                    "mlp.w3": ColwiseParallel(),
                    "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
                },
            )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`cache`: the decoding path (`hpctrain.models.decoding`): `tokens` follow those the
        cache holds, `positions` are their places in their prompts, and the cache has
        reserved their slots (`KVCache.extend`)."""
        h = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.cfg, h.device, positions)
        mask = None
        if positions is not None and cache is None:  # one mask for every block, built
            kernel = self.attention_kernel  # outside checkpointed ones
            if kernel == "auto":
                kernel = choose_kernel(tokens.device, self.cfg.head_dim)
            mask = document_mask(positions, kernel)
        for i, block in enumerate(self.blocks):
            if cache is None:
                h = block(h, cos, sin, mask)
            else:
                h = block(h, cos, sin, None, cache=cache.layers[i])
        if cache is not None:
            cache.advance()
        h = self.norm(h)
        if self.output is not None:
            return self.output(h)
        logits = F.linear(h, self.tok_embeddings.weight)
        # tensor-parallel and tied: a DTensor split by sequence or vocabulary, made whole
        full = getattr(logits, "full_tensor", None)
        return full() if full is not None else logits
