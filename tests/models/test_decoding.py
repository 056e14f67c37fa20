"""Decoding with the KV cache (`hpctrain.models.decoding`): the same tokens as recomputing the
whole sequence at every step, for left-padded batches of several lengths, past the window,
and the same tokens as transformers' own `generate` with its cache (greedy, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.models.decoding import decode, left_padded
from hpctrain.models.gpt import GPT, GPTConfig
from hpctrain.models.kv_cache import KVCache

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40]]


def noisy_gpt(**shape: int | bool) -> GPT:
    """A small random GPT whose weights are large enough that greedy choices vary."""
    cfg = GPTConfig(**{"vocab_size": 97, "dim": 64, "n_layers": 2, "n_heads": 4, **shape})  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(8)
    return model


@torch.no_grad()
def recomputed(model: GPT, prompt: list[int], steps: int, window: int = 0) -> list[int]:
    """Greedy ids by running the whole (last `window`) sequence at every step."""
    ids, new = list(prompt), []
    for _ in range(steps):
        token = int(model(torch.tensor([ids[-window:] if window else ids]))[0, -1].argmax())
        new.append(token)
        ids.append(token)
    return new


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [{"n_kv_heads": 2}, {"tie_embeddings": True}, {"qkv_bias": True}],
    ids=["gqa", "tied", "qkv-bias"],
)
def test_a_padded_batch_decodes_each_prompt_as_recomputing_it_alone(shape: dict) -> None:
    model = noisy_gpt(**shape)
    decoded = decode(model, PROMPTS, max_new_tokens=12)
    assert decoded == [recomputed(model, prompt, 12) for prompt in PROMPTS]
    assert len({tuple(row) for row in decoded}) == len(PROMPTS)  # not one repeated token


def test_stop_ids_end_a_row_and_the_window_restarts_the_cache() -> None:
    model = noisy_gpt()
    (full,) = decode(model, [PROMPTS[0]], max_new_tokens=12)
    stop = full[4]
    (stopped,) = decode(model, [PROMPTS[0]], max_new_tokens=12, stop_ids={stop})
    assert stopped == full[: full.index(stop) + 1]
    # past a window of 8, the cache restarts from the last 4 tokens; before, recomputing
    (long,) = decode(model, [PROMPTS[0]], max_new_tokens=10, window=8)
    assert long[:3] == recomputed(model, PROMPTS[0], 3, window=8)
    assert len(long) == 10


@torch.no_grad()
def alone(model: GPT, prompt: list[int], steps: int, window: int) -> list[int]:
    """Greedy ids of one prompt recomputed whole at every step, with decoding's window rule:
    the last `window - 1` tokens of the prompt, and past `window` tokens a restart from the
    last `window // 2` (positions from there)."""
    context, new = list(prompt)[-(window - 1) :], []
    for _ in range(steps):
        token = int(model(torch.tensor([context]))[0, -1].argmax())
        new.append(token)
        context.append(token)
        if len(context) > window:
            context = context[-(window // 2) :]
    return new


def test_rows_past_the_window_decode_as_each_would_alone() -> None:
    """Rows of several lengths reach a window of 8 at different steps, several times: each
    row's ids are those of that prompt decoded alone, in any batch, in any order."""
    model = noisy_gpt()
    prompts = [*PROMPTS, [3, 1, 4, 1, 5, 9, 2], [8] * 6]
    expected = [alone(model, prompt, 20, window=8) for prompt in prompts]
    assert [decode(model, [p], max_new_tokens=20, window=8)[0] for p in prompts] == expected
    assert decode(model, prompts, max_new_tokens=20, window=8) == expected
    backwards = decode(model, prompts[::-1], max_new_tokens=20, window=8)
    assert backwards[::-1] == expected
    # a row that stops early leaves the others as they were
    stop = expected[1][2]
    stopped = decode(model, prompts, max_new_tokens=20, window=8, stop_ids={stop})
    for row, full in zip(stopped, expected, strict=True):
        assert row == (full[: full.index(stop) + 1] if stop in full else full)


def test_padding_slots_are_masked_and_a_full_cache_refuses_more() -> None:
    tokens, positions, valid = left_padded([[5, 6], [7, 8, 9]], torch.device("cpu"), 2)
    assert tokens.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    assert positions.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]
    cache = KVCache(1, 2, 4, "cpu")
    cache.extend(valid)
    assert cache.mask is not None and not cache.mask[0, 0, 3, :2].any()  # padding unseen
    assert cache.mask[0, 0, 0, 0]  # a padding query sees itself (no all-masked row)
    cache.advance()
    with pytest.raises(ValueError, match="KV cache full"):
        cache.extend(torch.ones(2, 1, dtype=torch.bool))


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate_with_its_cache(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.models.test_hf import imported, save_hf

    reference = save_hf(tmp_path / "llama", "llama", tie_word_embeddings=False)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" not in name:
                param.mul_(8)
    reference.save_pretrained(tmp_path / "llama")
    ours = imported(tmp_path / "llama")
    tokens, _, valid = left_padded(PROMPTS, torch.device("cpu"))
    eos = reference.generation_config.eos_token_id  # 2: the first row ends with it
    config = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        theirs = reference.generate(
            input_ids=tokens, attention_mask=valid.long(), generation_config=config
        )[:, tokens.shape[1] :]
    decoded = decode(ours, PROMPTS, max_new_tokens=10, stop_ids={eos})
    assert decoded[0][-1] == eos  # transformers pads a row that stopped with pad_token_id
    assert [row + [0] * (10 - len(row)) for row in decoded] == theirs.tolist()
