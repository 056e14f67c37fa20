"""One rank of a 2-process gloo job: optimizer steps on hand-made masked batches, under DDP
and FSDP2, for `tests/train/test_step_targets.py`.

    python tests/support/targets_worker.py INDEX OUT_DIR

Each case builds a fresh Trainer (same seed: the same initial weights as the test's
single-process ones) and takes one step on this rank's rows of `targets_kit.rows()`:
- `<strategy>-2x2`: batch 2 a rank (rank r: rows 2r, 2r+1);
- `<strategy>-2x1x2`: batch 1, 2 micro-batches a rank (the same rows);
- `<strategy>-empty-rank`: rank 0 rows 0 and 1, rank 1 two rows without a target.
Rank 0 writes every case's gradients and logged loss and targets to `OUT_DIR/cases.pt`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.support.*

from tests.support.targets_kit import gradients, lm_overrides, rows, stack  # noqa: E402


def main() -> None:
    index, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    r = env.rank
    every = rows()
    mine = every[2 * r : 2 * r + 2]
    empty = rows((0, 0), seed=1)
    cases = {
        "2x2": ([stack(mine)], ["data.batch_size=2"]),
        "2x1x2": (mine, ["data.batch_size=1", "train.grad_accum_steps=2"]),
        "empty-rank": ([stack(every[:2] if r == 0 else empty)], ["data.batch_size=2"]),
    }
    results = {}
    with process_group(env, device):
        for strategy in ("ddp", "fsdp"):
            for name, (batches, extra) in cases.items():
                case = f"{strategy}-{name}"
                overrides = lm_overrides(index, out / case, f"train.strategy={strategy}", *extra)
                trainer = Trainer(load_config(None, overrides), env, device)
                trainer.train_step(iter(batches))
                record = trainer.meter.summarize(device, env.world_size)
                grads = gradients(trainer.model)  # every rank: FSDP2 gathers
                results[case] = {
                    "grads": grads,
                    "loss": record["loss"],
                    "targets": record["targets"],
                }
                trainer.checkpoints.close()
                trainer.loader.close()
    if env.is_main:
        torch.save(results, out / "cases.pt")


if __name__ == "__main__":
    main()
