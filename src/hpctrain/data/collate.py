"""Default collate: transformed samples -> one batch, written straight into batch memory.

For each field of the samples (the loader owns `key` and `valid`):

- torch tensors (and numpy arrays) of one shape and dtype across the batch -> stacked [B, ...]
  into the batch memory (in a worker: one of its pooled shared-memory buffers);
- Python bool / int / float -> a bool / int64 / float64 tensor [B] (as torch's
  default_collate), in the batch memory too;
- anything else (str, bytes, dict, list, None) -> a Python list of the B values.

A field whose tensor shapes or dtypes differ within a batch, or that some samples lack, is a
`BatchError` naming the field, the key and both shapes: a Task with samples of several sizes
defines its own `collate(samples) -> batch`, whose tensors then travel the same way.

Each sample is written into the batch as soon as it is made, and dropped: the next one then
reuses the same (cache-hot) memory. Holding a batch of images until a final `torch.stack`
cost ~15 us more per image here (page faults as the heap grows and shrinks by a batch each
time, then a copy from cold memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import numpy as np
import torch

from hpctrain.errors import DataError

Sample = dict[str, Any]
Batch = dict[str, Any]
LOADER_FIELDS = ("key", "valid")  # set by the loader, whatever a sample holds


class BatchError(DataError, ValueError):
    """Samples that cannot form one batch: a field's shapes or dtypes differ, or a field is
    missing from some samples (the message names the field and the key)."""


class BatchMemory(Protocol):
    """Where batches are written: a worker's pooled buffers, or plain tensors."""

    def allocate(
        self, fields: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> tuple[dict[str, torch.Tensor], Callable[[dict[str, Any]], Any]]: ...


_SCALAR_DTYPES: dict[type, torch.dtype] = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
}


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype != object:
        if not value.flags.writeable:  # torch refuses to wrap read-only arrays quietly
            value = value.copy()
        return torch.from_numpy(value)
    return None


def _describe(value: Any) -> str:
    tensor = _as_tensor(value)
    if tensor is not None:
        return f"{list(tensor.shape)} {tensor.dtype}"
    return type(value).__name__


class Collator:
    """The default collate for one batch of `size` samples, filled one sample at a time.

    The first sample given fixes the batch's fields and their shapes; `put` writes a sample
    at its position, `finish` returns what the batch memory makes of it (given the batch's
    keys and valid flags).
    """

    def __init__(self, first: Sample, first_key: str, size: int, memory: BatchMemory) -> None:
        self.size = size
        self.first_key = first_key
        self.tensors: list[tuple[str, torch.Size, torch.dtype]] = []
        self.scalars: dict[str, list[Any]] = {}
        self.scalar_types: dict[str, type] = {}
        self.others: dict[str, list[Any]] = {}
        specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, value in first.items():
            if name in LOADER_FIELDS:
                continue
            tensor = _as_tensor(value)
            if tensor is not None:
                self.tensors.append((name, tensor.shape, tensor.dtype))
                specs.append((name, (size, *tensor.shape), tensor.dtype))
            elif type(value) in _SCALAR_DTYPES:
                self.scalars[name] = [value] * size
                self.scalar_types[name] = type(value)
                specs.append((name, (size,), _SCALAR_DTYPES[type(value)]))
            else:
                self.others[name] = [None] * size
        specs.append(("valid", (size,), torch.bool))
        self.num_fields = len(self.tensors) + len(self.scalars) + len(self.others)
        self.views, self.send = memory.allocate(specs)
        # each field's B rows, made at once: indexing a row per sample cost ~2.5 us here
        self.rows = {name: self.views[name].unbind(0) for name, _s, _d in self.tensors}

    def put(self, pos: int, sample: Sample, key: str) -> None:
        """Write `sample` (whose key is `key`) at position `pos` of the batch."""
        rows = self.rows
        for name, shape, dtype in self.tensors:
            value = sample.get(name, _MISSING)
            tensor = value if type(value) is torch.Tensor else _as_tensor(value)
            if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
                self._mismatch(name, f"{list(shape)} {dtype}", value, key)
            rows[name][pos].copy_(tensor)
        for name, values in self.scalars.items():
            value = sample.get(name, _MISSING)
            kind = self.scalar_types[name]
            if type(value) is not kind and not (kind is float and type(value) is int):
                self._mismatch(name, kind.__name__, value, key)
            values[pos] = value
        for name, values in self.others.items():
            value = sample.get(name, _MISSING)
            if value is _MISSING:
                self._mismatch(name, "", value, key)
            values[pos] = value
        extra = len(sample) - self.num_fields
        if extra:  # more fields than the first sample: the loader's own, or unknown ones
            extra -= ("key" in sample) + ("valid" in sample)
        if extra:
            known = {name for name, _s, _d in self.tensors} | {*self.scalars, *self.others}
            name = next(n for n in sample if n not in known and n not in LOADER_FIELDS)
            raise BatchError(
                f"field {name!r} of sample {key!r} is not in sample {self.first_key!r} of the "
                "same batch: every sample of a batch needs the same fields"
            )

    def _mismatch(self, name: str, expected: str, value: Any, key: str) -> NoReturn:
        if value is _MISSING:
            raise BatchError(
                f"sample {key!r} has no field {name!r}, which sample {self.first_key!r} of the "
                "same batch has: every sample of a batch needs the same fields"
            )
        raise BatchError(
            f"field {name!r} differs within a batch: {expected} in sample {self.first_key!r}, "
            f"{_describe(value)} in sample {key!r}; the transform must return one shape and "
            "type per field (e.g. a crop or resize), or the Task defines its own collate"
        )

    def finish(self, keys: list[str], valid: list[bool], extra: dict[str, Any]) -> Any:
        """The batch as its memory sends it: every field, `key` (list), `valid` [B] and the
        loader's `extra` fields."""
        for name, values in self.scalars.items():
            self.views[name].copy_(torch.tensor(values, dtype=self.views[name].dtype))
        self.views["valid"].copy_(torch.tensor(valid, dtype=torch.bool))
        return self.send({**self.others, **extra, "key": keys})


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


def pack_batch(
    batch: Batch, keys: list[str], valid: list[bool], memory: BatchMemory, extra: dict[str, Any]
) -> Any:
    """A batch made by a Task's own `collate`: its top-level tensors (and numpy arrays)
    copied into batch memory, the rest as it is, plus `key`, `valid` and `extra`."""
    if not isinstance(batch, dict):
        raise TypeError(f"a Task's collate must return a dict of fields, not {type(batch)}")
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for name, value in batch.items():
        if name in LOADER_FIELDS:
            continue
        tensor = _as_tensor(value)
        if tensor is not None:
            tensors[name] = tensor
        else:
            rest[name] = value
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    views, send = memory.allocate([*specs, ("valid", (len(valid),), torch.bool)])
    for name, tensor in tensors.items():
        views[name].copy_(tensor)
    views["valid"].copy_(torch.tensor(valid, dtype=torch.bool))
    return send({**rest, **extra, "key": keys})
