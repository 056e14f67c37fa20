"""Fine-tuning fixtures: a BPE tokenizer folder trained on a few KB (with a chat template, as a
Hugging Face tokenizer folder has one), text converted with it by `hpctrain convert`, and
single-process runs started from tiny transformers-made folders (`tests/models/test_hf.py`'s
`save_hf`).

Nothing is downloaded: the tokenizers library trains the tokenizer here, transformers builds
the models from configs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from hpctrain.config import load_config
from hpctrain.convert.run import ConvertOptions, convert
from hpctrain.distributed import DistEnv
from hpctrain.train.trainer import Trainer

VOCAB = 300  # the BPE tokenizer's ids; the models' vocab_size
SEQ_LEN = 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "a",
    "mat",
    "log",
    "and",
    "slept",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "river",
    "stone",
    "tree",
    "bird",
    "sings",
    "morning",
    "light",
    "falls",
    "across",
    "quiet",
    "fields",
    "where",
    "children",
    "play",
]


def sentences(seed: int, count: int) -> list[str]:
    """`count` documents of 20-40 words of a small language."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for _ in range(count)]


def save_bpe_folder(folder: Path, *, seed: int = 0, chat_template: bool = True) -> Path:
    """A tokenizer folder: `tokenizer.json` (byte-level BPE of `VOCAB` ids, trained on a few KB
    of `sentences(seed)`), and with `chat_template` the files transformers reads beside it:
    `tokenizer_config.json` holding a ChatML template, `chat_template.jinja`,
    `special_tokens_map.json`. Another `seed` trains another tokenizer of the same size."""
    import tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sentences(seed, 60), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if chat_template:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHATML,
            "eos_token": "<|im_end|>",
            "model_max_length": SEQ_LEN,  # what a training script may have left there
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "chat_template.jinja").write_text(CHATML)
        specials = {"eos_token": "<|im_end|>", "additional_special_tokens": SPECIALS[1:]}
        (folder / "special_tokens_map.json").write_text(json.dumps(specials))
    return folder / "tokenizer.json"


def save_metaspace_tokenizer(folder: Path) -> Path:
    """`folder/tokenizer.json`: a BPE of `VOCAB` ids whose words start with `▁`
    (sentencepiece's Metaspace, as Llama 2's and Mistral's), trained on `sentences(0)`: not
    Qwen's byte-level pre-tokenizer."""
    import tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[*SPECIALS, "<unk>"])
    tok.train_from_iterator([*sentences(0, 60), "a\nb, c: 1.5\t(d)"], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def convert_text(dest: Path, tokenizer: str, *, seed: int, documents: int) -> Path:
    """`documents` documents of `sentences(seed)` converted by `hpctrain convert` with
    `tokenizer` into `dest`; returns its index.json."""
    corpus = dest.parent / f".{dest.name}-corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(sentences(seed, documents)):
        (corpus / f"doc-{i:03d}.txt").write_text(text)
    options = ConvertOptions(
        str(corpus), str(dest), tokenizer=tokenizer, progress="none", overwrite=True
    )
    convert(options)
    return dest / "index.json"


def run_overrides(run_dir: Path, data: Path, *extra: str) -> list[str]:
    """A causal_lm run on `data/train` (validation `data/val`), one process, fp32."""
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={data / 'train' / 'index.json'}",
        f"data.val={data / 'val' / 'index.json'}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.workers_per_rank=0",
        "train.max_steps=1",
        "train.lr=0",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.every_steps=1",
        "logging.progress=lines",
        *extra,
    ]


def trainer(run_dir: Path, data: Path, *extra: str) -> Trainer:
    """The Trainer of `run_overrides` (built, not run)."""
    cfg = load_config(None, run_overrides(run_dir, data, *extra))
    return Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))


def train(run_dir: Path, data: Path, *extra: str) -> Trainer:
    """`trainer(...)` run to its end."""
    built = trainer(run_dir, data, *extra)
    assert built.fit() == 0
    return built


def eval_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def tokens(length: int = 24, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))
