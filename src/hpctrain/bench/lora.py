"""`hpctrain bench lora`: a LoRA fine-tune against the full fine-tune of the same model.

A random Llama-shaped folder at a GPT preset's widths (`gpt-125m` by default, vocabulary
32,000) and random token shards are written into a temporary folder; then the Trainer runs
the same steps (`model.init_from` the folder, `data.seq_len` 512, AdamW, fp32 on a CPU, bf16
on a GPU) once per kind, each in a fresh process, kinds interleaved when `--pairs` > 1:

- `full`: every parameter trains (`model.lora.rank` 0);
- `lora`: adapters of `--rank` on the attention and MLP projections, the base frozen;
- `qlora` (`--qlora`): the same with the adapted layers' base in NF4.

Per run: the peak memory of the process above what it held before the Trainer was built
(host: the resident set's high-water mark, reset through `/proc/self/clear_refs`; CUDA:
`torch.cuda.max_memory_allocated`), the median step time after `--warmup` steps (wall, and
on a CPU the process's CPU time, which the ratio uses: wall time follows other tenants), the
trainable fraction of the parameters and the bytes of the final checkpoint. Reported against
issue 40's goals: memory <= 0.5x the full fine-tune's, step time <= 0.8x, trainable <= 1 %,
checkpoint <= 5 %.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "LoRA (and QLoRA) fine-tune vs the full fine-tune: peak memory, step time, sizes"
GOALS = {"memory": 0.5, "step_time": 0.8, "trainable": 0.01, "checkpoint": 0.05}
VOCAB = 32000  # Llama 2's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="gpt-125m", help="GPT preset whose shape to use")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--pairs", type=int, default=1, help="runs of each kind, interleaved")
    parser.add_argument("--qlora", action="store_true", help="also the NF4 base (torchao)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    parser.add_argument("--work", default="", help="folder for the model (default: a temp one)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    kinds = ["full", "lora", *(["qlora"] if args.qlora else [])]
    with tempfile.TemporaryDirectory(dir=args.work or None, prefix="bench-lora-") as work:
        result = compare(Path(work), args, kinds)
    print(json.dumps(result, indent=2) if args.json else format_results(result))
    return 0


def compare(work: Path, args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    """Write the model and the data into `work`, run every kind `args.pairs` times."""
    from hpctrain.bench.gpu_lm import write_token_shards
    from hpctrain.bench.weights_import import write_folder
    from hpctrain.models.gpt import gpt_config, num_params

    cfg = gpt_config(args.preset, args.vocab)
    import torch

    write_folder(work / "model", cfg, torch.float32)
    tokens = (args.steps + args.warmup) * args.batch_size * (args.seq_len + 1) * 2
    index = write_token_shards(work / "data", tokens, args.vocab, num_shards=1)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for pair in range(args.pairs):
        for kind in kinds:
            spec = {
                "kind": kind,
                "folder": str(work / "model"),
                "index": str(index),
                "run_dir": str(work / f"run-{kind}-{pair}"),
                "rank": args.rank,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "warmup": args.warmup,
                "device": args.device,
            }
            runs[kind].append(run_process(spec))
    summary = {kind: summarize(results) for kind, results in runs.items()}
    full = summary["full"]
    step_key = "step_seconds" if args.device == "cuda" else "step_cpu_seconds"
    ratios = {
        kind: {
            "memory": s["peak_bytes"] / full["peak_bytes"],
            # on a shared CPU the process's CPU time per step (all its threads): wall time
            # follows the other tenants' load, CPU time much less (notes/environment.md)
            "step_time": s[step_key] / full[step_key],
            "trainable": s["trainable_fraction"],
            "checkpoint": s["checkpoint_bytes"] / full["checkpoint_bytes"],
        }
        for kind, s in summary.items()
        if kind != "full"
    }
    return {
        "preset": args.preset,
        "num_params": num_params(cfg),
        "vocab_size": args.vocab,
        "rank": args.rank,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "device": args.device,
        "pairs": args.pairs,
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "goals": GOALS,
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one kind's runs."""
    return {
        "peak_bytes": statistics.median(r["peak_bytes"] for r in results),
        "step_seconds": statistics.median(r["step_seconds"] for r in results),
        "step_cpu_seconds": statistics.median(r["step_cpu_seconds"] for r in results),
        "trainable_fraction": results[0]["trainable_fraction"],
        "checkpoint_bytes": results[0]["checkpoint_bytes"],
    }


def run_process(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of `measure_main` in a fresh process (its own memory high-water mark)."""
    code = "from hpctrain.bench.lora import measure_main; measure_main()"
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"bench lora: the {spec['kind']} run failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def overrides(spec: dict[str, Any]) -> list[str]:
    kind = spec["kind"]
    gpu = spec["device"] == "cuda"
    extra = []
    if kind != "full":
        extra = [f"model.lora.rank={spec['rank']}", f"model.lora.alpha={2 * spec['rank']}"]
        if gpu:
            extra.append("model.lora.base_dtype=bf16")  # the base in the compute dtype
    if kind == "qlora":
        extra.append("model.lora.quantize_base=nf4")
    return [
        f"run_dir={spec['run_dir']}",
        "task=causal_lm",
        f"model.init_from={spec['folder']}",
        f"data.train={spec['index']}",
        "data.val=",
        f"data.seq_len={spec['seq_len']}",
        f"data.batch_size={spec['batch_size']}",
        "data.workers_per_rank=0",
        "data.shuffle_buffer=0",
        f"train.max_steps={spec['steps'] + spec['warmup']}",
        "train.strategy=none",
        f"train.precision={'bf16' if gpu else 'fp32'}",
        "train.optimizer=adamw",
        "train.lr=0.0001",
        "train.log_every=1000",
        "checkpoint.every_steps=0",  # the run saves once, at its end
        "logging.progress=lines",
        *extra,
    ]


def measure_main() -> None:
    """One run: `SPEC_JSON`; prints its figures as JSON (see the module doc)."""
    spec = json.loads(sys.argv[1])
    import torch

    from hpctrain.bench.weights_import import resident_bytes
    from hpctrain.config import load_config
    from hpctrain.distributed import resolve_env
    from hpctrain.train.trainer import Trainer

    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    cfg = load_config(None, overrides(spec))
    with contextlib.suppress(OSError):  # elsewhere the lifetime peak: an upper bound
        Path("/proc/self/clear_refs").write_text("5")
    before = resident_bytes("VmRSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, resolve_env({}), device)
    times: list[float] = []
    cpu_times: list[float] = []
    step = trainer.train_step

    def timed(batches: Any) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        step(batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)

    trainer.train_step = timed  # type: ignore[method-assign]
    with contextlib.redirect_stdout(io.StringIO()):  # the run's summary; the figures follow
        assert trainer.fit() == 0
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resident_bytes("VmHWM") - before
    )
    params = list(trainer.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    folder = Path(cfg.checkpoint_root()) / f"step-{trainer.state.step}"
    result = {
        "peak_bytes": peak,
        "step_seconds": statistics.median(times[spec["warmup"] :]),
        "step_cpu_seconds": statistics.median(cpu_times[spec["warmup"] :]),
        "trainable_fraction": trainable / sum(p.numel() for p in params),
        "checkpoint_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
    }
    print(json.dumps(result), flush=True)


def format_results(result: dict[str, Any]) -> str:
    gb = 1e9
    where = "GPU memory (max allocated)" if result["device"] == "cuda" else "host memory (RSS)"
    lines = [
        f"LoRA rank {result['rank']} vs full fine-tune of a {result['preset']}-shaped Llama "
        f"({result['num_params'] / 1e6:.0f}M parameters, vocabulary {result['vocab_size']:,}), "
        f"seq {result['seq_len']} x {result['batch_size']}, {result['device']}, "
        f"medians of {result['pairs']} run(s) each:",
        f"{'kind':6} {'peak ' + where:>34} {'step':>9} {'CPU s':>9} {'trainable':>10} "
        f"{'checkpoint':>11}",
    ]
    for kind, s in result["summary"].items():
        lines.append(
            f"{kind:6} {s['peak_bytes'] / gb:>31.2f} GB {s['step_seconds']:>7.2f} s "
            f"{s.get('step_cpu_seconds', 0.0):>7.2f} s {s['trainable_fraction']:>10.3%} "
            f"{s['checkpoint_bytes'] / 1e6:>8.1f} MB"
        )
    for kind, ratios in result["ratios"].items():
        parts = []
        for key, value in ratios.items():
            goal = result["goals"][key]
            verdict = "met" if value <= goal else "missed"
            shown = f"{value:.3%}" if key == "trainable" else f"{value:.2f}x"
            parts.append(
                f"{key} {shown} (goal <= {goal:g}{'' if key == 'trainable' else 'x'}: {verdict})"
            )
        lines.append(f"{kind} / full: " + "; ".join(parts))
    return "\n".join(lines)
