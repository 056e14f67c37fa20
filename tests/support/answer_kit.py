"""Question/answer data for the answer-scoring tests: the answer depends on the prompt.

A prompt is 2-4 letters of `LETTERS` and a newline; its answer is its first letter upper-cased
and a full stop ("bca\\n" -> "B."): a tiny GPT learns it in a few dozen steps (exact match
rises from about a quarter to 1), and an answer that ignored the prompt would be right one
time in four. The text is tokenized by a byte-level `tokenizer.json` (one id per byte, and
`<|endoftext|>`), so that `export --format hf` writes a folder transformers and the harness's
`hf` model type load whole.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hpctrain.convert.run import ConvertOptions, convert

LETTERS = "abcd"
TINY = ["causal_lm.dim=32", "causal_lm.n_layers=2", "causal_lm.n_heads=4", "data.seq_len=64"]


def qa_rows(num: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        letters = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))
        rows.append({"prompt": letters + "\n", "response": letters[0].upper() + "."})
    return rows


def write_qa(path: Path, num: int, seed: int) -> list[dict[str, str]]:
    rows = qa_rows(num, seed)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def write_byte_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json without merges: 256 byte ids, `<|endoftext|>` = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def qa_shards(root: Path, num: int = 600, seed: int = 0) -> Path:
    """`root/tokens/{train,val}/index.json`: `num` records tokenized by
    `root/tokenizer.json`, a tenth for validation; returns `root/tokens`."""
    write_qa(root / "qa.jsonl", num, seed)
    tokenizer = write_byte_tokenizer(root / "tokenizer.json")
    convert(
        ConvertOptions(
            str(root / "qa.jsonl"),
            str(root / "tokens"),
            tokenizer=str(tokenizer),
            prompt_field="prompt",
            response_field="response",
            sample_tokens=96,
            samples_per_shard=8,
            val_fraction=0.1,
            progress="none",
        )
    )
    return root / "tokens"


def qa_overrides(tokens: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny GPT trained on `qa_shards`, answering 30 validation prompts per evaluation."""
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={tokens / 'train' / 'index.json'}",
        f"data.val={tokens / 'val' / 'index.json'}",
        *TINY,
        "data.batch_size=8",
        "data.workers_per_rank=0",
        "train.lr=0.01",
        "train.precision=fp32",
        "train.log_every=10",
        "checkpoint.every_steps=1000",
        "logging.progress=lines",
        "eval.generate=true",
        "eval.max_new_tokens=6",
        "eval.generate_samples=30",
        *extra,
    ]
