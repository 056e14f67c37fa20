"""The GPT model, its FLOPs formula and the MFU arithmetic, on tiny shapes (no processes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from hpctrain.config import ConfigError
from hpctrain.models.flops import PEAK_FLOPS, mfu, peak_flops, throughput_fields
from hpctrain.models.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    apply_rotary,
    choose_kernel,
    document_mask,
    flops_per_token,
    gpt_config,
    num_params,
    rotary_tables,
)
from hpctrain.parallel.parallelize import find_blocks
from hpctrain.toolchain import Toolchain

SMALL = GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, tie_embeddings=True)


def model(cfg: GPTConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def test_shapes_and_blocks_for_parallelize() -> None:
    gpt = model()
    tokens = torch.randint(0, 61, (3, 17))
    assert gpt(tokens).shape == (3, 17, 61)
    blocks = find_blocks(gpt)
    assert [name for _, name, _ in blocks] == ["0", "1"]  # model.blocks, one unit each


def test_changing_a_future_token_leaves_earlier_logits_alone() -> None:
    gpt = model(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    tokens = torch.randint(0, 61, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 61
    with torch.no_grad():
        before, after = gpt(tokens), gpt(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 9:], after[:, 9:], atol=1e-4)


def test_rotary_preserves_norms_and_makes_scores_depend_on_distance_only() -> None:
    head_dim, length = 8, 12
    one_head = GPTConfig(vocab_size=1, dim=head_dim, n_layers=1, n_heads=1, rope_theta=10000.0)
    cos, sin = rotary_tables(length, one_head, torch.device("cpu"))
    torch.manual_seed(0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    rq = apply_rotary(q.expand(1, 1, length, head_dim), cos, sin)[0, 0]
    rk = apply_rotary(k.expand(1, 1, length, head_dim), cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(length))
    torch.testing.assert_close(rq[0], q)  # position 0: no rotation
    # <R_m q, R_n k> depends on m - n only (Su et al. 2021, eq. 16)
    for m, n in ((3, 1), (7, 5), (11, 9)):
        torch.testing.assert_close(rq[m] @ rk[n], rq[2] @ rk[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rq[3] @ rk[1], rq[3] @ rk[0])
    # the half-split layout: channel i pairs with i + head_dim/2 at angle pos * theta^(-2i/d)
    angle = 5 * 10000.0 ** (-2 * 1 / head_dim)
    expected = q[1] * math.cos(angle) - q[1 + head_dim // 2] * math.sin(angle)
    assert float(rq[5, 1]) == pytest.approx(float(expected), abs=1e-5)


def test_tied_embeddings_are_one_matrix_trained_by_both_ends() -> None:
    tied = model()
    assert tied.output is None
    state = tied.state_dict()
    assert "tok_embeddings.weight" in state and not any(k.startswith("output") for k in state)
    tokens = torch.randint(0, 61, (2, 8))
    logits = tied(tokens)
    h = tied.norm(
        _through_blocks(tied, tied.tok_embeddings(tokens))
    )  # the output is h @ embedding^T
    torch.testing.assert_close(logits, h @ tied.tok_embeddings.weight.T)
    logits[:, -1, 5].sum().backward()  # token 5 is not an input: its row learns from the output
    grad = tied.tok_embeddings.weight.grad
    assert grad is not None and grad[5].abs().sum() > 0
    untied = GPT(GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, tie_embeddings=False))
    assert "output.weight" in untied.state_dict()


def _through_blocks(gpt: GPT, h: torch.Tensor) -> torch.Tensor:
    cos, sin = rotary_tables(h.shape[1], gpt.cfg, h.device)
    for block in gpt.blocks:
        h = block(h, cos, sin)
    return h


def test_init_scales_the_residual_projections_by_depth() -> None:
    cfg = GPTConfig(vocab_size=64, dim=256, n_layers=8, n_heads=4)
    gpt = model(cfg)
    assert float(gpt.blocks[0].attention.wq.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(16)
    assert float(gpt.blocks[3].attention.wo.weight.detach().std()) == pytest.approx(
        expected, rel=0.05
    )
    assert float(gpt.blocks[3].mlp.w2.weight.detach().std()) == pytest.approx(expected, rel=0.05)
    assert torch.equal(gpt.blocks[0].mlp_norm.weight, torch.ones(256))


def test_flops_formula_on_a_known_config() -> None:
    cfg = GPTConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, ffn_dim=128, tie_embeddings=True)
    # per block: wq, wo 64·64 each; wk, wv 64·64 each; w1, w3, w2 64·128 each; 2 norms of 64
    per_block = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_block + 64 + 100 * 64  # + final norm + the (tied) output projection
    assert n == 88_640
    assert flops_per_token(cfg, 16) == 6 * 88_640 + 12 * 2 * 64 * 16 == 556_416
    untied = GPTConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, ffn_dim=128)
    assert flops_per_token(untied, 16) == flops_per_token(cfg, 16)  # the same matmuls
    gqa = GPTConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=128)
    assert flops_per_token(cfg, 16) - flops_per_token(gqa, 16) == 6 * 2 * 2 * 64 * 48


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_with_the_parameters_counted(name: str) -> None:
    cfg = gpt_config(name, 50_000)
    with torch.device("meta"):  # shapes only: an 8B model costs no memory
        gpt = GPT(cfg)
    assert sum(p.numel() for p in gpt.parameters()) == num_params(cfg)
    sizes = {"gpt-tiny": 7e6, "gpt-125m": 124e6, "gpt-350m": 360e6, "gpt-1b": 1.07e9}
    sizes.update({"gpt-3b": 2.97e9, "gpt-8b": 7.6e9})
    assert num_params(cfg) == pytest.approx(sizes[name], rel=0.05)


def test_preset_overrides_and_bad_shapes_are_config_errors() -> None:
    cfg = gpt_config("gpt-tiny", 257, dim=64, n_layers=0, n_heads=2, tie_embeddings=False)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.tie_embeddings) == (64, 4, 2, False)
    with pytest.raises(ConfigError, match=r"model.name='gpt-7b': not a GPT preset \(gpt-tiny"):
        gpt_config("gpt-7b", 257)
    with pytest.raises(
        ConfigError, match="causal_lm.dim=100: must be a multiple of causal_lm.n_heads=3"
    ):
        gpt_config("gpt-tiny", 257, dim=100, n_heads=3)
    with pytest.raises(
        ConfigError, match="causal_lm.n_kv_heads=3: must divide causal_lm.n_heads=4"
    ):
        gpt_config("gpt-tiny", 257, n_kv_heads=3)


# ---------------------------------------------------------------- tokens/s and MFU


class FakeTask:
    tokens_per_sample = 128

    def flops_per_token(self) -> int:
        return 1_000_000


def test_tokens_per_second_fields_and_no_mfu_on_cpu() -> None:
    fields = throughput_fields(FakeTask(), 10.0, 2, torch.device("cpu"))
    assert fields == {"tokens_per_s": 1280.0, "tokens_per_s_per_rank": 640.0}
    assert throughput_fields(object(), 10.0, 2, torch.device("cpu")) == {}


def test_mfu_from_the_peak_table_with_a_fake_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mock: this machine has no GPU; only the device name is read on CUDA.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    fields = throughput_fields(FakeTask(), 1e6, 4, torch.device("cuda", 0))
    # 1e6 samples/s × 128 tokens × 1e6 FLOPs / (989e12 × 4 GPUs)
    assert fields["mfu"] == pytest.approx(128e12 / (989e12 * 4))
    assert fields["tokens_per_s_per_rank"] == pytest.approx(128e6 / 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert "mfu" not in throughput_fields(FakeTask(), 1e6, 4, torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("Tesla V100-SXM2-32GB", 125e12),
        ("Tesla V100-PCIE-16GB", 112e12),
        ("Tesla V100S-PCIE-32GB", 130e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", None),  # no A10: an unknown GPU gets no MFU
        ("NVIDIA A40", 150e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181e12),  # was the L4's
        ("NVIDIA L40S", 362e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),  # was the H200 SXM's
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GB200", 2500e12),  # was the B200's
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table_matches_device_names(name: str, peak: float | None) -> None:
    assert peak_flops(name) == peak


def test_every_table_entry_is_the_longest_match_of_its_own_name() -> None:
    for pattern, peak in PEAK_FLOPS:
        assert peak_flops(f"NVIDIA {pattern}") == peak, pattern
        assert peak_flops(f"Tesla {pattern}-32GB") == peak, pattern
    assert mfu(1000.0, 1e9, 1e12, 2) == 0.5


# --- packed documents: positions and the block-causal document mask ------------------------

GQA = GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def _packed_after(gpt: GPT, a: torch.Tensor, b: torch.Tensor) -> float:
    """Logits of document `b` packed after document `a` minus those of `b` alone (max abs)."""
    tokens = torch.cat([a, b])[None]
    ranges = [torch.arange(a.numel()), torch.arange(b.numel())]
    positions = torch.cat(ranges)[None].to(a.device)
    with torch.no_grad():
        packed = gpt(tokens, positions)[0, a.numel() :]
        alone = gpt(b[None])[0]
    return float((packed - alone).abs().max())


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_a_document_packed_after_another_gets_the_logits_it_gets_alone(kernel: str) -> None:
    gpt = model(GQA)
    gpt.attention_kernel = kernel  # type: ignore[assignment]
    torch.manual_seed(1)
    a, b = torch.randint(0, 61, (11,)), torch.randint(0, 61, (9,))
    assert _packed_after(gpt, a, b) < 1e-5


def test_the_same_test_fails_when_the_document_mask_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A backend that silently ignores the mask (Megatron-LM#2357) must not pass: with
    # positions still used by RoPE but plain causal attention, b sees a and its logits move.
    import hpctrain.models.gpt as gpt_module

    monkeypatch.setattr(gpt_module, "document_mask", lambda positions, kernel="auto": None)
    gpt = model(GQA)
    torch.manual_seed(1)
    a, b = torch.randint(0, 61, (11,)), torch.randint(0, 61, (9,))
    assert _packed_after(gpt, a, b) > 1e-3


def test_positions_arange_is_plain_causal_attention() -> None:
    gpt = model(GQA)
    tokens = torch.randint(0, 61, (3, 16))
    with torch.no_grad():
        plain = gpt(tokens)
        ranged = gpt(tokens, torch.arange(16).expand(3, 16))
    torch.testing.assert_close(ranged, plain, rtol=0, atol=1e-5)


def test_flex_attention_and_sdpa_masks_compute_the_same_function() -> None:
    # Both run on CPU here (flex_attention eagerly, torch 2.14); rows start mid-document
    # (a document begun in an earlier sequence) and hold several documents.
    gpt = model(GQA)
    tokens = torch.randint(0, 61, (2, 20))
    positions = torch.tensor(
        [
            [*range(7, 12), *range(8), *range(7)],
            [*range(3), *range(1), *range(16)],
        ]
    )
    out = {}
    for kernel in ("sdpa", "flex"):
        gpt.attention_kernel = kernel  # type: ignore[assignment]
        with torch.no_grad():
            out[kernel] = gpt(tokens, positions)
    torch.testing.assert_close(out["flex"], out["sdpa"], rtol=0, atol=1e-5)


def test_masked_gqa_with_kv_repeated_to_the_query_heads_is_todays_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dense-mask path on a torch whose fused masked kernel takes no GQA (CUDA before
    2.14) repeats K/V to the query heads: the same outputs and gradients as SDPA's own GQA."""
    import torch.nn.functional as F

    import hpctrain.models.gpt as gpt_module

    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, requires_grad=True) for _ in range(2))
    mask = document_mask(torch.tensor([[*range(5), *range(7)], [*range(3, 15)]]))
    today = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    today_grads = torch.autograd.grad(today.square().sum(), (q, k, v))
    expanded = gpt_module.masked_attention(q, k, v, mask, expand_kv=True)
    grads = torch.autograd.grad(expanded.square().sum(), (q, k, v))
    torch.testing.assert_close(expanded, today, rtol=0, atol=1e-6)
    for got, want in zip(grads, today_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the whole GPT, packed documents, with K/V repeated as a CUDA run of torch < 2.14 does
    gpt = model(GQA)
    tokens, positions = torch.randint(0, 61, (2, 12)), torch.tensor([[*range(5), *range(7)]] * 2)
    with torch.no_grad():
        plain = gpt(tokens, positions)
        monkeypatch.setattr(gpt_module, "expands_kv_for_masks", lambda device: True)
        repeated = gpt(tokens, positions)
    torch.testing.assert_close(repeated, plain, rtol=0, atol=1e-5)
    # where: CUDA on a torch without the fused kernel's GQA; CPUs' flash kernel takes it
    monkeypatch.undo()
    monkeypatch.setattr(gpt_module, "FUSED_MASKED_GQA", False)
    assert gpt_module.expands_kv_for_masks(torch.device("cuda", 0))
    assert not gpt_module.expands_kv_for_masks(torch.device("cpu"))
    monkeypatch.setattr(gpt_module, "FUSED_MASKED_GQA", True)
    assert not gpt_module.expands_kv_for_masks(torch.device("cuda", 0))


def test_document_masks_train_under_activation_checkpointing_and_compile() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    tokens = torch.randint(0, 61, (2, 12))
    positions = torch.tensor([[*range(5), *range(7)], [*range(3, 15)]])
    grads = []
    for wrap in (None, checkpoint_wrapper, lambda b: torch.compile(b, backend="aot_eager")):
        gpt = model(GQA).train()
        if wrap is not None:
            for parent, name, block in find_blocks(gpt):
                setattr(parent, name, wrap(block))
        gpt(tokens, positions).square().mean().backward()
        grads.append(gpt.tok_embeddings.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-5, atol=1e-6)


FULL_TOOLCHAIN = Toolchain(
    c_compiler="/usr/bin/gcc",
    python_h="/usr/include/python3.11/Python.h",
    libcuda="/usr/lib/x86_64-linux-gnu",
    python_include="/usr/include/python3.11",
)


@pytest.fixture
def toolchain(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """`toolchain(c_compiler="")`: the node's kernel-building pieces, faked (this machine has
    no GPU driver, so no libcuda.so.1); the per-process answer is forgotten before and after."""
    import hpctrain.models.gpt as gpt_module

    def fake(**missing: str) -> None:
        found = replace(FULL_TOOLCHAIN, **missing)
        monkeypatch.setattr(gpt_module, "find_toolchain", lambda: found)
        gpt_module.flex_toolchain_missing.cache_clear()

    fake()
    yield fake
    gpt_module.flex_toolchain_missing.cache_clear()


def test_the_kernel_is_flex_attention_on_cuda_where_its_triton_kernel_runs(
    toolchain: Callable[..., None],
) -> None:
    # torch.device("cuda") is only a name here, the capability given: nothing runs on a GPU
    gpu = torch.device("cuda", 0)
    assert choose_kernel(gpu, 64, (9, 0)) == choose_kernel(gpu, 128, (8, 0)) == "flex"
    assert choose_kernel(gpu, 64, (7, 0)) == "sdpa"  # V100: SDPA's masked kernel
    assert choose_kernel(gpu, 8, (9, 0)) == "sdpa"  # tl.dot needs >= 16
    assert choose_kernel(torch.device("cpu"), 64) == "sdpa"


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ({"c_compiler": ""}, "no C compiler (neither gcc nor clang on PATH"),
        ({"python_h": ""}, "no Python.h in /usr/include/python3.11"),
        ({"libcuda": ""}, "no libcuda.so.1 where triton looks"),
    ],
)
def test_without_what_triton_builds_with_flex_falls_back_to_sdpa_in_one_line(
    toolchain: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
    missing: dict[str, str],
    named: str,
) -> None:
    """Flex attention (and its block mask) compile through triton, which needs a C compiler,
    Python.h and libcuda.so.1: without one the first forward failed deep inside triton."""
    toolchain(**missing)
    gpu = torch.device("cuda", 0)  # a name only: the capability is given
    with caplog.at_level("WARNING", logger="hpctrain"):
        assert choose_kernel(gpu, 64, (9, 0)) == "sdpa"
        assert choose_kernel(gpu, 128, (8, 0)) == "sdpa"  # every forward asks; one line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("per-document attention: SDPA with a dense mask instead of")
    assert named in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_attention_on_cuda_is_the_sdpa_mask_function() -> None:
    cfg = GPTConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    gpt = model(cfg).cuda()
    tokens = torch.randint(0, 61, (2, 200), device="cuda")  # 200: not a multiple of 128
    positions = torch.tensor(
        [[*range(30, 100), *range(130)], [*range(150), *range(50)]], device="cuda"
    )
    if choose_kernel(tokens.device, cfg.head_dim) != "flex":
        pytest.skip("flex_attention is not this GPU's kernel (before Ampere)")
    out, grads = {}, {}
    for kernel in ("auto", "sdpa"):
        gpt.attention_kernel = kernel  # type: ignore[assignment]
        gpt.zero_grad()
        out[kernel] = gpt(tokens, positions)
        out[kernel].square().mean().backward()
        grads[kernel] = gpt.tok_embeddings.weight.grad.clone()
    torch.testing.assert_close(out["auto"], out["sdpa"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads["auto"], grads["sdpa"], rtol=1e-3, atol=1e-5)
    gpt.attention_kernel = "auto"
    torch.manual_seed(1)
    a, b = torch.randint(0, 61, (140,)), torch.randint(0, 61, (60,))
    assert _packed_after(gpt, a.cuda(), b.cuda()) < 1e-4
