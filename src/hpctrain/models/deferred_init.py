"""A model built on the meta device, initialised later shard by shard with the very values
a CPU build gives (issue #38 item 6).

A fresh FSDP2/HSDP run used to build the whole fp32 model on every rank's CPU before sharding
it (gpt-8b: 29 GiB of host memory per rank). `build_on_meta` builds it on the meta device
instead (no memory) while a dispatch mode records every aten op the construction runs: the
factory calls, the initialisers (`uniform_`, `normal_`, `fill_`, ...) and whatever reads or
writes the parameters and buffers. For each random op it saves the generator's state first,
then runs the op on a scratch CPU tensor of the same size and strides, which draws exactly as
the CPU build would: the random stream after the build, and every later op's state, are the
CPU build's. Once the model is sharded (`parallelize`, storage for each rank's shard only),
`InitRecording.materialize` replays, one parameter or buffer at a time, the ops that made its
value (those that wrote its storage, and before them those that made what they read), with
each random op's saved state, on the CPU, and gives each rank its shard of it
(`set_model_state_dict`). At most one full tensor is alive at a time, and the values are
bitwise the CPU build's: same seed, same initial weights as a build that is not deferred
(tests/parallel/test_fsdp_memory.py). A DDP or single-process run still builds whole.

The same idea as torchdistx's `deferred_init`, which no torch 2.14 release ships; written
here in ~200 lines because recording is all it needs. A construction it cannot replay (a
value made outside the recorded ops, e.g. a buffer from `torch.tensor([...])` that nothing
overwrites, or a build that fails on the meta device) falls back to the CPU build, with the
random stream restored first, and the log says why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpctrain.compat_torch import dispatch_mode_class, storage_key

log = logging.getLogger(__name__)
META = torch.device("meta")
CPU = torch.device("cpu")
FLUSH_BYTES = 256 << 20  # full tensors handed to `set_model_state_dict` at a time
# In-place ops that give every element of their first argument a value without reading it:
# a storage made outside the recorded ops (torch.tensor(...)) is replayable from one of them.
OVERWRITES = {
    "fill_",
    "zero_",
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "copy_",
}


# Factories that give memory but no values.
ALLOCATES = ("empty", "new_empty")
# torch.nn.init's initialisers that do nothing on the meta device (their CPU draws, or
# values, would be lost): a build that calls one is built whole instead.
META_NOOPS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


class CannotReplay(Exception):
    """The recorded construction does not determine a parameter's or buffer's value."""


@dataclass(frozen=True)
class TensorRef:
    """A meta tensor seen by the recorder: a view (size, stride, offset) of a storage."""

    storage: int
    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Op:
    func: Any
    args: Any  # with TensorRef in place of meta tensors
    kwargs: Any
    generator: Any  # the generator a random op drew from (None: not random)
    state: torch.Tensor | None  # its state before the op
    outputs: list[TensorRef] = field(default_factory=list)
    reads: set[int] = field(default_factory=set)  # storages of the tensor arguments
    writes: set[int] = field(default_factory=set)  # storages the op gives values to


@dataclass
class InitRecording:
    """The ops of a meta build, and the storage of each of the model's parameters and buffers."""

    ops: list[Op]
    tensors: dict[str, TensorRef]  # plain name (no wrapper prefixes) -> its tensor
    persistent: set[str]  # names in the state dict (parameters, persistent buffers)

    def materialize(self, model: nn.Module) -> None:
        """Give `model` (sharded, its storage allocated by `to_empty`) the recorded values:
        each rank its shards, one full tensor at a time (`FLUSH_BYTES` at most, grouped)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        saved = _generator_states(self.ops)
        try:
            pending: dict[str, Any] = {}
            for name in sorted(self.persistent):
                pending[name] = self.value(name)
                if sum(t.nbytes for t in pending.values()) >= FLUSH_BYTES:
                    set_model_state_dict(model, pending, options=options)
                    pending = {}
            if pending:
                set_model_state_dict(model, pending, options=options)
            for name, buffer in _plain_named_buffers(model):
                if name in self.tensors and name not in self.persistent:
                    buffer.copy_(self.value(name))
        finally:
            _restore_generators(saved)

    @torch.no_grad()
    def value(self, name: str) -> torch.Tensor:
        """The CPU build's value of parameter or buffer `name`, replayed."""
        target = self.tensors[name]
        needed, storages = [], {target.storage}
        for op in reversed(self.ops):
            if op.writes & storages:
                needed.append(op)
                storages |= op.reads
        real: dict[int, torch.Tensor] = {}
        for op in reversed(needed):
            args, kwargs = _tree_map(lambda v: _real(v, real), (op.args, op.kwargs))
            if op.generator is not None:
                op.generator.set_state(op.state)
            out = op.func(*args, **kwargs)
            for ref, result in zip(op.outputs, _flat_tensors(out), strict=False):
                if ref.storage in op.writes and not _same_storage(result, real, ref):
                    _view(ref, real).copy_(result)
        return _view(target, real).clone()


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecording | None]:
    """`build()` on the meta device with its initialisation recorded; or, when it cannot be
    replayed, `build()` on the CPU (as without this module) and None."""
    mode_class = dispatch_mode_class()
    rng_before = torch.get_rng_state()
    if mode_class is not None:
        recorder = _recorder(mode_class)
        try:
            with torch.device(META), _refusing_meta_noops(), recorder:
                model = build()
            return model, recorder.recording(model)
        except CannotReplay as exc:
            why = str(exc)
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # an op meta lacks
            why = f"the build fails on the meta device ({type(exc).__name__}: {exc})"
        log.info("model built whole on the CPU, not on the meta device: %s", why)
    torch.set_rng_state(rng_before)  # the CPU build draws what it would have drawn
    return build(), None


@contextlib.contextmanager
def _refusing_meta_noops() -> Iterator[None]:
    """`torch.nn.init`'s `META_NOOPS` raise `CannotReplay` for the build's duration (called
    through the module, as torch's and torchvision's models do)."""
    saved = {name: getattr(nn.init, name) for name in META_NOOPS}

    def refusal(name: str) -> Callable[..., Any]:
        def refuse(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise CannotReplay(f"torch.nn.init.{name} does nothing on the meta device")

        return refuse

    for name in META_NOOPS:
        setattr(nn.init, name, refusal(name))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _recorder(mode_class: type) -> Any:
    class Recorder(mode_class):  # type: ignore[misc, valid-type]
        """Records each aten op; random ones also draw on a CPU scratch tensor."""

        def __init__(self) -> None:
            super().__init__()
            self.ops: list[Op] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            kwargs = kwargs or {}
            generator, state = None, None
            if torch.Tag.nondeterministic_seeded in func.tags:
                generator = kwargs.get("generator") or torch.default_generator
                state = generator.get_state()
                scratch_args, scratch_kwargs = _tree_map(_scratch, (args, kwargs))
                func(*scratch_args, **scratch_kwargs)  # draws as the CPU build does
            out = func(*args, **kwargs)
            op = Op(func, _tree_map(_ref, args), _tree_map(_ref, kwargs), generator, state)
            op.reads = {r.storage for r in _refs((op.args, op.kwargs))}
            op.outputs = [_ref(t) for t in _flat_tensors(out) if t.is_meta]
            new = {r.storage for r in op.outputs} - op.reads  # a factory's, a functional op's
            op.writes = new
            name = func.overloadpacket.__name__
            if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
                op.writes = new | {_ref(args[0]).storage}
            for out_arg in _refs(kwargs.get("out")):
                op.writes.add(out_arg.storage)
            self.ops.append(op)
            return out

        def recording(self, model: nn.Module) -> InitRecording:
            tensors: dict[str, TensorRef] = {}
            for name, tensor in _named_tensors(model):
                if not tensor.is_meta:
                    raise CannotReplay(f"{name} was made on {tensor.device}, not on meta")
                tensors[name] = _ref(tensor)
            persistent = set(model.state_dict())
            recording = InitRecording(self.ops, tensors, persistent)
            for name, ref in tensors.items():
                _check_made(recording, name, ref)
            return recording

    return Recorder()


def _check_made(recording: InitRecording, name: str, ref: TensorRef) -> None:
    """Refuse a tensor whose first values do not come from the recorded ops: the first op
    after its allocation (`empty`, which gives no values) that touches its storage must give
    every element a value (a factory, a functional op, or an in-place initialiser over all of
    it, like `zero_` on BatchNorm's `torch.tensor(0)` counter, made outside the ops)."""
    for op in recording.ops:
        touches = ref.storage in op.writes or ref.storage in op.reads
        if not touches:
            continue
        name_of_op = op.func.overloadpacket.__name__
        if ref.storage in op.writes and ref.storage not in op.reads:
            if name_of_op.startswith(ALLOCATES):
                continue  # memory, no values yet
            return  # a factory's or a functional op's values
        first = op.args[0] if op.args else None
        whole = (
            isinstance(first, TensorRef)
            and first.storage == ref.storage
            and first.offset == 0
            and _numel(first) * first.dtype.itemsize == first.nbytes
            and _is_dense(first)
        )
        if ref.storage in op.writes and name_of_op in OVERWRITES and whole:
            return
        break
    raise CannotReplay(f"{name}: its value is not made by the ops a meta build records")


def _numel(ref: TensorRef) -> int:
    n = 1
    for s in ref.size:
        n *= s
    return n


def _is_dense(ref: TensorRef) -> bool:
    return torch.empty_strided(ref.size, ref.stride, device=META).is_contiguous()


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _plain_named_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers by the names of the model before wrapping (checkpoint and compile wrappers add
    path segments; FSDP2 leaves buffers as they are)."""
    wrappers = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
    for name, buffer in model.named_buffers(remove_duplicate=False):
        yield ".".join(part for part in name.split(".") if part not in wrappers), buffer


def _ref(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_meta:
        key = storage_key(value)
        if key is None:
            raise CannotReplay("this torch gives no storage identity")
        return TensorRef(
            key,
            value.untyped_storage().nbytes(),
            tuple(value.shape),
            tuple(value.stride()),
            int(value.storage_offset()),
            value.dtype,
        )
    return value


def _scratch(value: Any) -> Any:
    """A CPU tensor laid out as meta tensor `value` (its values do not matter: a random op
    draws the same numbers into any tensor of the same size and strides)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=CPU)
    return _cpu(value)


def _cpu(value: Any) -> Any:
    return CPU if isinstance(value, torch.device) and value.type == "meta" else value


def _tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`fn` on every leaf of the (nested) lists, tuples and dicts of an op's arguments."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, item) for item in tree)
    if isinstance(tree, dict):
        return {key: _tree_map(fn, item) for key, item in tree.items()}
    return fn(tree)


def _leaves(tree: Any) -> list[Any]:
    out: list[Any] = []
    _tree_map(out.append, tree)
    return out


def _refs(tree: Any) -> list[TensorRef]:
    return [leaf for leaf in _leaves(tree) if isinstance(leaf, TensorRef)]


def _flat_tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in _leaves(tree) if isinstance(leaf, torch.Tensor)]


def _view(ref: TensorRef, real: dict[int, torch.Tensor]) -> torch.Tensor:
    """`ref` over the real storage of its storage (allocated on first use)."""
    if ref.storage not in real:
        real[ref.storage] = torch.empty(ref.nbytes, dtype=torch.uint8, device=CPU)
    data = real[ref.storage]
    return data.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)


def _same_storage(result: torch.Tensor, real: dict[int, torch.Tensor], ref: TensorRef) -> bool:
    """Whether an op's result already is `ref`'s memory (an in-place op returns its input)."""
    base = real.get(ref.storage)
    return base is not None and result.untyped_storage().data_ptr() == base.data_ptr()


def _real(value: Any, real: dict[int, torch.Tensor]) -> Any:
    return _view(value, real) if isinstance(value, TensorRef) else _cpu(value)


def _generator_states(ops: list[Op]) -> list[tuple[Any, torch.Tensor]]:
    generators = {id(op.generator): op.generator for op in ops if op.generator is not None}
    return [(g, g.get_state()) for g in generators.values()]


def _restore_generators(saved: list[tuple[Any, torch.Tensor]]) -> None:
    for generator, state in saved:
        generator.set_state(state)
