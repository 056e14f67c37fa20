"""One rank of a 2-process gloo job: a causal_lm run started from a Hugging Face folder.

Started by `test_hf.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/hf_worker.py HF_FOLDER SHARDS RUN_DIR [OVERRIDE ...]
FSDP2 (RUN_DIR), then DDP (RUN_DIR-ddp), fp32, `model.init_from=HF_FOLDER`; the test
exports the runs and compares with transformers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402
from tests.models.test_hf import run_overrides  # noqa: E402


def main() -> None:
    folder, shards, run_dir, *extra = sys.argv[1:]
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for strategy, where in (("fsdp", run_dir), ("ddp", f"{run_dir}-ddp")):
            overrides = run_overrides(Path(folder), Path(shards), Path(where), *extra)
            cfg = load_config(None, [*overrides, f"train.strategy={strategy}"])
            assert Trainer(cfg, env, device).fit() == 0


if __name__ == "__main__":
    main()
