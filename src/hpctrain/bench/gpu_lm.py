"""`hpctrain bench gpu-lm` (or `gpu`): the LLM case of the GPU benchmark (tokens/s, MFU, memory, data wait).

The largest GPT preset whose training state fits the GPUs of this node (or the one named by
`--preset`) trains for `--steps` steps on token shards of random ids written to local disk,
read by hpctrain's own loader with `data.seq_len` packing: bf16, FSDP2 (one process per GPU;
a single process is never wrapped, as everywhere in hpctrain), `torch.compile` per block and
activation checkpointing when the memory estimate needs it. The report takes the steady
intervals of `metrics.jsonl` (the first ones hold compilation and loader start-up) and prints
tokens/s, the data-wait fraction, peak memory and MFU: tokens/s per GPU x the model's training
FLOPs per token (`flops_per_token` of `hpctrain.models.gpt`: 6 x parameters plus the
attention term) / the GPU's published dense bf16 peak (`hpctrain.models.flops.PEAK_FLOPS`).

Everything but the GPU runs on a CPU too (`--device cpu --preset gpt-tiny --steps 2`: fp32,
no compile), which is how the tests exercise it; `tools/gpu_bench.sh` runs it after the
ResNet-50 case on a GPU node.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.bench.gpu_report import (
    peak_tflops,
    report_lines,
    steady_report,
    train_records,
    usable_cpus,
)
from hpctrain.convert.tar import ShardTarWriter
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.data.tokens import encode_tokens, token_field
from hpctrain.errors import UsageError

HELP = "LLM training on this node's GPUs: tokens/s, MFU, peak memory, data wait"
DRY_RUN_GPU = "dry run (a pretend H200)"
# Headroom left by the memory estimate: the caching allocator's fragmentation, CUDA context,
# NCCL buffers and compile workspaces.
MEMORY_FRACTION = 0.8
DOCUMENT_TOKENS = 4096  # ids per synthetic document (a sample), end-of-document id included


@dataclass(frozen=True)
class PresetShape:
    """What the memory estimate needs to know about a GPT preset."""

    name: str
    num_parameters: int
    num_layers: int
    dim: int
    hidden_dim: int  # SwiGLU
    vocab_size: int


@dataclass(frozen=True)
class LMPlan:
    """What the LLM case runs on this node."""

    device: str  # cuda | cpu
    num_gpus: int
    gpu_name: str
    preset: str
    num_parameters: int
    vocab_size: int
    precision: str
    strategy: str  # fsdp or hsdp (--strategy) with several GPUs; none in a single process
    compile: bool
    activation_checkpointing: bool
    batch_size: int  # sequences per GPU
    seq_len: int
    workers_per_rank: int
    estimated_memory_gib: float
    memory_gib: float
    peak_tflops: float | None
    tp_degree: int = 1  # --tp-degree: tensor parallelism inside the node


def estimate_memory_gib(
    shape: PresetShape,
    *,
    batch_size: int,
    seq_len: int,
    num_ranks: int,
    activation_checkpointing: bool,
) -> float:
    """Training memory per GPU in GiB, bf16 with fp32 master weights and AdamW.

    State: fp32 weights, gradients and the two AdamW moments (16 bytes per parameter),
    divided over the ranks by FSDP2, plus the bf16 copies of the weights (all of them under
    autocast in one process; two blocks gathered at a time under FSDP2). Activations a block
    saves for its backward, per token: 40 bytes per model dimension and 8 per SwiGLU hidden
    unit. That is above Korthikanti et al. 2022's 34 per dimension for a GPT-3 block in
    half precision, as this GPT computes its RMSNorms and rotary embeddings in fp32; measured
    with `torch.autograd.graph.saved_tensors_hooks` under CPU bf16 autocast (the bf16 weight
    copies taken out): 57 bytes per dimension at dim 256 / hidden 704, 56 at 512 / 1536, where
    the formula gives 62 and 64. Attention scores are never stored (flash attention). With
    checkpointing only each block's fp32 input is kept, and one block is recomputed at a
    time. Logits: bf16, their fp32 copy for the loss and its gradient (10 bytes per token and
    vocabulary entry).
    """
    params = shape.num_parameters
    state = 16 * params / num_ranks
    state += 2 * params if num_ranks == 1 else 2 * 2 * params / shape.num_layers
    tokens = batch_size * seq_len
    per_block = tokens * (40 * shape.dim + 8 * shape.hidden_dim)
    if activation_checkpointing:
        activations = 4 * tokens * shape.dim * shape.num_layers + per_block
    else:
        activations = per_block * shape.num_layers
    logits = 10 * tokens * shape.vocab_size
    return (state + activations + logits) / 2**30


def choose_preset(
    shapes: list[PresetShape],
    memory_gib: float,
    *,
    batch_size: int,
    seq_len: int,
    num_ranks: int,
    preset: str = "auto",
) -> tuple[PresetShape, bool, float]:
    """The preset to run, whether it needs activation checkpointing, and its estimate (GiB).

    `auto`: the largest preset (by parameters) whose estimate fits `MEMORY_FRACTION` of the
    memory, without checkpointing when that fits (recomputation costs a third more FLOPs than
    MFU counts). A named preset gets checkpointing only when it needs it.

    Raises:
        ValueError: an unknown preset name, or none that fits.
    """
    budget = MEMORY_FRACTION * memory_gib
    by_name = {s.name: s for s in shapes}
    if preset != "auto" and preset not in by_name:
        raise ValueError(f"--preset {preset}: not a GPT preset ({', '.join(by_name)})")
    candidates = (
        [by_name[preset]] if preset != "auto" else sorted(shapes, key=lambda s: s.num_parameters)
    )
    chosen: tuple[PresetShape, bool, float] | None = None
    for shape in candidates:
        for checkpointing in (False, True):
            estimate = estimate_memory_gib(
                shape,
                batch_size=batch_size,
                seq_len=seq_len,
                num_ranks=num_ranks,
                activation_checkpointing=checkpointing,
            )
            if estimate <= budget:
                chosen = (shape, checkpointing, estimate)
                break
    if chosen is None:
        raise ValueError(
            f"no GPT preset ({', '.join(s.name for s in candidates)}) fits {budget:.0f} GiB "
            f"per GPU with {batch_size} x {seq_len} tokens on {num_ranks} GPU(s)"
        )
    return chosen


def preset_shapes(vocab_size: int) -> list[PresetShape]:
    """Every GPT preset with its parameter count for `vocab_size`."""
    from hpctrain.models import gpt

    shapes = []
    for name in gpt.PRESETS:
        config = gpt.gpt_config(name, vocab_size)
        shapes.append(
            PresetShape(
                name=name,
                num_parameters=gpt.num_params(config),
                num_layers=config.n_layers,
                dim=config.dim,
                hidden_dim=config.hidden_dim,
                vocab_size=vocab_size,
            )
        )
    return shapes


def make_lm_plan(args: argparse.Namespace) -> LMPlan:
    """The plan for `--device` (cuda: every visible GPU; cpu: one process, fp32, no compile)."""
    import torch

    cpus = usable_cpus()
    shapes = preset_shapes(args.vocab_size)
    if args.device == "cuda" and not torch.cuda.is_available() and args.dry_run:
        # The plan of the machine the GPU script is sized for: one H200.
        num_gpus, gpu_name, memory_gib = 1, DRY_RUN_GPU, 139.8
        precision, compile_blocks = "bf16", not args.no_compile
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU visible (--device cpu runs on the CPU)")
        props = torch.cuda.get_device_properties(0)
        num_gpus, gpu_name, memory = torch.cuda.device_count(), props.name, props.total_memory
        memory_gib = memory / 2**30
        precision = "bf16" if props.major >= 8 else "fp16"
        compile_blocks = not args.no_compile
    else:
        num_gpus, gpu_name = 0, "cpu"
        memory_gib = physical_memory_gib()
        precision, compile_blocks = "fp32", False  # bf16 is ~40x slower on CPUs without AMX
    ranks = max(1, num_gpus)
    try:
        shape, checkpointing, estimate = choose_preset(
            shapes,
            memory_gib,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            num_ranks=ranks,
            preset=args.preset,
        )
    except ValueError as exc:  # an unknown preset, or none that fits
        raise UsageError(str(exc)) from None
    return LMPlan(
        device=args.device,
        num_gpus=num_gpus,
        gpu_name=gpu_name,
        preset=shape.name,
        num_parameters=shape.num_parameters,
        vocab_size=args.vocab_size,
        precision=precision,
        strategy=args.strategy if ranks > 1 else "none",
        compile=compile_blocks,
        activation_checkpointing=checkpointing or args.activation_checkpointing,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        workers_per_rank=(
            args.workers if args.workers is not None else max(1, min(8, cpus // ranks - 1))
        ),
        estimated_memory_gib=estimate,
        memory_gib=memory_gib,
        peak_tflops=peak_tflops(gpu_name) if num_gpus else None,
        tp_degree=args.tp_degree if ranks > 1 else 1,
    )


def physical_memory_gib() -> float:
    """Physical memory of this machine in GiB (the CPU run's budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def write_token_shards(
    out: Path, num_tokens: int, vocab_size: int, num_shards: int, seed: int = 0
) -> Path:
    """Token shards of uniformly random ids (documents of `DOCUMENT_TOKENS`); the index path.

    The tokenizer named in the index is `random-<vocab_size>`: the ids carry no text, and
    throughput does not depend on what they say.
    """
    rng = np.random.default_rng(seed)
    eod_id = vocab_size - 1
    field = token_field(vocab_size)
    documents = max(num_shards, math.ceil(num_tokens / DOCUMENT_TOKENS))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    infos = []
    for shard in range(num_shards):
        count = documents // num_shards + (1 if shard < documents % num_shards else 0)
        name = f"tokens-{shard:06d}.tar"
        with (out / name).open("wb") as f:
            writer = ShardTarWriter(f)
            for doc in range(count):
                ids = rng.integers(0, eod_id, DOCUMENT_TOKENS, dtype=np.int64)
                ids[-1] = eod_id
                writer.add(f"{shard:06d}-{doc:06d}.{field}", encode_tokens(ids, field))
            sha256 = writer.finish()
        infos.append(
            ShardInfo(
                name, count, writer.num_bytes, sha256=sha256, num_tokens=count * DOCUMENT_TOKENS
            )
        )
    tokenizer = {
        "name": f"random-{vocab_size}",
        "vocab_size": vocab_size,
        "eod_id": eod_id,
        "sha256": "",
    }
    index = out / "index.json"
    index.write_bytes(index_to_bytes(ShardIndex(shards=tuple(infos), tokenizer=tokenizer)))
    return index


def config_overrides(plan: LMPlan, index: Path, run_dir: Path, steps: int) -> list[str]:
    """The run: `causal_lm` on the plan's preset, evaluation and checkpoints off."""
    on = {True: "true", False: "false"}
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"model.name={plan.preset}",
        f"data.train={index}",
        "data.val=",
        f"data.seq_len={plan.seq_len}",
        f"data.batch_size={plan.batch_size}",
        f"data.workers_per_rank={plan.workers_per_rank}",
        "data.shuffle_buffer=64",
        "data.prefetch_factor=4",
        f"train.max_steps={steps}",
        "train.max_epochs=0",
        f"train.strategy={plan.strategy if plan.strategy in ('fsdp', 'hsdp') else 'ddp'}",
        f"train.tp_degree={plan.tp_degree}",
        f"train.precision={plan.precision}",
        f"train.compile={on[plan.compile]}",
        f"train.activation_checkpointing={on[plan.activation_checkpointing]}",
        "train.optimizer=adamw",
        "train.lr=0.0003",
        "train.warmup_steps=10",
        "train.grad_clip=1.0",
        "train.log_every=10" if steps >= 30 else "train.log_every=1",
        "train.eval_every=0",
        # Nothing saved: a final save of gpt-1b's state is ~16 GB of a small disk (of the
        # largest preset that fits one H200, ~35 GB).
        "checkpoint.every_steps=0",
        "checkpoint.final=false",
        "logging.progress=lines",
    ]


def train(plan: LMPlan, overrides: list[str], work: Path) -> None:
    """Run the training: in this process for one rank, `hpctrain train --nproc N` for more."""
    from hpctrain.config import config_to_yaml, load_config

    cfg = load_config(None, overrides)
    config = work / "config.yaml"
    config.write_text(config_to_yaml(cfg))
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    if plan.num_gpus > 1:
        command = [sys.executable, "-m", "hpctrain", "train", str(config)]
        subprocess.run([*command, "--nproc", str(plan.num_gpus), "--resume", "none"], check=True)
        return
    import torch

    from hpctrain.distributed import resolve_env
    from hpctrain.train.trainer import Trainer

    device = torch.device("cuda", 0) if plan.device == "cuda" else torch.device("cpu")
    trainer = Trainer(cfg, resolve_env({}), device)
    with contextlib.redirect_stdout(io.StringIO()):  # the summary; the report follows
        trainer.fit()


def dry_run(plan: LMPlan, overrides: list[str]) -> int:
    """Build the run's Trainer as it will start, on the CPU (`hpctrain.train.dry_run`)."""
    import torch

    from hpctrain.config import load_config
    from hpctrain.errors import HpctrainError
    from hpctrain.parallel.precision import device_facts
    from hpctrain.train.dry_run import check_startup, pretend_gpu

    cfg = load_config(None, overrides)
    if plan.device == "cpu":
        facts = device_facts(torch.device("cpu"))
    elif plan.gpu_name == DRY_RUN_GPU:
        facts = pretend_gpu(DRY_RUN_GPU, capability=90)
    else:
        facts = device_facts(torch.device("cuda", 0), compile=cfg.train.compile)
    try:
        report = check_startup(cfg, facts, world_size=max(1, plan.num_gpus))
    except HpctrainError as exc:
        print(f"lm {plan.preset} FAILED: {exc}", flush=True)
        return 1
    print(f"lm {plan.preset} config valid: {report.describe()}", flush=True)
    return 0


def train_flops_per_token(plan: LMPlan) -> float:
    """Training FLOPs per token of the plan's preset (forward + backward, no recomputation)."""
    from hpctrain.models import gpt

    return float(gpt.flops_per_token(gpt.gpt_config(plan.preset, plan.vocab_size), plan.seq_len))


def report(run_dir: Path, plan: LMPlan, flops_per_token: float) -> dict[str, Any]:
    """Steady-state figures of `run_dir/metrics.jsonl` (the first two intervals are warm-up)."""
    records = train_records(run_dir)
    return steady_report(
        records,
        plan,
        unit="token",
        # The trainer's tokens/s (all ranks); a sample is one sequence of seq_len trained tokens.
        rate=lambda r: r.get("tokens_per_s", r["samples_per_s"] * plan.seq_len),
        flops_per_unit=flops_per_token,
        extra={"final_loss": records[-1]["loss"]},
    )


def format_report(r: dict[str, Any]) -> str:
    plan = r["plan"]
    where = (
        f"{plan['num_gpus']} x {plan['gpu_name']}" if plan["num_gpus"] else "CPU (no GPU: no MFU)"
    )
    features = [plan["precision"], f"strategy {plan['strategy']}"]
    features += ["compile"] if plan["compile"] else []
    features += ["activation checkpointing"] if plan["activation_checkpointing"] else []
    header = (
        f"gpu_bench lm: {plan['preset']} ({plan['num_parameters'] / 1e9:.2f} B parameters, "
        f"vocabulary {plan['vocab_size']}), {', '.join(features)} on {where}, "
        f"{plan['batch_size']} x {plan['seq_len']} tokens per GPU, "
        f"{plan['workers_per_rank']} loader workers per GPU"
    )
    lines = report_lines(
        r,
        unit="token",
        memory=(
            f"{r['peak_memory_mb'] / 1024:.1f} GiB (rank 0; estimate "
            f"{plan['estimated_memory_gib']:.1f} of {plan['memory_gib']:.0f} GiB)"
        ),
        no_mfu="n/a (CPU, or a GPU the peak table does not know: set HPCTRAIN_PEAK_TFLOPS)",
        step_extra=f", final loss {r['final_loss']:.3f}",
        gflops_format=".2f",
    )
    return "\n".join([header, *lines])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="auto", help="GPT preset, or auto: the largest that fits the GPUs"
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per GPU")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument(
        "--vocab-size", type=int, default=32768, help="vocabulary of the random token ids"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="loader workers per GPU (default: the node's CPUs per GPU - 1, at most 8)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--strategy",
        choices=("fsdp", "hsdp"),
        default="fsdp",
        help="with several GPUs: flat FSDP2 or HSDP (shards inside the node)",
    )
    parser.add_argument(
        "--tp-degree", type=int, default=1, help="tensor parallelism over this many GPUs"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="even when it is not needed"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="write the shards and the config, build the Trainer on the CPU, do not train "
        "(without a GPU: the plan of one H200)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/hpctrain-gpu-bench-lm"),
        help="work folder on local disk (shards, run folder, report.json)",
    )


def run(args: argparse.Namespace) -> int:
    plan = make_lm_plan(args)
    ranks = max(1, plan.num_gpus)
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"plan: {json.dumps(asdict(plan))}", flush=True)
    # Every rank reads more than it trains: no epoch boundary inside the measured steps.
    tokens = 2 * args.steps * ranks * plan.batch_size * (plan.seq_len + 1)
    num_shards = 4 * ranks * max(1, plan.workers_per_rank)
    index = write_token_shards(args.work / "shards", tokens, plan.vocab_size, num_shards)
    run_dir = args.work / "run"
    overrides = config_overrides(plan, index, run_dir, args.steps)
    if args.dry_run:
        return dry_run(plan, overrides)
    train(plan, overrides, args.work)
    result = report(run_dir, plan, train_flops_per_token(plan))
    (args.work / "report.json").write_text(json.dumps(result, indent=2))
    print(format_report(result))
    print(f"report: {args.work / 'report.json'}")
    return 0
