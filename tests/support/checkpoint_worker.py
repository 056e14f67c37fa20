"""Child-process bodies for the checkpoint tests (run as `python _workers.py SCENARIO ...`).

Not collected by pytest. Every scenario uses tiny tensors and gloo on CPU.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from hpctrain.checkpoint import (
    CheckpointManager,
    ModelOptimizerState,
    PerRankState,
    RNGState,
)


class Counter:
    """Stands in for the loader: a rank-local position."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["value"])


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Without cpu_offload every rank gets the full state (with it, only rank 0 does).
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    assert model_sd and optim_sd["state"], "an empty state would compare equal to anything"
    # Clone: unsharded values (AdamW's `step`) are the live tensors, which training mutates.
    return _clone({"model": model_sd, "optim": optim_sd})


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def assert_equal_nested(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in a:
            assert_equal_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_nested(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def scenario_two_ranks(out: str) -> None:
    """DDP (sync save) and FSDP2 (async save) at world size 2; each loads back bitwise."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    # 1 -> 2: the test saved a plain model at world size 1; both ranks load it into DDP and
    # FSDP2 models, and rank 1, which has no saved entry, gets rank 0's per-rank state.
    expected_single = torch.load(f"{out}/expected-single.pt", weights_only=True)
    single = CheckpointManager(f"{out}/single", keep_last=1)
    for wrap in ("ddp", "fsdp"):
        grown = make_model(5)
        if wrap == "ddp":
            grown = DistributedDataParallel(grown)
        else:
            for layer in grown:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(grown)
        grown_opt = torch.optim.AdamW(grown.parameters(), lr=0.01)
        grown_counter = Counter(-1)
        states = {
            "model": ModelOptimizerState(grown, grown_opt),
            "loader": PerRankState(grown_counter),
        }
        assert single.load(states) == 1
        assert_equal_nested(expected_single, full_state(grown, grown_opt), f"1->2 {wrap}")
        assert grown_counter.value == 42, grown_counter.value
    single.close()

    # DDP, synchronous save.
    model = DistributedDataParallel(make_model(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, optimizer, 2, rank)
    counter = Counter(100 + rank)
    manager = CheckpointManager(f"{out}/ddp", keep_last=2)
    torch.manual_seed(50 + rank)
    states = {
        "model": ModelOptimizerState(model, optimizer),
        "rng": PerRankState(RNGState()),
        "loader": PerRankState(counter),
    }
    manager.save(2, states, metadata={"strategy": "ddp"})
    expected = full_state(model, optimizer)
    next_random = torch.rand(3)
    if rank == 0:
        torch.save(expected, f"{out}/expected-ddp.pt")

    fresh = DistributedDataParallel(make_model(1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_counter = Counter(-1)
    torch.manual_seed(999)
    step = manager.load(
        {
            "model": ModelOptimizerState(fresh, fresh_opt),
            "rng": PerRankState(RNGState()),
            "loader": PerRankState(fresh_counter),
        }
    )
    assert step == 2, step
    assert_equal_nested(expected, full_state(fresh, fresh_opt), "ddp")
    assert torch.equal(torch.rand(3), next_random), "per-rank RNG not restored"
    assert fresh_counter.value == 100 + rank, fresh_counter.value
    manager.close()

    # DDP, asynchronous: DCP writes the model and optimizer from rank 0, which alone stages
    # them (#38 item 8); rank 1 stages nothing (its per-rank entries are bytes).
    torch.manual_seed(50 + rank)
    ddp_async = CheckpointManager(f"{out}/ddp-async", keep_last=1, async_save=True)
    ddp_async.save(2, states, metadata={"strategy": "ddp"})
    print(f"rank {rank} staged ddp {ddp_async._stager.staged_bytes}", flush=True)
    train(model, optimizer, 1, rank)  # the staged copy, not the live model, is written
    ddp_async.wait()
    fresh = DistributedDataParallel(make_model(1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    assert ddp_async.load({"model": ModelOptimizerState(fresh, fresh_opt)}) == 2
    assert_equal_nested(expected, full_state(fresh, fresh_opt), "ddp async")
    ddp_async.close()

    # FSDP2, asynchronous save; training continues while it is written.
    torch.manual_seed(0)
    sharded = make_model(0)
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    train(sharded, sharded_opt, 2, rank)
    expected = full_state(sharded, sharded_opt)
    if rank == 0:
        torch.save(expected, f"{out}/expected-fsdp.pt")
    async_manager = CheckpointManager(f"{out}/fsdp", keep_last=2, async_save=True)
    async_manager.save(
        4, {"model": ModelOptimizerState(sharded, sharded_opt)}, metadata={"strategy": "fsdp"}
    )
    print(f"rank {rank} staged fsdp {async_manager._stager.staged_bytes}", flush=True)
    train(sharded, sharded_opt, 1, rank)  # mutates parameters while the save is in flight
    async_manager.wait()
    reloaded = make_model(3)
    for layer in reloaded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(reloaded)
    reloaded_opt = torch.optim.AdamW(reloaded.parameters(), lr=0.01)
    assert async_manager.load({"model": ModelOptimizerState(reloaded, reloaded_opt)}) == 4
    assert_equal_nested(expected, full_state(reloaded, reloaded_opt), "fsdp")
    async_manager.close()

    # HSDP over 2 replicas of 1 shard: replica 0 (rank 0) writes and stages every shard.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    hsdp = make_model(0)
    for layer in hsdp:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(hsdp, mesh=mesh)
    hsdp_opt = torch.optim.AdamW(hsdp.parameters(), lr=0.01)
    train(hsdp, hsdp_opt, 2, rank)
    expected = full_state(hsdp, hsdp_opt)
    hsdp_manager = CheckpointManager(f"{out}/hsdp", keep_last=1, async_save=True)
    hsdp_manager.save(2, {"model": ModelOptimizerState(hsdp, hsdp_opt)})
    print(f"rank {rank} staged hsdp {hsdp_manager._stager.staged_bytes}", flush=True)
    hsdp_manager.wait()
    reloaded = make_model(3)
    for layer in reloaded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(reloaded, mesh=mesh)
    reloaded_opt = torch.optim.AdamW(reloaded.parameters(), lr=0.01)
    assert hsdp_manager.load({"model": ModelOptimizerState(reloaded, reloaded_opt)}) == 2
    assert_equal_nested(expected, full_state(reloaded, reloaded_opt), "hsdp async")
    hsdp_manager.close()

    # close() is not collective: safe in a `finally` after an error on one rank only.
    last = CheckpointManager(f"{out}/close", keep_last=1, async_save=True)
    last.save(1, {"x": {"w": torch.zeros(4)}})
    last.wait()
    if rank == 1:
        print(f"rank {rank} ok", flush=True)
        os._exit(0)  # gone without closing anything
    last.close()
    print(f"rank {rank} ok", flush=True)


def scenario_save_loop(root: str, async_save: str) -> None:
    """Save step 1, say READY, then save steps 2, 3, ... until killed."""
    manager = CheckpointManager(root, keep_last=2, async_save=async_save == "1")
    state = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 20), "c": torch.zeros(1 << 19)}
    step = 1
    while True:
        for tensor in state.values():
            tensor.fill_(float(step))
        manager.save(step, {"weights": state, "trainer": {"step": step}})
        if step == 1:
            manager.wait()
            print("READY", flush=True)
        step += 1


def scenario_save_loop_two_ranks(root: str) -> None:
    """Both ranks save steps 1, 2, ... (each rank its own shard) until one is killed."""
    dist.init_process_group("gloo")
    manager = CheckpointManager(root, keep_last=2)
    state = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 19)}
    step = 1
    while True:
        for tensor in state.values():
            tensor.fill_(float(step))
        manager.save(step, {"weights": PerRankState(_Tensors(state))})
        if step == 1:
            print("READY", flush=True)
        step += 1


class _Tensors:
    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict) -> None:
        for key, value in sd.items():
            self.tensors[key].copy_(value)


def scenario_damaged_two_ranks(root: str) -> None:
    """Save steps 1 and 2 on two ranks, flip a byte of rank 1's file of step 2, load: every
    rank must find the damage together and load step 1 (no hang, no mixed steps)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manager = CheckpointManager(root, keep_last=5)
    state = {"a": torch.zeros(1 << 16), "b": torch.zeros(1 << 10)}
    for step in (1, 2):
        for tensor in state.values():
            tensor.fill_(float(step * 10 + rank))
        manager.save(step, {"weights": PerRankState(_Tensors(state)), "trainer": {"step": step}})
    dist.barrier()
    if rank == 0:
        target = os.path.join(root, "step-2", "__1_0.distcp")
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    states = {"weights": PerRankState(_Tensors(state)), "trainer": {"step": 0}}
    loaded = manager.load(states)
    assert loaded == 1 and states["trainer"]["step"] == 1, (loaded, states["trainer"])
    assert all(bool((t == float(10 + rank)).all()) for t in state.values())
    manager.close()
    print(f"rank {rank} loaded {loaded}", flush=True)
    # leave together: a rank that exits while gloo's threads still talk to its peer can abort
    # in their destructors ("terminate called without an active exception", seen in CI)
    dist.barrier()
    dist.destroy_process_group()


def scenario_read_only(root: str) -> None:
    """Lose write permission, then save: sync raises at once, async fails at wait/close."""
    model = torch.nn.Linear(4, 3)
    if os.getuid() == 0:  # root ignores permissions; become an unprivileged user
        os.setgid(65534)
        os.setuid(65534)
    sync = CheckpointManager(root, keep_last=1)
    try:
        sync.save(1, {"model": ModelOptimizerState(model)})
    except Exception as exc:
        print(f"SYNC {type(exc).__name__}: {exc}", flush=True)
    manager = CheckpointManager(root, keep_last=1, async_save=True)
    manager.save(2, {"model": ModelOptimizerState(model)})
    time.sleep(0.2)
    print("ASYNC save returned", flush=True)
    manager.close()  # raises CheckpointSaveError: the process exits non-zero
    print("UNREACHABLE", flush=True)


if __name__ == "__main__":
    scenario = sys.argv[1]
    {
        "two_ranks": scenario_two_ranks,
        "save_loop": scenario_save_loop,
        "save_loop_two_ranks": scenario_save_loop_two_ranks,
        "read_only": scenario_read_only,
        "damaged_two_ranks": scenario_damaged_two_ranks,
    }[scenario](*sys.argv[2:])
