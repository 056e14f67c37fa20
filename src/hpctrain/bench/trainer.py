"""`hpctrain bench trainer`: the Trainer's step against a hand-written PyTorch loop.

Both loops run the same model (resnet18 at 64 px, batch 32; and a tiny MLP) on the same
in-memory batches in one process with one thread. Segments of a few steps alternate
(reference A, reference B, Trainer, in a rotating order) over many pairs; the report is the
median of the paired ratios Trainer/A, and the A/A control B/A, which says how much two
identical loops differ on this machine right now (if it strays beyond 1.00 ± 0.03 the run is
too noisy to read a 2% overhead from). On the MLP, whose step is a fraction of a
millisecond, the median paired difference per step is the Trainer's fixed overhead.

With `--task causal_lm` the comparison runs on `gpt-tiny` (byte vocabulary, sequences of
`--seq-len` tokens): the reference loop computes the next-token cross-entropy itself, the
Trainer goes through the `causal_lm` task as a real run does. A second case,
`gpt-tiny+docs`, gives the Trainer's batches `positions` (documents of 16-128 tokens packed
together, as the loader makes them): the Trainer attends per document (the block-causal mask)
while the reference loop keeps plain causal attention, so its ratio is the cost of the mask
with the Trainer's own (about 1.00) on top.

The Trainer is built from a config as for a real run (its loader is never iterated: the
batches come from memory), with logging and checkpointing off, and steps through the same
`train_step` + `step_boundary` as `fit`. A last part runs the demo config with 2 loader
workers for real and reports its data-wait fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import Config, load_config
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.distributed import resolve_env
from hpctrain.files import write_atomic

HELP = "Trainer step vs a hand-written PyTorch loop (paired ratios, A/A control), data wait"
REPO = Path(__file__).resolve().parents[3]
NOISE_LIMIT = 0.03


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=12, help="interleaved resnet18 pairs")
    parser.add_argument("--mlp-pairs", type=int, default=24, help="interleaved MLP pairs")
    parser.add_argument(
        "--resnet-steps", type=int, default=2, help="resnet18 steps per timed segment"
    )
    parser.add_argument("--mlp-steps", type=int, default=300, help="MLP steps per timed segment")
    parser.add_argument(
        "--demo-shards",
        default=str(REPO / "data" / "demo" / "shards"),
        help="demo shards (make demo); generated in a temporary folder when missing",
    )
    parser.add_argument(
        "--demo-steps", type=int, default=60, help="steps of the data-wait run (0 skips it)"
    )
    parser.add_argument(
        "--task",
        choices=("image_classification", "causal_lm"),
        default="image_classification",
        help="image_classification: MLP + resnet18 + demo data wait; causal_lm: gpt-tiny",
    )
    parser.add_argument("--gpt-pairs", type=int, default=12, help="interleaved gpt-tiny pairs")
    parser.add_argument("--gpt-steps", type=int, default=4, help="gpt-tiny steps per segment")
    parser.add_argument("--seq-len", type=int, default=256, help="gpt-tiny sequence length")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


class FeatureMLP:
    """A task on float feature vectors: the smallest step, so the loop's own cost shows."""

    def __init__(self, cfg: Config, index: ShardIndex) -> None:
        self.num_classes = len(index.class_names)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, self.num_classes))

    def train_transform(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return _identity

    def eval_transform(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return _identity

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.cross_entropy(model(batch["image"]), batch["label"]), {}

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"count": batch["valid"].float().sum()}


def _identity(sample: dict[str, Any]) -> dict[str, Any]:
    return sample


# The byte tokenizer's facts (hpctrain.data.tokens): 256 byte ids and an end-of-document id.
BYTES_VOCAB_SIZE = 257
BYTES_TOKENIZER = {"name": "bytes", "vocab_size": BYTES_VOCAB_SIZE, "eod_id": 256, "sha256": ""}
GPT_BATCH_SIZE = 8
GPT_DOCS = "gpt-tiny+docs"  # the Trainer's batches carry positions: per-document attention


def make_batches(
    kind: str, count: int, batch_size: int = 32, seq_len: int = 256
) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(count):
        if kind.startswith("gpt-tiny"):
            # The loader's packed sequences: seq_len inputs plus the shifted last target.
            tokens = torch.randint(
                0, BYTES_VOCAB_SIZE, (batch_size, seq_len + 1), generator=generator
            )
            batch = {
                "tokens": tokens,
                "key": [f"{i}-{j}" for j in range(batch_size)],
                "valid": torch.ones(batch_size, dtype=torch.bool),
            }
            if kind == GPT_DOCS:
                batch["positions"] = document_positions(batch_size, seq_len + 1, generator)
            batches.append(batch)
            continue
        if kind == "resnet18":
            image = torch.randint(
                0, 256, (batch_size, 3, 64, 64), dtype=torch.uint8, generator=generator
            )
        else:
            image = torch.randn(batch_size, 32, generator=generator)
        batches.append(
            {
                "image": image,
                "label": torch.randint(0, 10, (batch_size,), generator=generator),
                "key": [f"{i}-{j}" for j in range(batch_size)],
                "valid": torch.ones(batch_size, dtype=torch.bool),
            }
        )
    return batches


def document_positions(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Each token's position in its document, for documents of 16-128 tokens back to back."""
    positions = torch.empty(rows, length, dtype=torch.long)
    for row in range(rows):
        t = 0
        while t < length:
            n = int(torch.randint(16, 129, (), generator=generator))
            end = min(length, t + n)
            positions[row, t:end] = torch.arange(end - t)
            t = end
    return positions


def bench_config(kind: str, work: Path, seq_len: int = 256) -> Config:
    """A run config whose index names 10 classes (or a byte tokenizer) and plenty of samples
    (never read)."""
    if kind.startswith("gpt-tiny"):
        tokens = 1_000_000_000
        index = ShardIndex(
            shards=(ShardInfo("unused.tar", 1000, 2 * tokens + 1000 * 1024, num_tokens=tokens),),
            tokenizer=BYTES_TOKENIZER,
        )
        model = ["task=causal_lm", "model.name=gpt-tiny", f"data.seq_len={seq_len}"]
        batch_size = GPT_BATCH_SIZE
    else:
        index = ShardIndex(
            shards=(ShardInfo("unused.tar", 1_000_000),),
            class_names=tuple(f"c{i}" for i in range(10)),
        )
        task = "image_classification" if kind == "resnet18" else f"{__name__}:FeatureMLP"
        model = [f"task={task}", "model.name=resnet18", "model.image_size=64"]
        batch_size = 32
    # Every rank of `bench mesh` writes this same file: atomically, so none reads half of it.
    write_atomic(work / "index.json", index_to_bytes(index), durable=False)
    return load_config(
        None,
        [
            f"run_dir={work / kind}",
            *model,
            f"data.train={work / 'index.json'}",
            f"data.batch_size={batch_size}",
            "data.workers_per_rank=0",
            "train.max_steps=1000000",
            "train.log_every=1000000",  # logging off
            "train.precision=fp32",
            "train.strategy=none",
            "train.lr=0.0001",
            "train.warmup_steps=10",
            "checkpoint.every_steps=0",  # checkpointing off
            "checkpoint.deadline_margin_s=0",
            "logging.progress=lines",
        ],
    )


class ReferenceLoop:
    """The hand-written loop a user would write: forward, backward, AdamW, cosine schedule."""

    def __init__(self, trainer: Any, seed: int, kind: str) -> None:
        torch.manual_seed(seed)
        self.loss = next_token_loss if kind.startswith("gpt-tiny") else trainer.task.loss
        self.model = trainer.task.build_model()
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        total = 1_000_000
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))),
        )

    def run(self, batches: Iterator[dict[str, Any]], steps: int) -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            batch = next(batches)
            self.optimizer.zero_grad(set_to_none=True)
            loss, _ = self.loss(self.model, batch)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
        return time.perf_counter() - start, time.process_time() - cpu_start


def next_token_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    """What a user writes for a GPT: cross-entropy of each position's next token."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()), {}


class TrainerLoop:
    """hpctrain's Trainer stepping as in `fit`: `train_step` then `step_boundary`."""

    def __init__(self, trainer: Any) -> None:
        from hpctrain.observe.metrics import MetricsWriter

        self.trainer = trainer
        self.metrics = MetricsWriter(
            trainer.run_dir, enabled=False, progress="lines", total_steps=0, tensorboard=False
        )
        trainer.model.train()

    def run(self, batches: Iterator[dict[str, Any]], steps: int) -> tuple[float, float]:
        trainer, metrics = self.trainer, self.metrics
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            trainer.train_step(batches)
            trainer.step_boundary(metrics)
        return time.perf_counter() - start, time.process_time() - cpu_start


def compare(kind: str, pairs: int, steps: int, work: Path, seq_len: int = 256) -> dict[str, Any]:
    """Median paired ratios Trainer/reference and reference/reference over `pairs` rounds."""
    from hpctrain.train.trainer import Trainer

    cfg = bench_config(kind, work, seq_len)
    trainer = Trainer(cfg, resolve_env({}), torch.device("cpu"))
    loops: dict[str, Any] = {
        "ref_a": ReferenceLoop(trainer, seed=0, kind=kind),
        "ref_b": ReferenceLoop(trainer, seed=0, kind=kind),
        "trainer": TrainerLoop(trainer),
    }
    streams = {
        name: itertools.cycle(make_batches(kind, 4, cfg.data.batch_size, seq_len)) for name in loops
    }
    for name, loop in loops.items():  # warm-up: allocator, autograd graph, lazy inits
        loop.run(streams[name], max(1, steps // 4))
    wall: dict[str, list[float]] = {name: [] for name in loops}
    cpu: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for i in range(pairs):
        order = names[i % 3 :] + names[: i % 3]  # rotate so no loop always runs first
        for name in order:
            seconds, cpu_seconds = loops[name].run(streams[name], steps)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    result: dict[str, Any] = {"model": kind, "pairs": pairs, "steps_per_segment": steps}
    # CPU time of this process is the primary figure: on a shared machine, wall-clock time
    # also counts the moments other tenants held the core.
    for clock, times in (("cpu", cpu), ("wall", wall)):
        ratios = [t / a for t, a in zip(times["trainer"], times["ref_a"], strict=True)]
        aa = [b / a for b, a in zip(times["ref_b"], times["ref_a"], strict=True)]
        overhead = [
            (t - a) / steps * 1000 for t, a in zip(times["trainer"], times["ref_a"], strict=True)
        ]
        result[clock] = {
            "reference_step_ms": statistics.median(times["ref_a"]) / steps * 1000,
            "trainer_step_ms": statistics.median(times["trainer"]) / steps * 1000,
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "aa_ratio": statistics.median(aa),
            "aa_min": min(aa),
            "aa_max": max(aa),
            "overhead_ms": statistics.median(overhead),
            "noisy": abs(statistics.median(aa) - 1.0) > NOISE_LIMIT,
        }
    return result


def demo_shards(path: str, work: Path) -> Path | None:
    """`path` if it holds train/ and val/ shards, else a small demo set made in `work`."""
    if (Path(path) / "train" / "index.json").exists():
        return Path(path)
    tool = REPO / "tools" / "make_demo_data.py"
    if not tool.exists():
        return None
    images, shards = work / "demo-images", work / "demo-shards"
    subprocess.run(
        [sys.executable, str(tool), str(images), "--num-images", "1500", "--size", "64"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *(sys.executable, "-m", "hpctrain", "convert", str(images), str(shards)),
            *("--val-fraction", "0.1", "--samples-per-shard", "128", "--shuffle"),
        ],
        check=True,
        capture_output=True,
    )
    return shards


def data_wait(shards: Path, steps: int, work: Path) -> dict[str, Any]:
    """The demo config with 2 loader workers: data-wait fraction per logged interval."""
    from hpctrain.train.trainer import Trainer

    cfg = load_config(
        str(REPO / "configs" / "demo.yaml"),
        [
            f"run_dir={work / 'demo-run'}",
            f"data.train={shards / 'train' / 'index.json'}",
            # What this measurement depends on, stated rather than inherited from the demo:
            # no evaluation, so nothing to rank checkpoints by, and no checkpoint at all.
            "data.val=",
            "checkpoint.monitor=",
            "checkpoint.keep_best=0",
            "checkpoint.every_steps=0",
            "checkpoint.final=false",
            "data.workers_per_rank=2",
            f"train.max_steps={steps}",
            "train.log_every=10",
            "logging.progress=lines",
        ],
    )
    trainer = Trainer(cfg, resolve_env({}), torch.device("cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit()
    records = [
        json.loads(line)
        for line in (work / "demo-run" / "metrics.jsonl").read_text().splitlines()
        if '"kind": "train"' in line
    ]
    steady = records[1:] or records  # the first interval includes worker start-up
    return {
        "steps": steps,
        "workers_per_rank": 2,
        "batch_size": cfg.data.batch_size,
        "image_size": cfg.model.image_size,
        "first_interval": records[0]["data_wait_fraction"],
        "data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in steady),
        "step_time_ms": statistics.median(r["step_time_s"] for r in steady) * 1000,
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
    }


def format_results(results: dict[str, Any]) -> str:
    """Two lines per model and clock: the ratios, then the step times they come from.

    A ratio is a median of paired ratios and the overhead a median of paired differences, so
    neither is computed from the two median step times printed beside them.
    """
    lines = []
    for result in results["compare"]:
        model, pairs, steps = result["model"], result["pairs"], result["steps_per_segment"]
        for clock in ("cpu", "wall"):
            r = result[clock]
            verdict = "TOO NOISY (A/A outside 1.00 ± 0.03)" if r["noisy"] else "ok"
            lines.append(
                f"{model} {clock} time: Trainer / reference loop = {r['ratio']:.3f} "
                f"(median of {pairs} paired segments, {r['ratio_min']:.3f}..{r['ratio_max']:.3f}; "
                f"above 1: the Trainer is slower); A/A control, reference B / reference A "
                f"= {r['aa_ratio']:.3f} ({r['aa_min']:.3f}..{r['aa_max']:.3f}) [{verdict}]"
            )
            lines.append(
                f"{model} {clock} time per step: reference loop {r['reference_step_ms']:.3f} ms, "
                f"Trainer {r['trainer_step_ms']:.3f} ms (medians); Trainer overhead, Trainer - "
                f"reference loop = {r['overhead_ms']:.3f} ms/step (median of {pairs} paired "
                f"segments of {steps} steps)"
            )
    d = results.get("data_wait")
    if d:
        lines.append(
            f"demo data wait (2 workers, batch {d['batch_size']}, {d['image_size']} px): "
            f"data wait / step time = {d['data_wait_fraction']:.1%} "
            f"(first interval {d['first_interval']:.1%}); step {d['step_time_ms']:.1f} ms, "
            f"{d['samples_per_s']:.0f} samples/s"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import logging

    # the trainers' INFO lines would drown the comparison; both put back for whoever runs next
    # in this process (a test session, `bench quick`)
    logger = logging.getLogger("hpctrain")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.WARNING)
    try:
        return _run(args)
    finally:
        logger.setLevel(level)
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"threads": 1, "torch": torch.__version__, "compare": []}
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-trainer-") as tmp:
        work = Path(tmp)
        if args.task == "causal_lm":
            cases = [
                ("gpt-tiny", args.gpt_pairs, args.gpt_steps),
                (GPT_DOCS, args.gpt_pairs, args.gpt_steps),
            ]
        else:
            cases = [
                ("mlp", args.mlp_pairs, args.mlp_steps),
                ("resnet18", args.pairs, args.resnet_steps),
            ]
        for kind, pairs, steps in cases:
            if pairs:  # 0 pairs: that comparison is skipped (`make bench-quick`'s data-wait case)
                results["compare"].append(compare(kind, pairs, steps, work, args.seq_len))
        if args.demo_steps and args.task == "image_classification":
            torch.set_num_threads(threads)
            shards = demo_shards(args.demo_shards, work)
            if shards is None:
                print(
                    "demo data wait: skipped (no data/demo/shards and no tools/)", file=sys.stderr
                )
            else:
                results["data_wait"] = data_wait(shards, args.demo_steps, work)
                results["data_wait"]["shards"] = str(shards)
    results["cpu_count"] = os.cpu_count()
    print(json.dumps(results, indent=2) if args.json else format_results(results))
    return 0
