"""One rank of the 2-process gloo job that runs every cell of the matrix (`matrix.py`) in-process.

Started by `test_matrix.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/matrix_worker.py SHARDS OUT_DIR [CELL ...]   # only these cells

Each cell trains `STEPS_BEFORE_SAVE` steps with a `Trainer` and saves; a fresh `Trainer`
resumes from that checkpoint and trains to `TOTAL_STEPS`. The outcome (trained with its losses
and checkpoints, refused with its message, or failed with its error) goes to
`OUT_DIR/results/<cell>.json`. Two-rank cells share one process group; then the group is torn
down and the one-process (`none`) cells are split between the two processes.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpctrain.config import ConfigError, load_config  # noqa: E402
from hpctrain.distributed import DistEnv, choose_device, process_group, resolve_env  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402
from tests.support.matrix_kit import (  # noqa: E402
    GRID,
    REFUSAL_CELLS,
    STEPS_BEFORE_SAVE,
    TOTAL_STEPS,
    Cell,
)

SINGLE = DistEnv(
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    master_addr="127.0.0.1",
    master_port=0,
    source="single",
)


def run_cell(cell: Cell, shards: Path, out: Path, env: DistEnv) -> dict[str, Any]:
    run_dir = out / "runs" / cell.name
    device = torch.device("cpu")
    start = time.perf_counter()
    try:
        cfg = load_config(None, cell.overrides(shards, run_dir, STEPS_BEFORE_SAVE))
        try:
            first = Trainer(cfg, env, device)
        except ConfigError as exc:
            return {"outcome": "refused", "message": str(exc), "wrote": run_dir.exists()}
        assert first.fit() == 0
        resumed = Trainer(
            load_config(None, cell.overrides(shards, run_dir, TOTAL_STEPS)), env, device
        )
        assert resumed.fit() == 0
    except Exception as exc:  # reported cell by cell by the test
        traceback.print_exc()
        return {"outcome": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    losses = [r["loss"] for r in train]
    return {
        "outcome": "trained",
        "steps": [r["step"] for r in train],  # [1, 2]: the second run resumed at step 1
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")),
        "seconds": round(time.perf_counter() - start, 2),
    }


def write(out: Path, cell: Cell, result: dict[str, Any]) -> None:
    path = out / "results" / f"{cell.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = resolve_env()
    torch.set_num_threads(1)
    only = sys.argv[3:]
    cells = [c for c in GRID + REFUSAL_CELLS if not only or c.name in only]
    with process_group(env, choose_device(env, prefer="cpu")):
        for cell in (c for c in cells if c.world_size == 2):
            result = run_cell(cell, shards, out, env)
            if env.is_main:
                write(out, cell, result)
            print(f"rank {env.rank} {cell.name}: {result['outcome']}", flush=True)
    singles = [c for c in cells if c.world_size == 1]
    for cell in singles[env.rank :: env.world_size]:
        write(out, cell, run_cell(cell, shards, out, SINGLE))


if __name__ == "__main__":
    main()
