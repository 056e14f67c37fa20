"""One rank of a 2-process gloo job that trains the causal_lm task in several ways in-process.

Started by `test_causal_lm.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/lm_worker.py SHARDS OUT_DIR

Cases (one process group, so the whole set is one job of a few seconds):
- `ddp`, `fsdp`: fp32, the same 6 steps (checkpoints at 3 and 6, sample logs).
- `fsdp-signal`: FSDP2; rank 0 gets SIGUSR2 during step 2, all ranks save and `fit` returns
  75; a new Trainer in the same processes resumes from that checkpoint and trains to step 6.
- `fsdp-bf16`: FSDP2, bf16 with fp32 reductions, activation checkpointing, 2 steps.
Rank 0 writes the full weights of each to `OUT_DIR/<case>.pt` and the signalled run's exit
code to `OUT_DIR/fsdp-signal.code`. Then the group is torn down and rank 0 alone continues the
`ddp` run from its step-3 checkpoint at world size 1 with a loader worker (`elastic`): an
elastic resume 2 → 1 ranks that must finish the epoch with every sequence seen once.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import DistEnv, choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.support.lm_tasks

from tests.support.train_kit import full_weights  # noqa: E402

STEPS = 6
# 4 train shards × 16 sequences, batch 4 on each of 2 ranks: 8 steps an epoch. After 3 steps
# (24 sequences) 40 remain: 10 steps at 1 rank.
ELASTIC_FROM, ELASTIC_STEPS = 3, 13

CASES = {
    "ddp": ["train.strategy=ddp"],
    "fsdp": ["train.strategy=fsdp"],
    "fsdp-signal": [
        "train.strategy=fsdp",
        "task=tests.support.lm_tasks:SignalingCausalLM",
        "task_options.signal_at_call=2",
    ],
    "fsdp-bf16": [
        "train.strategy=fsdp",
        "train.precision=bf16",
        "train.activation_checkpointing=true",
        "train.max_steps=2",
        "data.sample_log=false",
    ],
}


def overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "data.shuffle_buffer=8",
        "data.sample_log=true",
        "causal_lm.dim=32",
        "causal_lm.n_layers=2",
        "causal_lm.n_heads=4",
        "causal_lm.n_kv_heads=2",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.lr=0.01",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.every_steps=3",
        "logging.progress=lines",
        *extra,
    ]


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for name, extra in CASES.items():
            trainer = Trainer(load_config(None, overrides(shards, out / name, *extra)), env, device)
            code = trainer.fit()
            if name == "fsdp-signal":
                (out / f"{name}.code").write_text(str(code))
                resumed = overrides(shards, out / name, *extra, "task_options.signal_at_call=0")
                trainer = Trainer(load_config(None, resumed), env, device)
                assert trainer.fit() == 0
            weights = full_weights(trainer.model)
            if env.is_main:
                torch.save(weights, out / f"{name}.pt")
    if env.is_main:
        continue_alone(shards, out)


def continue_alone(shards: Path, out: Path) -> None:
    """The `ddp` run as it was at step 3 (checkpoint and sample logs), continued by 1 rank."""
    source, run_dir = out / "ddp", out / "elastic"
    step = f"step-{ELASTIC_FROM}"
    shutil.copytree(source / "checkpoints" / step, run_dir / "checkpoints" / step)
    (run_dir / "samples").mkdir()
    for log in (source / "samples").iterdir():
        lines = log.read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["step"] <= ELASTIC_FROM]
        (run_dir / "samples" / log.name).write_text("".join(line + "\n" for line in kept))
    single = DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=0,
        source="single",
    )
    cfg = load_config(
        None,
        overrides(
            shards,
            run_dir,
            f"train.max_steps={ELASTIC_STEPS}",
            "data.workers_per_rank=1",  # sequences through a worker process and shared memory
            "data.val=",
        ),
    )
    trainer = Trainer(cfg, single, torch.device("cpu"))
    assert trainer.fit() == 0


if __name__ == "__main__":
    main()
