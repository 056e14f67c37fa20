"""One rank of the 2-rank answer-scoring job of `tests/inference/test_answers.py` (gloo, CPU).

    python tests/support/answer_worker.py TOKENS CHECKPOINT QA_JSONL OUT_DIR

For each strategy (DDP, FSDP2, HSDP 2x1, tensor parallelism over 2), a run warm-started from
CHECKPOINT trains one step at lr 0 (the weights stay the checkpoint's) and evaluates with
eval.generate: each rank answers its share of the validation prompts. Then `hpctrain eval
--data QA_JSONL` runs as this job's two ranks. Last `hpctrain eval` over data.val
(eval.generate on). The records: `OUT_DIR/<case>/metrics.jsonl`, `OUT_DIR/held-out.json`,
`OUT_DIR/val.json`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.answer_kit import qa_overrides  # noqa: E402

CASES = {
    "ddp": ["train.strategy=ddp"],
    "fsdp": ["train.strategy=fsdp"],
    "hsdp": ["train.strategy=hsdp", "train.shard_degree=1"],
    "tp": ["train.strategy=fsdp", "train.tp_degree=2"],
}


# Prompts that reach a window of 8 at different steps, other ones on each data-parallel rank
# (the tensor-parallel ranks share theirs)
WINDOW_PROMPTS = [[10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34]]


def window_prompts(rank: int) -> list[list[int]]:
    return [[t + 7 * rank for t in p] for p in WINDOW_PROMPTS[rank:] + WINDOW_PROMPTS[:rank]]


def window_rows(model: torch.nn.Module, env: Any, out: Path) -> None:
    """Decode in lockstep past a window of 8 (restarts at different steps on each rank);
    `tests/inference/test_answers.py` compares each row with its prompt decoded alone."""
    from hpctrain.models.decoding import decode, sequence_multiple

    if sequence_multiple(model) > 1:  # tensor parallelism: both ranks hold the same rows
        prompts = window_prompts(0)
    else:  # data parallelism: batches of other prompts and sizes
        prompts = window_prompts(env.rank)[: 3 - env.rank]
    model.eval()
    rows = decode(model, prompts, max_new_tokens=20, window=8, lockstep=True)
    out.write_text(json.dumps({"prompts": prompts, "rows": rows}))


def main() -> None:
    tokens, checkpoint, qa, out = (Path(a) for a in sys.argv[1:5])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        for name, extra in CASES.items():
            overrides = qa_overrides(
                tokens,
                out / name,
                f"model.init_from={checkpoint}",
                "train.lr=0",
                "train.max_steps=1",
                *extra,
            )
            trainer = Trainer(load_config(None, overrides), env, device)
            assert trainer.fit() == 0
            if name in ("fsdp", "tp"):
                window_rows(trainer.model, env, out / f"{name}-window-{env.rank}.json")
        from hpctrain.inference.answers import run_answers

        cfg = load_config(None, qa_overrides(tokens, out / "answers", "train.strategy=fsdp"))
        fields = {"prompt_field": "prompt", "response_field": "response"}
        held_out = str(out / "held-out.json")
        code = run_answers(
            cfg, data=str(qa), fields=fields, checkpoint=str(checkpoint), out=held_out
        )
        assert code == 0
        from hpctrain.inference.evaluate import run_eval

        assert run_eval(cfg, checkpoint=str(checkpoint), out=str(out / "val.json")) == 0


if __name__ == "__main__":
    main()
