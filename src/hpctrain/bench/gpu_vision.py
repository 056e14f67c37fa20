"""The vision case of the GPU benchmark, the Python half of `tools/gpu_bench.sh`: plan, data,
config, the precision matrix's GPU cells, and the ResNet-50 report.

The shell script is the entry point on a GPU node (a Jean Zay node inside a job, or a single
H200 machine); this module holds the parts that can be tested on a CPU:

    python -m hpctrain.bench.gpu_vision plan --num-gpus N          # workers, batch, precision
    python -m hpctrain.bench.gpu_vision data DIR --num-images N --size PX
    python -m hpctrain.bench.gpu_vision config DIR ...             # DIR/config.yaml
    python -m hpctrain.bench.gpu_vision smoke DIR [--dry-run]      # the matrix's GPU cells
    python -m hpctrain.bench.gpu_vision report RUN_DIR --num-gpus N ...

The smoke pass runs the GPU cells of the precision matrix (tests/parallel/test_matrix.py runs
the CPU ones): ddp/fsdp x bf16/fp16 on ResNet-50 and ViT-B/16 at 224 px, a few steps each on
all GPUs; each cell must train with finite losses, or be refused up front (exit 2) exactly when
`plan_training` says this GPU cannot do it (bf16 on a V100). On one GPU ddp and fsdp run
unwrapped (a single process is never wrapped): FSDP2 needs two GPUs or more.

MFU counts the model's FLOPs per trained image (forward measured with
`torch.utils.flop_counter` on the meta device, backward = 2 x forward) against the GPU's
published dense bf16 (fp16 on V100) tensor-core peak. The report is `gpu_report`'s, shared
with the LLM case (`gpu_lm`, `hpctrain bench gpu-lm`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hpctrain.bench.gpu_report import (
    peak_tflops,
    report_lines,
    steady_report,
    train_records,
    usable_cpus,
)

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Plan:
    """What the benchmark runs on this node."""

    num_gpus: int
    gpu_name: str
    precision: str  # bf16 on compute capability >= 8, fp16 before (V100)
    batch_size: int  # per GPU
    workers_per_rank: int
    cpus: int
    peak_tflops: float | None


def make_plan(
    num_gpus: int,
    gpu_name: str,
    capability_major: int,
    memory_gib: float,
    cpus: int,
    batch_size: int = 0,
    workers_per_rank: int = 0,
) -> Plan:
    """Loader workers: every CPU of the node but one per rank for its training process."""
    ranks = max(1, num_gpus)
    if not workers_per_rank:
        workers_per_rank = max(1, min(32, cpus // ranks - 1))
    if not batch_size:
        # ResNet-50 at 224 px in mixed precision needs about 0.1 GiB per image in training.
        batch_size = 256 if memory_gib >= 40 else 128 if memory_gib >= 24 else 64
    return Plan(
        num_gpus=num_gpus,
        gpu_name=gpu_name,
        precision="bf16" if capability_major >= 8 else "fp16",
        batch_size=batch_size,
        workers_per_rank=workers_per_rank,
        cpus=cpus,
        peak_tflops=peak_tflops(gpu_name),
    )


def detect_plan(batch_size: int = 0, workers_per_rank: int = 0) -> Plan:
    """The plan for the GPUs visible here (none: a dry-run plan for one pretend A100)."""
    import torch

    cpus = usable_cpus()
    if not torch.cuda.is_available():
        return make_plan(0, "none (dry run)", 8, 80, cpus, batch_size, workers_per_rank)
    props = torch.cuda.get_device_properties(0)
    return make_plan(
        torch.cuda.device_count(),
        props.name,
        props.major,
        props.total_memory / 2**30,
        cpus,
        batch_size,
        workers_per_rank,
    )


def make_data(out: Path, num_images: int, size: int, jobs: int, num_workers: int = 1) -> Path:
    """JPEG shards of generated images in `out/shards` (reused when the count matches).

    `jobs` generator processes each write a part with its own seed; the parts are merged
    into one class folder tree and converted with `jobs` writer processes. Shards are small
    enough that each of the node's `num_workers` loader workers gets about four.
    """
    shards = out / "shards"
    if (shards / "index.json").exists():
        index = json.loads((shards / "index.json").read_text())
        if sum(shard["num_samples"] for shard in index["shards"]) == num_images:
            return shards
        shutil.rmtree(shards)
    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    jobs = max(1, min(jobs, num_images))
    per_job = [num_images // jobs + (1 if i < num_images % jobs else 0) for i in range(jobs)]
    tool = REPO / "tools" / "make_demo_data.py"

    def generate(part: int) -> None:
        subprocess.run(
            [
                *(sys.executable, str(tool), str(out / f"part-{part}")),
                *("--num-images", str(per_job[part]), "--size", str(size), "--seed", str(part)),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(generate, range(jobs)))
    for part in range(jobs):
        part_dir = out / f"part-{part}"
        for class_dir in sorted(p for p in part_dir.iterdir() if p.is_dir()):
            target = images / class_dir.name
            target.mkdir(parents=True, exist_ok=True)
            for image in class_dir.iterdir():
                image.rename(target / f"p{part}-{image.name}")
        shutil.rmtree(part_dir)
    subprocess.run(
        [
            *(sys.executable, "-m", "hpctrain", "convert", str(images), str(shards)),
            *("--samples-per-shard", str(samples_per_shard(num_images, num_workers))),
            *("--shuffle", "--workers", str(jobs)),
            *("--progress", "plain", "--overwrite"),
        ],
        check=True,
    )
    shutil.rmtree(images)
    return shards


def batch_for_images(plan: Plan, num_images: int) -> tuple[Plan, str]:
    """The plan with a batch each GPU's share of `num_images` fills at least once per epoch,
    and a line saying so when it had to shrink ("": unchanged). `--dry-run --images 200` (the
    script's own example) then checks a startable run; a measurement wants many batches per
    epoch (the default --images), since epoch starts are not steady state."""
    ranks = max(1, plan.num_gpus)
    per_rank = num_images // ranks
    if per_rank >= plan.batch_size:
        return plan, ""
    batch = max(1, per_rank)
    note = (
        f"resnet50: --images {num_images} gives each of {ranks} GPU(s) {per_rank} images: "
        f"batch {plan.batch_size} -> {batch} per GPU (--images {plan.batch_size * ranks} or "
        "more keeps the planned batch)"
    )
    return replace(plan, batch_size=batch), note


def samples_per_shard(num_images: int, num_workers: int) -> int:
    """At least 4 shards per loader worker of the node, 16 to 256 samples each."""
    return max(16, min(256, num_images // (4 * max(1, num_workers))))


def config_overrides(
    plan: Plan, shards: Path, run_dir: Path, steps: int, compile: bool
) -> list[str]:
    """The benchmark run, on the default config: every key it depends on is stated here, so
    that a change of a shipped config (the demo's) cannot change or break it."""
    return [
        f"run_dir={run_dir}",
        "task=image_classification",
        "model.name=resnet50",
        "model.image_size=224",
        "model.channels_last=true",
        f"data.train={shards / 'index.json'}",
        "data.val=",
        f"data.batch_size={plan.batch_size}",
        f"data.workers_per_rank={plan.workers_per_rank}",
        "data.shuffle_buffer=1000",
        "data.prefetch_factor=4",
        "data.pin_memory=true",
        "data.persistent_workers=true",
        f"train.max_steps={steps}",
        "train.max_epochs=0",
        "train.strategy=ddp",
        f"train.precision={plan.precision}",
        "train.optimizer=sgd",
        "train.lr=0.1",
        "train.warmup_steps=0",
        "train.log_every=10",
        "train.eval_every=0",
        f"train.compile={'true' if compile else 'false'}",
        *NO_CHECKPOINTS,
        "logging.progress=lines",
    ]


# Nothing saved (a benchmark's weights are thrown away; the final save of a large model
# costs minutes and tens of GB of a small disk) and nothing ranked (no evaluation data).
NO_CHECKPOINTS = [
    "checkpoint.every_steps=0",
    "checkpoint.final=false",
    "checkpoint.monitor=",
    "checkpoint.keep_best=0",
]


def write_config(plan: Plan, shards: Path, work: Path, steps: int, compile: bool) -> Path:
    from hpctrain.config import config_to_yaml, load_config

    cfg = load_config(None, config_overrides(plan, shards, work / "run", steps, compile))
    path = work / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    return path


SMOKE_MODELS = ("resnet50", "vit_b_16")


@dataclass(frozen=True)
class SmokeCell:
    strategy: str
    precision: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.strategy}-{self.precision}-{self.model}"


SMOKE_CELLS = tuple(
    SmokeCell(strategy, precision, model)
    for model in SMOKE_MODELS
    for strategy in ("ddp", "fsdp")
    for precision in ("bf16", "fp16")
)


def smoke_overrides(cell: SmokeCell, shards: Path, run_dir: Path, steps: int) -> list[str]:
    """A few steps of one cell: 32 images per GPU, resume none, finite losses logged each step."""
    return [
        f"run_dir={run_dir}",
        "task=image_classification",
        f"model.name={cell.model}",
        "model.image_size=224",
        f"model.channels_last={'true' if cell.model.startswith('resnet') else 'false'}",
        f"data.train={shards / 'index.json'}",
        "data.val=",
        "data.batch_size=32",
        "data.workers_per_rank=2",
        "data.shuffle_buffer=64",
        f"train.max_steps={steps}",
        "train.max_epochs=0",
        f"train.strategy={cell.strategy}",
        f"train.precision={cell.precision}",
        "train.optimizer=sgd",
        "train.lr=0.01",
        "train.warmup_steps=0",
        "train.log_every=1",
        "train.eval_every=0",
        *NO_CHECKPOINTS,
        "logging.progress=lines",
    ]


def expected_refusal(cell: SmokeCell, num_gpus: int) -> str:
    """The one-line refusal `plan_training` gives this cell on GPU 0, or "" if it must train."""
    import torch

    from hpctrain.config import ConfigError, load_config
    from hpctrain.parallel.precision import device_facts, plan_training

    cfg = load_config(None, smoke_overrides(cell, Path("."), Path("."), 1))
    try:
        plan_training(cfg.train, device_facts(torch.device("cuda", 0)), max(1, num_gpus))
    except ConfigError as exc:
        return str(exc)
    return ""


def smoke_outcome(returncode: int, output: str, run_dir: Path, refusal: str) -> str:
    """`trained`, `refused` (as expected), or `FAILED: why` for one cell's run."""
    if refusal:
        if returncode == 2 and refusal in output:
            return "refused"
        return f"FAILED: exit {returncode}, expected the refusal {refusal!r}"
    if returncode != 0:
        return f"FAILED: exit {returncode}"
    metrics = run_dir / "metrics.jsonl"
    losses = [
        json.loads(line)["loss"]
        for line in (metrics.read_text().splitlines() if metrics.exists() else [])
        if '"kind": "train"' in line
    ]
    if not losses:
        return "FAILED: no loss logged"
    if not all(math.isfinite(x) for x in losses):
        return f"FAILED: losses {losses}"
    return "trained"


def run_smoke(work: Path, num_gpus: int, steps: int, dry_run: bool) -> int:
    """Train every smoke cell for `steps` steps on all GPUs; 1 if any cell failed.

    With `dry_run`, build each cell's Trainer as it will start, on the CPU (`dry_check`).
    """
    from hpctrain.config import config_to_yaml, load_config

    failed = 0
    for cell in SMOKE_CELLS:
        run_dir = work / "smoke" / cell.name
        cfg = load_config(None, smoke_overrides(cell, work / "shards", run_dir, steps))
        output = ""
        if dry_run:
            outcome = dry_check(cfg, num_gpus)
        elif num_gpus <= 1 and cell.strategy != "ddp":
            outcome = "skipped (one GPU: the same single process as the ddp cell)"
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
            refusal = expected_refusal(cell, num_gpus)
            config = work / "smoke" / f"{cell.name}.yaml"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(config_to_yaml(cfg))
            command = [sys.executable, "-m", "hpctrain", "train", str(config)]
            command += ["--nproc", str(max(1, num_gpus)), "--resume", "none"]
            proc = subprocess.run(command, capture_output=True, text=True)
            output = proc.stdout + proc.stderr
            outcome = smoke_outcome(proc.returncode, output, run_dir, refusal)
            if outcome == "refused":
                outcome += f" ({refusal})"
        failed += outcome.startswith("FAILED")
        print(f"smoke {cell.name:22s} {outcome}", flush=True)
        if outcome.startswith("FAILED") and output:
            print(output[-6000:], flush=True)
    return 1 if failed else 0


def dry_check(cfg: Any, num_gpus: int) -> str:
    """`config valid: ...` when `cfg`'s Trainer builds for this node's GPUs (a pretend A100
    without one), else `FAILED: why` (`hpctrain.train.dry_run`)."""
    from hpctrain.errors import HpctrainError
    from hpctrain.train.dry_run import check_startup, pretend_gpu

    facts = pretend_gpu()
    if num_gpus:
        import torch

        from hpctrain.parallel.precision import device_facts

        facts = device_facts(torch.device("cuda", 0), compile=cfg.train.compile)
    try:
        report = check_startup(cfg, facts, world_size=max(1, num_gpus))
    except HpctrainError as exc:
        return f"FAILED: {exc}"
    return f"config valid: {report.describe()}"


def train_flops_per_image(model_name: str = "resnet50", image_size: int = 224) -> float:
    """FLOPs of one training sample: forward counted on the meta device, backward = 2x."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = torchvision.models.get_model(model_name, weights=None, num_classes=1000)
        x = torch.empty(1, 3, image_size, image_size)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return 3.0 * counter.get_total_flops()


def report(
    run_dir: Path, plan: Plan, flops_per_image: float, skip_intervals: int = 2
) -> dict[str, Any]:
    """Steady-state figures from `run_dir/metrics.jsonl` (the first intervals are warm-up)."""
    return steady_report(
        train_records(run_dir),
        plan,
        unit="image",
        rate=lambda r: r["samples_per_s"],
        flops_per_unit=flops_per_image,
        skip_intervals=skip_intervals,
    )


def format_report(r: dict[str, Any]) -> str:
    plan = r["plan"]
    header = (
        f"gpu_bench: ResNet-50 224 px, {plan['precision']}, channels_last, DDP on "
        f"{plan['num_gpus']} x {plan['gpu_name']}, batch {plan['batch_size']}/GPU, "
        f"{plan['workers_per_rank']} loader workers/GPU ({plan['cpus']} CPUs)"
    )
    lines = report_lines(
        r,
        unit="image",
        memory=f"{r['peak_memory_mb'] / 1024:.1f} GiB (rank 0, allocated)",
        no_mfu="n/a (unknown GPU: set HPCTRAIN_PEAK_TFLOPS)",
    )
    return "\n".join([header, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.bench.gpu_vision")
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan")
    p_data = sub.add_parser("data")
    p_data.add_argument("work", type=Path)
    p_data.add_argument("--num-images", type=int, required=True)
    p_data.add_argument("--size", type=int, default=320)
    p_config = sub.add_parser("config")
    p_config.add_argument("work", type=Path)
    p_config.add_argument("--steps", type=int, default=300)
    p_config.add_argument("--compile", action="store_true")
    p_report = sub.add_parser("report")
    p_report.add_argument("work", type=Path)
    p_smoke = sub.add_parser("smoke")
    p_smoke.add_argument("work", type=Path)
    p_smoke.add_argument("--steps", type=int, default=3)
    p_smoke.add_argument("--dry-run", action="store_true", help="build each cell's Trainer only")
    p_check = sub.add_parser("check", help="build the run's Trainer as it will start, on the CPU")
    p_check.add_argument("work", type=Path)
    for p in (p_plan, p_data, p_config, p_report, p_smoke, p_check):
        p.add_argument("--batch-size", type=int, default=0, help="per GPU (0: from GPU memory)")
        p.add_argument("--workers", type=int, default=0, help="per GPU (0: CPUs/GPU - 1)")
    args = parser.parse_args(argv)
    plan = detect_plan(args.batch_size, args.workers)
    if args.command == "plan":
        print(json.dumps(asdict(plan)))
    elif args.command == "data":
        args.work.mkdir(parents=True, exist_ok=True)
        workers = max(1, plan.num_gpus) * plan.workers_per_rank
        shards = make_data(args.work, args.num_images, args.size, plan.cpus, workers)
        print(f"shards: {shards}")
    elif args.command == "smoke":
        return run_smoke(args.work, plan.num_gpus, args.steps, args.dry_run)
    elif args.command == "check":
        from hpctrain.config import load_config

        outcome = dry_check(load_config(str(args.work / "config.yaml")), plan.num_gpus)
        print(f"resnet50 {outcome}", flush=True)
        return 1 if outcome.startswith("FAILED") else 0
    elif args.command == "config":
        index = json.loads((args.work / "shards" / "index.json").read_text())
        plan, note = batch_for_images(plan, sum(s["num_samples"] for s in index["shards"]))
        if note:
            print(note, flush=True)
        path = write_config(plan, args.work / "shards", args.work, args.steps, args.compile)
        print(f"config: {path}")
    else:
        result = report(args.work / "run", plan, train_flops_per_image())
        (args.work / "report.json").write_text(json.dumps(result, indent=2))
        print(format_report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
