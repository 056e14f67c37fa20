"""Masked language-model batches whose rows hold very different numbers of targets, and the
trainer overrides that train on them, for the loss-normalisation tests (`test_step_targets.py`,
`targets_worker.py`): gradient accumulation and data-parallel ranks must give the loss and
gradients of one large batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.lm_kit import SEQ_LEN, write_token_shards

# targets per row (the loss mask's marked positions after the first): one full row, a few,
# none (a prompt that fills the sequence), a dozen
TARGETS = (SEQ_LEN, 3, 0, 12)
TINY_LM = (
    "task=causal_lm",
    f"data.seq_len={SEQ_LEN}",
    "data.workers_per_rank=0",
    "data.val=",
    "causal_lm.dim=32",
    "causal_lm.n_layers=2",
    "causal_lm.n_heads=4",
    "train.optimizer=sgd",
    "train.lr=0.1",
    "train.warmup_steps=0",
    "train.precision=fp32",
    "train.deterministic=true",
    "train.max_steps=4",
    "train.log_every=1",
    "checkpoint.every_steps=1000",
    "logging.progress=lines",
)


def lm_index(folder: Path) -> Path:
    """Two token shards (the trainer needs an index to start; the steps get `rows`)."""
    return write_token_shards(folder, 2, seed=0)


def lm_overrides(index: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"run_dir={run_dir}", f"data.train={index}", *TINY_LM, *extra]


def rows(targets: tuple[int, ...] = TARGETS, seed: int = 0) -> list[dict[str, Any]]:
    """One-row batches: random byte ids, a loss mask marking `targets[i]` positions of row
    i (its last ones, as a response after its prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(targets):
        tokens = torch.randint(0, 257, (1, SEQ_LEN + 1), generator=g)
        mask = torch.zeros(1, SEQ_LEN + 1, dtype=torch.bool)
        if n:
            mask[0, -n:] = True
        out.append(
            {"tokens": tokens, "loss_mask": mask, "valid": torch.ones(1, dtype=torch.bool),
             "key": [f"row/{i}"]}
        )  # fmt: skip
    return out


def stack(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch of the rows of `batches`, in order."""
    return {
        name: (
            [k for b in batches for k in b[name]]
            if name == "key"
            else torch.cat([b[name] for b in batches])
        )
        for name in batches[0]
    }


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a plain tensor (a DTensor's whole)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name.removeprefix("module.")] = grad.detach().clone()
    return out
