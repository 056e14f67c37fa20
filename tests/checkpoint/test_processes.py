"""Checkpoints across processes: 2-rank gloo DCP, kills during saves, background failures."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import (
    CheckpointManager,
    ModelOptimizerState,
    PerRankState,
    RNGState,
    committed_steps,
    verify_checkpoint,
)
from hpctrain.checkpoint.safety import SafeLoadPlanner
from hpctrain.checkpoint.storage import open_store
from hpctrain.launch.local import free_port
from tests.support.checkpoint_worker import (
    Counter,
    _Tensors,
    assert_equal_nested,
    full_state,
    make_model,
)

WORKERS = str(Path(__file__).parents[1] / "support" / "checkpoint_worker.py")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_ddp_and_fsdp2_reshard_one_to_two_and_two_to_one(tmp_path):
    # A world-size-1 checkpoint for the ranks to load (1 -> 2).
    model = make_model(4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    single = CheckpointManager(str(tmp_path / "single"), keep_last=1)
    single.save(
        1, {"model": ModelOptimizerState(model, optimizer), "loader": PerRankState(Counter(42))}
    )
    single.close()  # gives the folder's run lock back to the ranks below
    torch.save(full_state(model, optimizer), tmp_path / "expected-single.pt")

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKERS, "two_ranks", str(tmp_path)],
            env=child_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], "\n".join(f"rank {r}:\n{o[-3000:]}" for r, o in enumerate(outputs))
    for rank, output in enumerate(outputs):
        assert f"rank {rank} ok" in output

    # Async staging holds only what each rank writes (#38 item 8).
    def staged(rank: int, case: str) -> int:
        line = next(
            x for x in outputs[rank].splitlines() if x.startswith(f"rank {rank} staged {case} ")
        )
        return int(line.rsplit(" ", 1)[1])

    assert staged(0, "ddp") > 0 and staged(1, "ddp") == 0  # rank 0 writes the replicas
    assert staged(0, "hsdp") > 0 and staged(1, "hsdp") == 0  # replica 0 writes the shards
    assert 0.5 < staged(1, "fsdp") / staged(0, "fsdp") < 2  # each rank its own half

    # Both ranks' per-rank entries are in the world-2 checkpoint, once each.
    manifest = verify_checkpoint(open_store(str(tmp_path / "ddp")), "step-2")
    assert manifest["world_size"] == 2 and manifest["metadata"] == {"strategy": "ddp"}

    # Reshard 2 -> 1: a plain model in this single process loads the DDP checkpoint; the
    # loader state of a rank that did not exist falls back to rank 0's entry.
    model = make_model(7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = Counter(-1)
    manager = CheckpointManager(str(tmp_path / "ddp"), keep_last=2)
    states = {
        "model": ModelOptimizerState(model, optimizer),
        "rng": PerRankState(RNGState()),
        "loader": PerRankState(counter),
    }
    assert manager.load(states) == 2
    expected = torch.load(tmp_path / "expected-ddp.pt", weights_only=True)
    assert_equal_nested(expected, full_state(model, optimizer), "ddp->plain")
    assert counter.value == 100

    # FSDP2 (sharded over 2 ranks, saved async) -> a plain model in one process.
    model = make_model(8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(str(tmp_path / "fsdp"), keep_last=2)
    assert manager.load({"model": ModelOptimizerState(model, optimizer)}) == 4
    expected = torch.load(tmp_path / "expected-fsdp.pt", weights_only=True)
    assert_equal_nested(expected, full_state(model, optimizer), "fsdp->plain")


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["0", "1"])
def test_sigkill_during_saves_never_leaves_a_half_written_step(tmp_path, async_save):
    rng = random.Random(1234 + int(async_save))
    for trial in range(3):
        root = tmp_path / f"trial{trial}"
        proc = subprocess.Popen(
            [sys.executable, WORKERS, "save_loop", str(root), async_save],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read() if proc.stderr else line
        delay = rng.uniform(0.0, 1.0)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        where = f"trial {trial}, kill after {delay:.3f}s"

        store = open_store(str(root))
        steps = committed_steps(store)
        assert steps, where
        for step in steps:  # every committed folder is complete
            assert verify_checkpoint(store, f"step-{step}")["step"] == step, where
        # The next start loads the newest committed checkpoint, with that step's data.
        state = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 20), "c": torch.zeros(1 << 19)}
        states = {"weights": state, "trainer": {"step": 0}}
        manager = CheckpointManager(str(root), keep_last=2)
        loaded = manager.load(states)
        assert loaded == steps[-1], where
        assert states["trainer"]["step"] == loaded, where
        for tensor in states["weights"].values():
            assert bool((tensor == float(loaded)).all()), where
        assert not [n for n in os.listdir(root) if ".tmp-" in n], where


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_of_one_rank_during_saves_never_commits_a_partial_step(tmp_path):
    root = tmp_path / "ck"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKERS, "save_loop_two_ranks", str(root)],
            env=child_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    assert procs[0].stdout is not None
    assert procs[0].stdout.readline().strip() == "READY"
    delay = random.Random(7).uniform(0.1, 0.8)
    time.sleep(delay)
    procs[1].kill()  # rank 1 dies; rank 0 must fail its save, not commit half of it
    procs[1].wait()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0, err[-2000:]

    store = open_store(str(root))
    steps = committed_steps(store)
    assert steps, f"kill after {delay:.3f}s"
    for step in steps:
        manifest = verify_checkpoint(store, f"step-{step}")
        assert manifest["world_size"] == 2
        # Both ranks' shards are in every committed checkpoint.
        for rank in range(2):
            tensors = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 19)}
            per_rank = PerRankState(_Tensors(tensors))
            per_rank.source_rank = rank
            dcp.load(
                {"weights": per_rank},
                storage_reader=store.reader(f"step-{step}"),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
            assert all(bool((t == float(step)).all()) for t in tensors.values())


@pytest.mark.slow
def test_background_save_failure_exits_non_zero_naming_the_path():
    # Root ignores permissions, so the child drops to `nobody`; the folder must then be
    # reachable by that user, hence a fresh folder in /tmp rather than pytest's 0700 tmp_path.
    base = tempfile.mkdtemp(prefix="hpctrain-ro-")
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "checkpoints")
        os.mkdir(root, 0o555)
        if os.getuid() == 0:
            os.chown(root, 65534, 65534)
        os.chmod(root, 0o555)
        proc = subprocess.run(
            [sys.executable, WORKERS, "read_only", root],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, output
        assert "ASYNC save returned" in output  # the failure happened in the background
        assert "UNREACHABLE" not in output
        assert f"CheckpointSaveError: checkpoint save to {root}/.tmp-step-2 failed" in output
        assert "Permission denied" in output
        assert f"SYNC CheckpointSaveError: checkpoint save to {root}/.tmp-step-1 failed" in output
        assert not [n for n in os.listdir(root) if n.startswith("step-")]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_fall_back_together_from_a_checksum_mismatch(tmp_path):
    root = tmp_path / "ck"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKERS, "damaged_two_ranks", str(root)],
            env=child_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for rank, output in enumerate(outputs):
        assert f"rank {rank} loaded 1" in output
    assert sorted(os.listdir(root)) == [".damaged-step-2", ".lock", "latest", "step-1"]
