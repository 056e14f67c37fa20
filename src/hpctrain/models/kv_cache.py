"""The key/value cache of the GPT's decoding path: each new token attends to the keys and
values computed for the tokens before it instead of recomputing them.

A `KVCache` holds, for every block, preallocated key and value buffers [B, kv_heads,
capacity, head_dim] (this rank's heads under tensor parallelism) in the dtype the block
computes in (bf16 under autocast), and one flag per slot saying whether it holds a token or
left padding. `GPT.forward(tokens, positions, cache=cache)` is the decoding call: the caller
first reserves the slots of the new tokens with `extend(valid)` (which also builds the
attention mask), each block's attention stores its keys and values and attends over every
filled slot (`LayerCache.attend`), and the cache then counts the new slots as filled.

Batches of prompts of several lengths are left-padded (`hpctrain.models.decoding`): a slot of
padding is never attended to, and every token's rotary position comes from `positions`, its
place in its own prompt, so a padded row computes what it would alone. A padding query itself
attends to its own slot only: a row of all-masked scores would give NaN in SDPA, and its output
is never read.

The training forward never sees a cache: `cache=None` leaves it as it was, numerics included.
The cache is a plain class, not a dataclass: FSDP2's input casting walks dataclasses and
would copy the buffers it should write into.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerCache:
    """One block's keys and values (allocated at the first `attend`, in the block's dtype)."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's `k`, `v` [B, kv_heads, T, head_dim] in the reserved slots and
        return attention of `q` [B, heads, T, head_dim] over every filled slot."""
        owner = self.owner
        start, end = owner.length, owner.length + k.shape[2]
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], owner.capacity, k.shape[3])
            self.keys = k.new_zeros(shape)
            self.values = v.new_zeros(shape)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if keys.shape[1] != q.shape[1]:
            # Grouped-query attention: each KV head serves n_heads / kv_heads query heads.
            # Expanded here rather than with SDPA's enable_gqa, which not every kernel takes
            # together with a boolean mask.
            repeat = q.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=owner.mask)


class KVCache:
    """Keys and values of `num_layers` blocks for a batch of `batch` rows, `capacity` slots."""

    def __init__(
        self, num_layers: int, batch: int, capacity: int, device: torch.device | str
    ) -> None:
        self.capacity = capacity
        self.length = 0  # slots filled
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.layers = [LayerCache(self) for _ in range(num_layers)]
        self.mask: torch.Tensor | None = None  # of the pending step, set by `extend`
        self.pending = 0

    def extend(self, valid: torch.Tensor) -> None:
        """Reserve the slots of the next `valid.shape[1]` tokens; `valid` (bool [B, T]) is
        False for left padding. Builds the step's attention mask [B, 1, T, length + T]:
        a query sees the filled slots up to its own that hold tokens, and itself.

        Raises:
            ValueError: more tokens than the capacity left.
        """
        t = valid.shape[1]
        start, end = self.length, self.length + t
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} slots asked, capacity {self.capacity}")
        self.valid[:, start:end] = valid
        device = valid.device
        queries = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        visible = (keys <= queries)[None] & self.valid[:, None, :end]
        self.mask = (visible | (keys == queries)[None])[:, None]
        self.pending = t

    def advance(self) -> None:
        """Count the pending step's slots as filled (`GPT.forward` calls it after the blocks)."""
        self.length += self.pending
        self.pending = 0
        self.mask = None

    @torch.no_grad()
    def restart_rows(self, rows: list[int], other: KVCache) -> None:
        """Rows `rows` start again from what `other` holds (their new, shorter context, one
        row of `other` each, in order): its filled slots become these rows' last ones, and
        every earlier slot of these rows is dropped. The other rows are left as they are.

        Raises:
            ValueError: `other` holds more slots than this cache has filled.
        """
        width, end = other.length, self.length
        if width > end:
            raise ValueError(f"a restart of {width} slots into a cache of {end}")
        index = torch.tensor(rows, device=self.valid.device)
        self.valid[index] = False
        self.valid[index, end - width : end] = other.valid[:, :width]
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            if mine.keys is None or mine.values is None or theirs.keys is None:
                continue  # nothing computed yet in this block (no forward ran)
            assert theirs.values is not None
            mine.keys[index, :, end - width : end] = theirs.keys[:, :, :width]
            mine.values[index, :, end - width : end] = theirs.values[:, :, :width]

    @torch.no_grad()
    def drop_front(self, count: int) -> None:
        """Forget the first `count` slots (no row holds a token there any more): every slot
        moves `count` places forward, freeing room at the end."""
        if count <= 0:
            return
        end = self.length
        self.valid[:, : end - count] = self.valid[:, count:end].clone()
        self.valid[:, end - count :] = False
        for layer in self.layers:
            for buffer in (layer.keys, layer.values):
                if buffer is not None:
                    buffer[:, :, : end - count] = buffer[:, :, count:end].clone()
        self.length = end - count
