"""The held-out check of issue 40: does a LoRA fine-tune lower the validation loss on the
responses as much as a full fine-tune (within 10 %), same steps, each at its best learning rate?

    python tools/lora_heldout.py WORK [--steps 60] [--pretrain-steps 300]

1. A small Llama-shaped GPT (bytes, 4 layers of 128) is pre-trained on the Python standard
   library's source (`tools/stdlib_corpus.py`) and exported with `--format hf`: the
   "imported Llama" base, a Hugging Face folder like any other.
2. A prompt/response set (`Q: <letters>\\nA: ` -> the letters reversed), converted with a loss
   mask, 10 % held out.
3. The base's loss on the held-out responses (a LoRA run at lr 0: B = 0 is the base), then
   full fine-tunes and LoRA rank 8 fine-tunes of `--steps` steps at a few learning rates each.
Prints each run's held-out loss, the best reduction of each kind and their ratio (goal:
LoRA's >= 0.9x the full fine-tune's). Every run is `hpctrain train` on this CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FULL_LRS = (0.0003, 0.001, 0.003)
LORA_LRS = (0.001, 0.003, 0.01)
GOAL = 0.9


def hpctrain(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hpctrain {args[0]} failed:\n{done.stderr[-2000:]}")


def train(work: Path, *overrides: str) -> None:
    """`hpctrain train` of a config holding only the task, with `overrides`."""
    config = work / "causal_lm.yaml"
    config.write_text("task: causal_lm\n")
    hpctrain("train", str(config), *overrides)


def last_eval(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return float([r for r in records if r.get("kind") == "eval"][-1]["val_loss"])


def common(run_dir: Path, train: Path, val: Path, steps: int, lr: float) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={train}",
        f"data.val={val}",
        "data.seq_len=64",
        "data.batch_size=16",
        "data.workers_per_rank=0",
        f"train.max_steps={steps}",
        f"train.lr={lr}",
        "train.warmup_steps=0",
        "train.schedule=cosine",
        "train.strategy=none",
        "train.precision=fp32",
        "train.eval_every=0",
        f"checkpoint.every_steps={steps}",
        "logging.progress=lines",
    ]


def write_records(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            letters = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8)))
            record = {"prompt": f"Q: {letters}\nA: ", "response": letters[::-1] + "."}
            f.write(json.dumps(record) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps of every run")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus"
    if not corpus.exists():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "stdlib_corpus.py"),
                "--max-files",
                "300",
                str(corpus),
            ],
            check=True,
            capture_output=True,
        )
        hpctrain("convert", str(corpus), str(work / "text"), "--tokenizer", "bytes",
                 "--text-glob", "*.py", "--val-fraction", "0.05", "--progress", "none")  # fmt: skip
    base = work / "base-hf"
    if not base.exists():
        pretrain = work / "pretrain"
        train(
            work,
            *common(
                pretrain,
                work / "text" / "train" / "index.json",
                work / "text" / "val" / "index.json",
                args.pretrain_steps,
                0.003,
            ),
            "model.name=gpt-tiny",
            "causal_lm.dim=128",
            "causal_lm.n_layers=4",
            "causal_lm.n_heads=4",
            "causal_lm.tie_embeddings=false",
        )
        hpctrain("export", str(pretrain), str(base), "--format", "hf")
    sft = work / "sft"
    if not sft.exists():
        write_records(work / "sft.jsonl", 2000, seed=0)
        hpctrain("convert", str(work / "sft.jsonl"), str(sft), "--tokenizer", "bytes",
                 "--prompt-field", "prompt", "--response-field", "response",
                 "--val-fraction", "0.1", "--sample-tokens", "512", "--progress", "none")  # fmt: skip
    train_index, val = sft / "train" / "index.json", sft / "val" / "index.json"
    lora = ["model.lora.rank=8", "model.lora.alpha=16"]
    results: dict[str, float] = {}

    def run(name: str, lr: float, steps: int, *extra: str) -> float:
        run_dir = work / "runs" / name
        if not (run_dir / "metrics.jsonl").exists():
            overrides = common(run_dir, train_index, val, steps, lr)
            train(work, *overrides, f"model.init_from={base}", *extra)
        results[name] = last_eval(run_dir)
        print(f"{name:16} held-out response loss {results[name]:.4f}", flush=True)
        return results[name]

    base_loss = run("base", 0.0, 1, *lora)  # lr 0 and B = 0: the base itself
    full = {lr: run(f"full-{lr:g}", lr, args.steps) for lr in FULL_LRS}
    adapted = {lr: run(f"lora-{lr:g}", lr, args.steps, *lora) for lr in LORA_LRS}
    full_drop = base_loss - min(full.values())
    lora_drop = base_loss - min(adapted.values())
    ratio = lora_drop / full_drop
    summary = {
        "steps": args.steps,
        "base_loss": base_loss,
        "full": full,
        "lora": adapted,
        "full_reduction": full_drop,
        "lora_reduction": lora_drop,
        "ratio": ratio,
        "goal": GOAL,
    }
    (work / "heldout.json").write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "met" if ratio >= GOAL else "missed"
    print(
        f"base {base_loss:.4f}; best full {min(full.values()):.4f} (-{full_drop:.4f}), best LoRA "
        f"{min(adapted.values()):.4f} (-{lora_drop:.4f}): LoRA / full reduction = {ratio:.2f} "
        f"(goal >= {GOAL}: {verdict})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
