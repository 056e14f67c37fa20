"""One rank of the 2-process gloo job behind `test_lora_ranks.py` (one process group, every case).

    python tests/support/lora_worker.py HF_FOLDER SHARDS OUT_DIR

Every case fine-tunes LoRA adapters (rank 4) on the tiny Llama folder HF_FOLDER for 3 steps,
fp32 unless named, and rank 0 writes the final adapters, gathered whole, to OUT_DIR/<case>.pt:
- `ddp`, `fsdp` (built on the meta device, each rank reading its rows of the base), `hsdp`
  (2 replicas of 1 shard), `fsdp-ac` (activation checkpointing);
- `fsdp-preempted`: a real SIGUSR2 on both ranks after step 1 (the run saves and returns the
  requeue code), then a fresh Trainer resumes to step 3;
- `ddp-qlora`, `fsdp-qlora`: the adapted layers' base in NF4;
- `ddp-clip`, `fsdp-clip`, `hsdp-clip`: 12 steps, each clipped (`train.grad_clip=0.01`);
- `fsdp-bf16`: bf16 compute on a bf16 base, one step (bf16 is ~40x slower on this CPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from hpctrain.models.lora import is_adapter  # noqa: E402
from hpctrain.train.preemption import REQUEUE_EXIT_CODE  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402
from tests.support.finetune_worker import full, signal_after_step  # noqa: E402
from tests.support.lm_kit import SEQ_LEN  # noqa: E402

CASES_ALL = {
    "ddp": ["train.strategy=ddp"],
    "fsdp": ["train.strategy=fsdp"],
    "hsdp": ["train.strategy=hsdp", "train.shard_degree=1"],
    "fsdp-ac": ["train.strategy=fsdp", "train.activation_checkpointing=true"],
    "fsdp-preempted": ["train.strategy=fsdp"],
    "ddp-qlora": ["train.strategy=ddp", "model.lora.quantize_base=nf4"],
    "fsdp-qlora": ["train.strategy=fsdp", "model.lora.quantize_base=nf4"],
    # 12 steps clipped at every step (the norm is near 0.1 here)
    "ddp-clip": ["train.strategy=ddp", "train.grad_clip=0.01", "train.max_steps=12"],
    "fsdp-clip": ["train.strategy=fsdp", "train.grad_clip=0.01", "train.max_steps=12"],
    "hsdp-clip": [
        "train.strategy=hsdp",
        "train.shard_degree=1",
        "train.grad_clip=0.01",
        "train.max_steps=12",
    ],
    "fsdp-bf16": [
        "train.strategy=fsdp",
        "train.precision=bf16",
        "model.lora.base_dtype=bf16",
        "train.max_steps=1",
    ],
}


# LORA_CASES=a,b runs only those (a debugging aid)
CASES = {
    k: v
    for k, v in CASES_ALL.items()
    if not os.environ.get("LORA_CASES") or k in os.environ["LORA_CASES"].split(",")
}


def overrides(folder: Path, shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"model.init_from={folder}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.workers_per_rank=0",
        "train.max_steps=3",
        "train.lr=0.02",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.deadline_margin_s=0",
        "logging.progress=lines",
        *extra,
    ]


def main() -> None:
    folder, shards, out = (Path(arg) for arg in sys.argv[1:4])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for name, extra in CASES.items():
            cfg = load_config(None, overrides(folder, shards, out / name, *extra))
            trainer = Trainer(cfg, env, device)
            if name.endswith("-preempted"):
                signal_after_step(trainer, 1)
                assert trainer.fit() == REQUEUE_EXIT_CODE
                trainer = Trainer(cfg, env, device)
            assert trainer.fit() == 0
            state = get_model_state_dict(
                trainer.model, options=StateDictOptions(ignore_frozen_params=True)
            )
            adapters = full({k: v for k, v in state.items() if is_adapter(k)})
            if env.is_main:
                torch.save(adapters, out / f"{name}.pt")


if __name__ == "__main__":
    main()
    # as finetune_worker.py: leave without the interpreter's shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
