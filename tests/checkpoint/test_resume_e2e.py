"""End to end through `hpctrain train`: signal → checkpoint → exit 75 → resume → same result.

Two ranks on gloo, deterministic CPU mode. An uninterrupted run and a run that gets SIGUSR2 at
a random step and is then started again in fresh processes must end with bitwise-equal weights
and optimizer state, and with equal sample audit logs. Also: resharding 2 ranks → 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.checkpoint import verify_checkpoint
from hpctrain.checkpoint.safety import SafeLoadPlanner
from hpctrain.checkpoint.storage import open_store
from hpctrain.train.preemption import REQUEUE_EXIT_CODE
from tests.support.train_kit import REPO, run_hpctrain, train_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_STEPS = 8


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """Every entry of a checkpoint, flattened (`app.model.0.weight`, ...), in this process."""
    store = open_store(str(folder.parent))
    verify_checkpoint(store, folder.name)
    reader = store.reader(folder.name)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            state[key] = None
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state


def assert_same_training_state(a: Path, b: Path) -> None:
    sa, sb = read_checkpoint(a), read_checkpoint(b)
    assert sa.keys() == sb.keys()
    compared = 0
    for key in sorted(sa):
        if key.startswith("rng.") or key.startswith("loader."):
            continue  # per-rank blobs; the sample logs below check the data order
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), f"{key} differs"
            compared += 1
        else:
            assert sa[key] == sb[key], f"{key}: {sa[key]!r} != {sb[key]!r}"
    assert compared > 4 and any(k.startswith("app.optim.state.") for k in sa)


def sample_logs(run_dir: Path, world_size: int) -> list[str]:
    return [(run_dir / "samples" / f"rank-{r}.jsonl").read_text() for r in range(world_size)]


def last_logged_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line]
    return max(steps, default=0)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/stat (field 4 is the parent's pid)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                pids.append(int(stat.parent.name))
    return pids


def train_with_signal_at(args: list[str], run_dir: Path, step: int) -> int:
    """Start a 2-rank run, send SIGUSR2 to the launcher once `step` is logged; return the code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "train", *args, "--nproc", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and last_logged_step(run_dir) < step:
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)  # the launcher forwards it to both ranks
    # A second signal straight to the ranks, while they step or save: it must change nothing
    # (the handler only records the first one; no save is cut short or started twice).
    time.sleep(0.05)
    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == REQUEUE_EXIT_CODE, f"exit {proc.returncode}\n{out}\n{err[-3000:]}"
    assert "preemption requested" in err
    return proc.returncode


def common_args(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return train_args(
        shards,
        run_dir,
        f"train.max_steps={MAX_STEPS}",
        "task=tests.support.slow_tasks:SlowImageClassification",  # >= 0.2 s a step: the signal
        "task_options.step_s=0.2",  # reaches the run before its last step on any machine
        "train.deterministic=true",
        "data.sample_log=true",
        "data.val=",
        "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
        "checkpoint.keep_best=0",
        *extra,
    )


@pytest.fixture(scope="module")
def straight(shapes_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference: DDP, 2 ranks, with an extra save at step 4.

    DDP fp32 and FSDP2 fp32 give bitwise-equal weights here, so one reference serves both.
    """
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    args = common_args(shapes_shards, run_dir, "checkpoint.every_steps=4")
    run_hpctrain("train", *args, "--nproc", "2")
    return run_dir


@pytest.mark.parametrize(
    ("strategy", "async_save"),
    [("ddp", "false"), ("fsdp", "true")],
    ids=["ddp-sync", "fsdp-async"],
)
def test_signal_then_resume_is_bitwise_identical(
    shapes_shards, straight, tmp_path, strategy, async_save
):
    interrupted = tmp_path / "interrupted"
    args = common_args(
        shapes_shards, interrupted, f"train.strategy={strategy}", f"checkpoint.async={async_save}"
    )
    signal_step = random.Random(strategy).randint(2, MAX_STEPS - 3)
    train_with_signal_at(args, interrupted, signal_step)
    stopped = [p.name for p in (interrupted / "checkpoints").iterdir() if p.name[:5] == "step-"]
    assert stopped and f"step-{MAX_STEPS}" not in stopped, stopped
    resumed = run_hpctrain("train", *args, "--nproc", "2")
    assert "resumed from step" in resumed.stderr

    assert_same_training_state(
        straight / "checkpoints" / f"step-{MAX_STEPS}",
        interrupted / "checkpoints" / f"step-{MAX_STEPS}",
    )
    assert sample_logs(straight, 2) == sample_logs(interrupted, 2)


def test_reshard_two_ranks_to_one_sees_every_sample_once(shapes_shards, straight, tmp_path):
    """DCP reshards model and optimizer (bitwise at the resume point: test_processes.py); here
    the run goes on at world size 1 and the loader re-plans the rest of the epoch."""
    # The 2-rank run as it was at step 4 (as if preempted there): checkpoint and audit logs.
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-4", run_dir / "checkpoints" / "step-4")
    (run_dir / "samples").mkdir()
    for rank, log in enumerate(sample_logs(straight, 2)):
        kept = [line for line in log.splitlines() if json.loads(line)["step"] <= 4]
        (run_dir / "samples" / f"rank-{rank}.jsonl").write_text("\n".join(kept) + "\n")

    # 320 training samples, batch 16: 10 steps per epoch at 2 ranks; 4 done (128 samples),
    # the other 192 are 12 steps at 1 rank.
    args = common_args(shapes_shards, run_dir, "train.max_steps=16")
    resumed = run_hpctrain("train", *args)  # one process
    assert "resumed from step 4" in resumed.stderr
    manifest = verify_checkpoint(open_store(str(run_dir / "checkpoints")), "step-16")
    assert manifest["world_size"] == 1

    keys = []
    for log in sample_logs(run_dir, 2):
        keys.extend(k for line in log.splitlines() for k in json.loads(line)["keys"])
    assert len(keys) == len(set(keys)) == 320, "every sample of the epoch exactly once"


def test_deadline_saves_and_asks_for_requeue(shapes_shards, tmp_path):
    """No signal at all: SLURM_JOB_END_TIME minus the margin has passed → save, exit 75."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, SLURM_JOB_END_TIME=str(int(time.time()) + 60))
    margin = "checkpoint.deadline_margin_s=120"
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "train", *common_args(shapes_shards, run_dir, margin)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-1").is_dir()
    assert not (run_dir / "checkpoints" / f"step-{MAX_STEPS}").exists()
