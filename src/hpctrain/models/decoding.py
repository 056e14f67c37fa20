"""Decoding with the GPT: several prompts at once, with a key/value cache.

`decode(model, prompts, ...)` left-pads the prompts into one batch, runs them through the
model once (the prefill, filling the cache: `hpctrain.models.kv_cache`), then adds one token
per row and step, each step a forward of one token per row over the cache. A row stops at a
stop id (end of document, end of turn); the batch stops when every row has, or after
`max_new_tokens`. Greedy when `temperature` is 0 (the argmax; what evaluation scores), else
sampled from softmax(logits / temperature) among the `top_k` likeliest.

Every row computes what it would alone: padding slots are masked out and rotary positions
count from each prompt's first token (one prompt is one document, as `data.document_mask`
trains). A model sees at most `window` tokens (the training `data.seq_len`): a longer prompt
keeps its last `window - 1` tokens, and a row that reaches the window restarts from its own
last half (positions count from there: RoPE scores depend on distances only): that row alone,
in a forward of the rows that restart at that step, whose keys and values then replace the
row's in the cache; the other rows keep their context. So a row's tokens do not depend on the
other prompts of its batch, their order or lengths (`tests/models/test_decoding.py`).

Works on any wrapping of the GPT (plain, DDP, FSDP2, tensor-parallel): it calls the model's
own forward. Where a forward is a collective (FSDP2 gathers parameters, tensor parallelism
splits each matmul), every rank must run the same forwards: `lockstep=True` agrees on "any
row still running" and "any row restarting" over the ranks at every step (one all-reduce of
one number; a rank with no row to restart runs the restart forward on one padding token),
and callers give every rank the same number of batches.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from hpctrain.distributed import all_reduce_max
from hpctrain.models.kv_cache import KVCache


def unwrapped(model: nn.Module) -> nn.Module:
    """The GPT inside DDP (`module`) or torch.compile (`_orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def sequence_multiple(model: nn.Module) -> int:
    """The number every sequence length must be a multiple of: the tensor-parallel degree of a
    GPT split over a mesh's "tp" ranks (its norms split the sequence among them), else 1."""
    weight = unwrapped(model).blocks[0].attention.wq.weight  # type: ignore[index,union-attr]
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return 1
    return int(mesh["tp"].size())


def left_padded(
    rows: Sequence[Sequence[int]], device: torch.device, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], positions [B, T], valid [B, T]) of `rows` left-padded to the longest,
    T rounded up to a multiple of `multiple`: padding is id 0 at position 0, flagged invalid."""
    width = -(-max(len(row) for row in rows) // multiple) * multiple
    lengths = torch.tensor([len(row) for row in rows], device=device)
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        if row:
            tokens[i, width - len(row) :] = torch.tensor(list(row), device=device)
    offsets = torch.arange(width, device=device)[None, :] - (width - lengths)[:, None]
    return tokens, offsets.clamp(min=0), offsets >= 0


def next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """One id per row of `logits` [B, vocab] (fp32): argmax, or sampled (see the module)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def decode(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    window: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    lockstep: bool = False,
    stop_when: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The ids each prompt is continued with (a stop id, when reached, last).

    Args:
        model: a GPT, possibly wrapped; in eval mode (the caller's autocast applies).
        prompts: one list of ids per row, none empty.
        window: the most tokens the model sees at once; 0: no limit.
        lockstep: every rank decodes the same number of steps (see the module).
        stop_when: called with a running row's new ids after each step; True stops the row
            (a stop text: the harness's `until`).

    Raises:
        ValueError: an empty prompt.
    """
    if any(not prompt for prompt in prompts):
        raise ValueError("a prompt holds no tokens")
    if not prompts or max_new_tokens < 1:
        return [[] for _ in prompts]
    device = next(model.parameters()).device
    layers = len(unwrapped(model).blocks)  # type: ignore[arg-type]
    multiple = sequence_multiple(model)
    limit = window or max(len(p) for p in prompts) + max_new_tokens
    keep = max(1, limit // 2)  # the tokens a row restarts from when it reaches the window
    rows = [list(prompt)[-(limit - 1) :] if limit > 1 else list(prompt)[-1:] for prompt in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    running = torch.ones(len(prompts), dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
    # A step feeds each row's new token; under tensor parallelism after `multiple - 1`
    # padding slots, so that the sequence splits evenly over the ranks.
    step_valid = torch.zeros(len(rows), multiple, dtype=torch.bool, device=device)
    step_tokens = torch.zeros(len(rows), multiple, dtype=torch.long, device=device)
    step_positions = torch.zeros_like(step_tokens)
    # Room for the longest context a row holds (a window) and some steps: a row that restarts
    # drops its earlier slots, and once the cache is full the slots no row holds are dropped
    # (`KVCache.drop_front`: a copy of the cache every `room` steps at most).
    room = max(1, limit // 8)
    capacity = (limit + 1 + room) * multiple
    cache, logits, positions = _prefill(model, rows, layers, capacity, multiple, device)
    held = [len(row) for row in rows]  # the tokens of each row the cache will hold
    for step in range(max_new_tokens):
        ids = next_tokens(logits, temperature, top_k, generator)
        for i, (token, alive) in enumerate(zip(ids.tolist(), running.tolist(), strict=True)):
            if alive:
                new[i].append(token)
                rows[i].append(token)
                held[i] += 1
        stopped = running & torch.isin(ids, stops)
        if stop_when is not None:
            for i in (running & ~stopped).nonzero()[:, 0].tolist():
                stopped[i] = stop_when(new[i])
        if stopped.any():  # a stopped row's slots are never read again: free them
            running &= ~stopped
            cache.valid[stopped] = False
        if step == max_new_tokens - 1:
            break
        # A row that reaches the window restarts from its last `keep` tokens, as it would
        # alone; the others go on with their own context (every row computes what it would
        # alone, whatever the batch holds).
        restart = [i for i, alive in enumerate(running.tolist()) if alive and held[i] > limit]
        code = 2.0 if restart else float(running.any())
        if lockstep:  # every rank runs the same forwards: a restart forward when any rank does
            code = all_reduce_max(code, device)
        if not code:
            break
        step_valid[:, -1] = running
        if restart:
            step_valid[restart, -1] = False  # its new token is in the restart forward
        step_tokens[:, -1], step_positions[:, -1] = ids, positions
        if cache.length + multiple > cache.capacity:
            cache.drop_front(_unused_front(cache, running, multiple))
        cache.extend(step_valid)
        logits = model(step_tokens, step_positions, cache=cache)[:, -1].float()
        positions = positions + 1
        if code == 2.0:
            restarted = _restart(
                model, [rows[i][-keep:] for i in restart], layers, multiple, device
            )
            if restart:
                again, logits_again, positions_again = restarted
                cache.restart_rows(restart, again)
                logits[restart] = logits_again
                positions[restart] = positions_again
                for i in restart:
                    held[i] = keep
    return new


def _unused_front(cache: KVCache, running: torch.Tensor, multiple: int) -> int:
    """The number of leading slots no running row holds a token in (a multiple of
    `multiple`)."""
    filled = cache.valid[running, : cache.length]
    if not filled.numel():
        return cache.length // multiple * multiple
    first = int(filled.int().argmax(dim=1).min())
    return first // multiple * multiple


def _restart(
    model: nn.Module,
    rows: list[list[int]],
    layers: int,
    multiple: int,
    device: torch.device,
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """The forward of the rows that restart (`rows`: their last tokens, all of one length),
    in a cache of their own; with no row (under `lockstep`, another rank restarts), one
    padding token, so that this rank runs the same forwards."""
    if not rows:
        rows = [[0]]
    width = -(-len(rows[0]) // multiple) * multiple
    return _prefill(model, rows, layers, width, multiple, device)


def _prefill(
    model: nn.Module,
    rows: list[list[int]],
    layers: int,
    capacity: int,
    multiple: int,
    device: torch.device,
) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A fresh cache of `capacity` slots (at least the rows' width) holding `rows`; the
    logits of each row's next token (fp32 [B, vocab]) and the position of that token in
    each row."""
    tokens, positions, valid = left_padded(rows, device, multiple)
    cache = KVCache(layers, len(rows), max(capacity, tokens.shape[1]), device)
    cache.extend(valid)
    logits: Any = model(tokens, positions, cache=cache)
    return cache, logits[:, -1].float(), positions[:, -1] + 1
