"""One rank of the 2-process gloo job behind `test_ema.py` (one process group, every case).

    python tests/support/ema_worker.py SHARDS OUT_DIR

Cases (the test asserts on what rank 0 writes to OUT_DIR):
- `ddp`, `fsdp`: 4 steps with train.ema_decay, fp32; the full EMA -> `<case>.ema.pt`.
- `fsdp-interrupted`: the `fsdp` config, a real SIGUSR2 raised on both ranks after step 2
  (the run saves and returns the requeue code), then a fresh Trainer resumes to step 4.
- each evaluates with the EMA (train.ema_eval) every 2 steps (records in metrics.jsonl).
- `fsdp-bf16`: built, not trained: the EMA under FSDP2 mixed precision -> `fsdp-bf16.json`.
- GPU counters (NVML mocked) reduced over the 2 ranks -> `gpu-stats.json`.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.observe.gpu_stats import GpuCounters
from hpctrain.train.preemption import REQUEUE_EXIT_CODE
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.custom_task

EMA = ["train.ema_decay=0.7"]
# Evaluating with the EMA swaps it in and out of the model (FSDP2: of the parameter shards
# that forward gathers): training must go on bitwise as without, evaluations agree.
EMA_EVAL = ["data.val={shards}/val/index.json", "train.eval_every=2", "train.ema_eval=true"]
CASES: dict[str, list[str]] = {
    "ddp": ["train.strategy=ddp", *EMA, *EMA_EVAL],
    "fsdp": ["train.strategy=fsdp", *EMA, *EMA_EVAL],
    "fsdp-interrupted": ["train.strategy=fsdp", *EMA, *EMA_EVAL],
    # FSDP2 keeping the gathered parameters after forward: an evaluation (no backward) leaves
    # them gathered, and the swap back must still reach the next training step.
    "fsdp-kept": ["train.strategy=fsdp", "train.reshard_after_forward=false", *EMA, *EMA_EVAL],
}
BF16 = ["train.strategy=fsdp", "train.precision=bf16", *EMA]


def make_trainer(
    shards: Path, run_dir: Path, overrides: list[str], env: Any, device: Any
) -> Trainer:
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            "task=examples.custom_task:ThumbnailMLP",
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
            *(o.replace("{shards}", str(shards)) for o in overrides),
        ],
    )
    return Trainer(cfg, env, device)


def full_ema(trainer: Trainer) -> dict[str, torch.Tensor]:
    assert trainer.ema is not None
    return {
        name: (w.full_tensor() if isinstance(w, DTensor) else w).clone()
        for name, w in trainer.ema.state_dict().items()
    }


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
        for name, overrides in CASES.items():
            run_dir = out / name
            trainer = make_trainer(shards, run_dir, overrides, env, device)
            if name == "fsdp-interrupted":
                signal_after_step(trainer, 2)
                assert trainer.fit() == REQUEUE_EXIT_CODE
                trainer = make_trainer(shards, run_dir, overrides, env, device)
            assert trainer.fit() == 0
            ema = full_ema(trainer)
            if env.is_main:
                torch.save(ema, out / f"{name}.ema.pt")
        # Mixed precision: built, not trained (bf16 is ~40x slower than fp32 on a CPU).
        trainer = make_trainer(shards, out / "fsdp-bf16", BF16, env, device)
        assert trainer.ema is not None
        params = list(trainer.model.parameters())
        facts = {
            "ema_dtypes": sorted({str(w.dtype) for w in trainer.ema.weights}),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "same_placements": all(
                isinstance(w, DTensor)
                and isinstance(p, DTensor)
                and w.placements == p.placements
                and w.to_local().shape == p.to_local().shape
                for w, p in zip(trainer.ema.weights, params, strict=True)
            ),
        }
        trainer.loader.close()
        trainer.checkpoints.close()
        if env.is_main:
            (out / "fsdp-bf16.json").write_text(json.dumps(facts))
        # GPU counters gathered over the real group; NVML is MOCKED (no GPU here): rank r
        # reads 10 + 50 r % busy and 100 (r + 1) MB used of 1 GiB.
        torch.cuda.utilization = lambda device=None: 10 + 50 * env.rank  # type: ignore[assignment]
        torch.cuda.device_memory_used = lambda device=None: 100 * (env.rank + 1) * 2**20  # type: ignore[assignment]
        torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(  # type: ignore[assignment]
            total_memory=2**30
        )
        stats = GpuCounters(torch.device("cuda", 0), dist.group.WORLD).read()
        if env.is_main:
            (out / "gpu-stats.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
