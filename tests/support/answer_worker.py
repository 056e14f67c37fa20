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

import logging
import sys
from pathlib import Path

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
            assert Trainer(load_config(None, overrides), env, device).fit() == 0
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
