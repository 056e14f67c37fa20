"""Tokens per second and model FLOPs utilization (MFU) for the train records of `metrics.jsonl`.

A task that defines `tokens_per_sample` (an int: `causal_lm` gives `data.seq_len`) gets
`tokens_per_s` (all ranks) and `tokens_per_s_per_rank` in every train record. One that also
defines `flops_per_token()` gets, on a CUDA device whose peak is in `PEAK_FLOPS`, `mfu`: the
FLOPs the model needed per second over what the GPUs could do, `tokens_per_s ×
flops_per_token / (peak × world_size)`. The peak is the dense bf16 (fp16 on V100) tensor-core
figure of the vendor's data sheet, whatever precision trains, as torchtitan and PaLM report it.
On an unknown device or a CPU `mfu` is left out, never guessed.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: `hpctrain bench gpu-lm` reads the table before torch
    import torch

# (a model name as it appears in torch.cuda.get_device_name, dense bf16 tensor FLOP/s; fp16 on
# V100, which has no bf16), from NVIDIA's data sheets without sparsity. `peak_flops` matches a
# name as a whole word of the device's name and the longest match wins, whatever the order:
# "NVIDIA H200 NVL" is the H200 NVL, not the H200; "NVIDIA L40" is no L4, "NVIDIA GH200" no
# H200, "NVIDIA A10G" no A10 (unknown: no MFU). The one table: `hpctrain bench gpu-lm` reads it.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),  # per GPU of a GB200 NVL72: 5 PFLOP/s with sparsity
    ("B200", 2250e12),
    ("GH200", 989e12),
    ("H200", 989e12),  # SXM
    ("H200 NVL", 835e12),  # PCIe
    ("H100", 989e12),  # SXM (Jean Zay gpu_p6: "NVIDIA H100 80GB HBM3")
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("A100", 312e12),  # SXM4 and PCIe alike (Jean Zay gpu_p5)
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A40", 150e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),  # SXM2 ("Tesla V100-SXM2-32GB"; Jean Zay gpu_p13, gpu_p2)
    ("V100-PCIE", 112e12),
    ("V100S", 130e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16/fp16 tensor peak of the GPU called `device_name`, or None if unknown.

    A pattern matches where it stands as whole words in the name (no letter or digit right
    before or after it); of the patterns that match, the longest wins.
    """
    name = device_name.lower()
    found = [
        (len(pattern), peak)
        for pattern, peak in PEAK_FLOPS
        if re.search(rf"(?<![a-z0-9]){re.escape(pattern.lower())}(?![a-z0-9])", name)
    ]
    return max(found)[1] if found else None


def throughput_fields(
    task: Any, samples_per_s: float, world_size: int, device: torch.device
) -> dict[str, float]:
    """`tokens_per_s`, `tokens_per_s_per_rank` and, where the peak is known, `mfu`.

    `samples_per_s` is the train record's (all ranks). Empty for a task without
    `tokens_per_sample`.
    """
    tokens_per_sample = getattr(task, "tokens_per_sample", None)
    if not tokens_per_sample:
        return {}
    tokens_per_s = samples_per_s * tokens_per_sample
    fields = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": tokens_per_s / world_size}
    flops_per_token = getattr(task, "flops_per_token", None)
    if flops_per_token is not None and device.type == "cuda":
        import torch

        peak = peak_flops(torch.cuda.get_device_name(device))
        if peak is not None:
            fields["mfu"] = mfu(tokens_per_s, flops_per_token(), peak, world_size)
    return fields


def mfu(tokens_per_s: float, flops_per_token: float, peak: float, world_size: int) -> float:
    """Achieved model FLOP/s over the peak of `world_size` devices (a fraction, not a %)."""
    return tokens_per_s * flops_per_token / (peak * world_size)
