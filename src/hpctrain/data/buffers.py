"""Pooled shared-memory batch buffers: how a batch travels from a loader worker to the training
process (`hpctrain.data.transport` runs the workers).

Every tensor field of a batch is written by the worker into one of its reused
shared-memory buffers (`BatchBuffers`); the message names the buffer and where each field lies
in it (`PooledBatch`), and carries the rest of the batch (strings, lists) pickled. The
training process maps each buffer once (`MappedBuffers`) and lends the batch's tensors as
views of it; when the last view is gone, a finalizer writes the buffer's serial number to the
worker's *release pipe*, and the worker reads its pipe (without blocking) before it picks a
buffer. The pipe is what makes reuse safe on any CPU: a write and a read of a pipe are system
calls that order memory, so the training process's last reads of a batch happen before the
worker overwrites it, on x86 and on aarch64 alike (a flag in shared memory read with a plain
load would need barriers that Python cannot express). Eight-byte writes to a pipe are atomic
and may come from any thread (the pinning thread drops batches too).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

from hpctrain.compat_torch import new_shared_bytes

ALIGN = 64  # each field of a buffer starts on a cache line (and any dtype's alignment)
ROUND = 1 << 16  # buffers are made in multiples of this: small size changes reuse them
_SERIAL = struct.Struct("<q")  # one release: the buffer's serial number, atomic on a pipe


class FieldSlot(NamedTuple):
    """Where a tensor field of a batch lies in its buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the buffer's start


class PooledBatch(NamedTuple):
    """What a worker sends for a batch whose tensors lie in one of its reused buffers.

    `buffer` (the shared-memory tensor) travels only until the training process has mapped
    it: the first time the buffer is used. A buffer is used again only after the training
    process released it, and so after it received (and mapped) it; from then on the batch is
    named by (owner, serial) alone. torch passes a shared tensor as a file descriptor over a
    fresh authenticated connection to a thread of the sender, then maps it again: ~0.6 ms of
    CPU per batch (training process and worker) against a few microseconds for this tuple.
    """

    owner: int  # the worker's pid
    serial: int  # which of its buffers
    slots: tuple[FieldSlot, ...]
    rest: dict[str, Any]  # the fields that are not tensors, as they are
    live: tuple[int, ...]  # the owner's buffers still in use: the receiver forgets the rest
    buffer: torch.Tensor | None


def layout(
    fields: list[tuple[str, tuple[int, ...], torch.dtype]],
) -> tuple[tuple[FieldSlot, ...], int]:
    """Slots for tensor fields (name, shape, dtype) packed into one buffer, and its size."""
    slots = []
    offset = 0
    for name, shape, dtype in fields:
        slots.append(FieldSlot(name, tuple(shape), dtype, offset))
        nbytes = math.prod(shape) * dtype.itemsize
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(slots), offset


def field_view(flat: torch.Tensor, slot: FieldSlot) -> torch.Tensor:
    """The tensor of `slot` inside the uint8 buffer `flat` (a view: no copy)."""
    nbytes = math.prod(slot.shape) * slot.dtype.itemsize
    return flat[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)


class BatchBuffers:
    """A worker's shared-memory batch buffers, reused once the training process let go.

    Stacking each batch into a new shared-memory segment costs more than the stacking: its
    pages are allocated, zeroed and faulted in one by one in the worker, and freed again in
    the training process: several times the stacking itself (figure in BENCHMARKS.md,
    "Figures behind the code"). A worker never waits for a buffer:
    with none released it makes a new one, and it forgets the oldest beyond `keep`, so a
    batch the training process keeps is never overwritten (its late release is ignored).

    `releases`: the read end of this worker's release pipe (see the module docstring); None
    for a pool of buffers that is never handed back (tests, or a single process).
    """

    def __init__(self, keep: int = 8, releases: Connection | None = None) -> None:
        self.keep = keep
        self.buffers: dict[int, torch.Tensor] = {}  # serial -> flat uint8 buffer, oldest first
        self.free: set[int] = set()
        self.sent: set[int] = set()  # buffers the training process has been sent
        # each buffer's field views for its last layout: batches of one layout (the usual
        # case) reuse them instead of three tensor ops per field per batch
        self.views: dict[int, tuple[tuple[FieldSlot, ...], dict[str, torch.Tensor]]] = {}
        self.serial = 0
        self.releases = releases
        self._pending = b""
        if releases is not None:
            os.set_blocking(releases.fileno(), False)

    def _drain(self) -> None:
        """Mark the buffers the training process released since the last call free."""
        if self.releases is None:
            return
        data = self._pending
        while True:
            try:
                chunk = os.read(self.releases.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:  # the training process is gone
                break
            data += chunk
        whole = len(data) - len(data) % _SERIAL.size
        self._pending = data[whole:]
        for (serial,) in _SERIAL.iter_unpack(data[:whole]):
            if serial in self.buffers:  # a forgotten buffer's late release is ignored
                self.free.add(serial)

    def allocate(
        self, fields: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> tuple[dict[str, torch.Tensor], Callable[[dict[str, Any]], PooledBatch]]:
        """Memory for a batch's tensor fields (name, shape, dtype) in a released (or new)
        buffer: the tensors to fill, and the function that names the batch for sending once
        they are full (given the batch's other fields)."""
        slots, nbytes = layout(fields)
        self._drain()
        fitting = [s for s in self.free if self.buffers[s].numel() >= nbytes]
        if fitting:
            serial = min(fitting, key=lambda s: self.buffers[s].numel())
            self.free.discard(serial)
        else:
            self.serial += 1
            serial = self.serial
            self.buffers[serial] = new_shared_bytes(max(-(-nbytes // ROUND) * ROUND, ROUND))
            for old in list(self.buffers)[: -self.keep]:
                del self.buffers[old]
                self.free.discard(old)
                self.sent.discard(old)
                self.views.pop(old, None)
        flat = self.buffers[serial]
        cached = self.views.get(serial)
        if cached is not None and cached[0] == slots:
            views = cached[1]
        else:
            views = {slot.name: field_view(flat, slot) for slot in slots}
            self.views[serial] = (slots, views)

        def send(rest: dict[str, Any]) -> PooledBatch:
            first = serial not in self.sent
            self.sent.add(serial)
            live = tuple(self.buffers)
            return PooledBatch(os.getpid(), serial, slots, rest, live, flat if first else None)

        return views, send


class PlainMemory:
    """Batch memory without a transport (loading in the training process): new tensors."""

    def allocate(
        self, fields: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> tuple[dict[str, torch.Tensor], Callable[[dict[str, Any]], dict[str, Any]]]:
        views = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in fields}
        return views, lambda rest: {**views, **rest}


class MappedBuffers:
    """The training process's side: workers' buffers mapped once, batches lent out of them.

    `releases`: each worker's (pid's) release pipe, write end.
    """

    def __init__(self, releases: dict[int, Connection] | None = None) -> None:
        self.mapped: dict[tuple[int, int], torch.Tensor] = {}
        self.releases: dict[int, Connection] = dict(releases or {})

    def clear(self) -> None:
        """Forget every mapping and pipe (new workers; lent batches keep their own)."""
        self.mapped.clear()
        self.releases.clear()

    def _flat(self, ref: PooledBatch) -> torch.Tensor:
        key = (ref.owner, ref.serial)
        if ref.buffer is not None:
            self.mapped[key] = ref.buffer
        flat = self.mapped.get(key)
        if flat is None:  # a worker sends a buffer until it was released once: cannot happen
            raise RuntimeError(f"batch buffer {key} of a loader worker was never received")
        for stale in [k for k in self.mapped if k[0] == ref.owner and k[1] not in ref.live]:
            del self.mapped[stale]
        return flat

    def receive(self, ref: PooledBatch) -> dict[str, Any]:
        """The batch `ref` names: its tensors lent (the buffer goes back to its worker when
        the last of them, or of their views, is gone), its other fields as they came."""
        flat = self._flat(ref)
        batch = lend(flat, ref.slots, self.releases.get(ref.owner), ref.serial)
        batch.update(ref.rest)
        return batch

    def drop(self, message: Any) -> None:
        """A batch nobody will see (its pass was called off): its buffer goes back at once."""
        if isinstance(message, PooledBatch):
            self._flat(message)
            release(self.releases.get(message.owner), message.serial)


def lend(
    flat: torch.Tensor, slots: tuple[FieldSlot, ...], releases: Connection | None, serial: int
) -> dict[str, torch.Tensor]:
    """Views of the fields in `flat` that release the buffer when the last one is gone.

    Each field is a tensor over one numpy array of the whole buffer (torch.frombuffer keeps
    it alive); a finalizer on that array writes the release. No copy, and nothing the
    trainer still holds is overwritten.
    """
    array = flat.numpy()
    # atexit=False: a forked worker inherits these finalizers; it must never run them
    weakref.finalize(array, release, releases, serial).atexit = False
    out: dict[str, torch.Tensor] = {}
    for slot in slots:
        count = math.prod(slot.shape)
        if count == 0:
            out[slot.name] = torch.empty(slot.shape, dtype=slot.dtype)
            continue
        tensor = torch.frombuffer(array, dtype=slot.dtype, count=count, offset=slot.offset)
        out[slot.name] = tensor.view(slot.shape)
    return out


def release(releases: Connection | None, serial: int) -> None:
    """Hand buffer `serial` back to its worker: one atomic write to its release pipe.

    Never blocks (the pipe's write end is non-blocking): a full pipe, or a worker gone, only
    loses the release, and the worker then makes a new buffer instead.
    """
    if releases is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(releases.fileno(), _SERIAL.pack(serial))
