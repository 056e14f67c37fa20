"""One rank of the 2-process gloo job behind `test_finetune.py` (one process group, every case).

    python tests/support/finetune_worker.py SHARDS OUT_DIR

Every case trains `DeepMLP` (three linear layers: `1.*`, `3.*`, `5.*`) with `FINETUNE`: layer 1
frozen whole (a whole FSDP2 unit), layer 3's weight frozen but not its bias (one unit holding
frozen and trained parameters), layer 5 at 10x the learning rate, an EMA, a warmup and a
cosine schedule. Cases (rank 0 writes `<case>.pt` to OUT_DIR):
- `ddp`, `fsdp`: 4 steps straight;
- `ddp-interrupted`, `fsdp-interrupted`: a real SIGUSR2 raised on both ranks after step 2 (the
  run saves and returns the requeue code), then a fresh Trainer resumes to step 4.
Each `<case>.pt` holds the full initial and final weights, the full EMA, the learning rate of
every optimizer group at each step and the names of the parameters that have optimizer state.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.custom_task, tests.train

from examples.custom_task import ThumbnailMLP  # noqa: E402

from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from hpctrain.train.optim import named_parameters  # noqa: E402
from hpctrain.train.preemption import REQUEUE_EXIT_CODE  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402


class DeepMLP(ThumbnailMLP):
    """ThumbnailMLP with one more hidden layer: three units of parameters under FSDP2."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 16, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.num_classes),
        )


TASK = "tests.support.finetune_worker:DeepMLP"
FINETUNE = [
    "train.freeze=['1.*', '3.weight']",
    "train.lr_groups=[{pattern: '5.*', lr_scale: 10}]",
    "train.ema_decay=0.7",
    "train.warmup_steps=2",
    "train.schedule=cosine",
]
CASES = {
    "ddp": ["train.strategy=ddp"],
    "ddp-interrupted": ["train.strategy=ddp"],
    "fsdp": ["train.strategy=fsdp"],
    "fsdp-interrupted": ["train.strategy=fsdp"],
}


def overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"task={TASK}",
        "task_options.hidden=16",
        f"data.train={shards / 'train' / 'index.json'}",
        "data.val=",
        "data.batch_size=8",
        "data.workers_per_rank=0",
        "data.shuffle_buffer=16",
        "train.max_steps=4",
        "train.log_every=1",
        "train.lr=0.05",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.deadline_margin_s=0",
        "logging.progress=lines",
        *FINETUNE,
        *extra,
    ]


def full(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in tensors.items()
    }


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every rank calls this (FSDP2 gathers): plain names under DDP and FSDP2 alike."""
    return full(get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True)))


def record_rates(trainer: Trainer, rates: list[list[float]]) -> None:
    """Append the rate of every optimizer group that each step uses, before the step."""
    original = trainer.train_step

    def train_step(batches: Any) -> None:
        rates.append([group["lr"] for group in trainer.optimizer.param_groups])
        original(batches)

    trainer.train_step = train_step  # type: ignore[method-assign]


def signal_after_step(trainer: Trainer, step: int) -> None:
    """Raise SIGUSR2 in this rank right after `step`: the real handler, the real agreement."""
    original = trainer.train_step

    def train_step(batches: Any) -> None:
        original(batches)
        if trainer.state.step == step:
            signal.raise_signal(signal.SIGUSR2)

    trainer.train_step = train_step  # type: ignore[method-assign]


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for name, extra in CASES.items():
            cfg = load_config(None, overrides(shards, out / name, *extra))
            trainer = Trainer(cfg, env, device)
            initial = full_weights(trainer)
            rates: list[list[float]] = []
            record_rates(trainer, rates)
            if name.endswith("-interrupted"):
                signal_after_step(trainer, 2)
                assert trainer.fit() == REQUEUE_EXIT_CODE
                trainer = Trainer(cfg, env, device)
                record_rates(trainer, rates)
            assert trainer.fit() == 0
            assert trainer.ema is not None
            names = {id(param): names[0] for names, param in named_parameters(trainer.model)}
            result = {
                "initial": initial,
                "final": full_weights(trainer),
                "ema": full(trainer.ema.state_dict()),
                "rates": rates,
                "with_state": sorted(names[id(p)] for p in trainer.optimizer.state),
            }
            if env.is_main:
                torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main()
    # Leave without the interpreter's shutdown: once in CI a rank aborted there, after its
    # results were written ("terminate called without an active exception" from a native
    # thread's destructor), failing a run whose checks had all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
