"""The global gradient norm summed in one order (`hpctrain.parallel.grad_norm`), in one
process: torch's norm to rounding, gradients of every shape (an FSDP2 rank's empty shard
included), the same bits for a gradient whole or cut into row blocks. Several ranks:
tests/parallel/test_lora_ranks.py (DDP, FSDP2 and HSDP clip bitwise alike)."""

from __future__ import annotations

import torch

from hpctrain.parallel.grad_norm import clip_grad_norm, global_grad_norm, row_norms


def params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=generator)
        made.append(p)
    return made


def test_the_norm_is_torchs_to_rounding_for_gradients_of_every_shape() -> None:
    grads = params((7, 5), (3,), (1, 300), (2, 3, 4), (0, 4), (0,), ())
    expected = torch.nn.utils.get_total_norm([p.grad for p in grads])
    torch.testing.assert_close(global_grad_norm(grads), expected, rtol=1e-6, atol=0)
    assert row_norms(torch.zeros(0, 3, 4)).shape == (0,)  # an empty shard: no rows


def test_row_norms_do_not_depend_on_which_rows_are_together() -> None:
    """What makes FSDP2's shards sum as DDP's whole gradient: each row's norm is the same
    bits wherever the row is (one row alone included)."""
    grad = torch.randn(9, 70000, generator=torch.Generator().manual_seed(1))
    whole = row_norms(grad)
    assert torch.equal(
        torch.cat([row_norms(grad[:4]), row_norms(grad[4:8]), row_norms(grad[8:])]), whole
    )


def test_clipping_scales_as_torch_does() -> None:
    ours, theirs = params((6, 4), (4,)), params((6, 4), (4,))
    norm = clip_grad_norm(ours, 0.5)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, 0.5), rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    unclipped = params((3,))
    before = unclipped[0].grad.clone()
    clip_grad_norm(unclipped, 1e6)
    assert torch.equal(unclipped[0].grad, before)  # below max_norm: left as they are
