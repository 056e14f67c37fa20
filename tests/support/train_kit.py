"""Helpers for training tests: run `hpctrain` in fresh processes, as users do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def train_args(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`hpctrain train` arguments for a tiny, fast CPU run on `shards`."""
    return [str(REPO / "configs" / "demo.yaml"), *tiny_run_overrides(shards, run_dir, *overrides)]


def tiny_run_overrides(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """Overrides of the demo config for a tiny, fast CPU run on `shards` (DIR/train, DIR/val)."""
    return [
        f"run_dir={run_dir}",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "data.batch_size=16",
        "data.workers_per_rank=1",
        "data.shuffle_buffer=32",
        "model.image_size=16",
        "train.log_every=1",
        "train.warmup_steps=0",
        *overrides,
    ]


def run_hpctrain(
    *args: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"hpctrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def run_two_ranks(script: Path, *args: str, timeout: float = 600) -> list[str]:
    """Run `script ARGS` as 2 gloo ranks (torchrun-style environment); returns their outputs."""
    return run_ranks(script, *args, nprocs=2, timeout=timeout)


def run_ranks(
    script: Path, *args: str, nprocs: int, per_node: int = 0, timeout: float = 600
) -> list[str]:
    """Run `script ARGS` as `nprocs` gloo ranks (torchrun-style environment), `per_node` of
    them on each pretended node (LOCAL_WORLD_SIZE; 0: all on one); returns their outputs."""
    from hpctrain.launch.local import free_port

    port = free_port()
    per_node = per_node or nprocs
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank % per_node),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    codes = [p.returncode for p in procs]
    assert codes == [0] * nprocs, "\n".join(outputs)
    return outputs


def full_weights(model: Any) -> dict[str, Any]:
    """The full weights of a plain, DDP, FSDP2, HSDP or TP `model`, gathered onto rank 0's CPU
    (other ranks get `{}`). Every rank of the group must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def trainer_built_on_meta(cfg: Any, env: Any, device: Any) -> tuple[Any, bool]:
    """A Trainer of `cfg`, and whether `init_from.build_model` built its model on the meta
    device (the sharded import paths) rather than whole."""
    from hpctrain.models import init_from
    from hpctrain.train.trainer import Trainer

    built: list[bool] = []
    build = init_from.build_model

    def spy(task: Any, cfg: Any, strategy: str, **kwargs: Any) -> Any:
        result = build(task, cfg, strategy, **kwargs)
        built.append(result.on_meta)
        return result

    init_from.build_model = spy  # the Trainer calls it through the module
    try:
        trainer = Trainer(cfg, env, device)
    finally:
        init_from.build_model = build
    assert len(built) == 1, built
    return trainer, built[0]
