"""`hpctrain bench import`: a Hugging Face import into FSDP2 against one process's load.

A random Llama-shaped folder at the GPT preset's widths (`gpt-1b` by default: Llama 3.2 1B's
shape, vocabulary 128,256) is written with `safetensors` into a temporary folder (bf16 by
default: half the disk of fp32), then loaded two ways, each in fresh processes:

- one process: the GPT built as a run builds it (random fp32 weights), the files read with
  `safetensors.torch.load_file`, then `load_state_dict`: what a script does without hpctrain;
- `--ranks` gloo ranks on the CPU: the trainer's path under FSDP2 with `model.init_from`
  (`init_from.build_model` on the meta device, `parallelize`, `load_initial_weights`: each
  rank reads its own rows).

Per process: wall time of the load (from after start-up) and its peak host memory, the
growth of the resident set over what the process held before (the peak is reset first through
`/proc/self/clear_refs`; elsewhere the lifetime peak, an upper bound). Reported against the
fp32 model's bytes with the goals of issue 25: peak per rank <= 0.6x the model, FSDP2 wall
time <= 1.5x the single process's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hpctrain.bench.measure import self_cpu_seconds
from hpctrain.models import hf
from hpctrain.models.gpt import GPT, GPTConfig, gpt_config, num_params

HELP = "Hugging Face import: FSDP2 ranks reading their rows vs one process's load_state_dict"
MEMORY_GOAL = 0.6  # peak host memory per rank / the fp32 model's bytes
TIME_GOAL = 1.5  # FSDP2 wall time / the single process's
LLAMA3_VOCAB = 128256
SHARD_BYTES = 1 << 30  # safetensors files of at most this size, with their index


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="gpt-1b", help="GPT preset whose widths to use")
    parser.add_argument("--layers", type=int, default=0, help="layers (0: the preset's)")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="vocabulary size")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="file dtype")
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (gloo, CPU)")
    parser.add_argument("--work", default="", help="folder for the model (default: a temp one)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    cfg = gpt_config(args.preset, args.vocab, n_layers=args.layers)
    with tempfile.TemporaryDirectory(dir=args.work or None, prefix="bench-import-") as work:
        result = compare(Path(work), cfg, dtype=args.dtype, ranks=args.ranks)
    result["preset"] = args.preset
    print(json.dumps(result, indent=2) if args.json else format_results(result))
    return 0


def compare(work: Path, cfg: GPTConfig, *, dtype: str = "bf16", ranks: int = 2) -> dict[str, Any]:
    """Write the folder into `work`, load it both ways; the figures (see the module doc)."""
    folder = work / "model"
    file_bytes = write_folder(folder, cfg, torch.bfloat16 if dtype == "bf16" else torch.float32)
    shape = json.dumps(asdict(cfg))
    read_through(folder)
    single = run_processes("single", folder, shape, 1)[0]
    read_through(folder)
    sharded = run_processes("fsdp", folder, shape, ranks)
    model_bytes = 4 * num_params(cfg)  # fp32, as the trainer holds it
    fsdp_seconds = max(r["seconds"] for r in sharded)
    fsdp_peak = max(r["peak_bytes"] for r in sharded)
    return {
        "n_layers": cfg.n_layers,
        "dim": cfg.dim,
        "vocab_size": cfg.vocab_size,
        "num_params": num_params(cfg),
        "file_dtype": dtype,
        "file_bytes": file_bytes,
        "model_bytes": model_bytes,
        "ranks": ranks,
        "single": single,
        "fsdp": sharded,
        "memory_ratio": fsdp_peak / model_bytes,
        "single_memory_ratio": single["peak_bytes"] / model_bytes,
        "time_ratio": fsdp_seconds / single["seconds"],
        "load_time_ratio": max(r["phases"]["load"] for r in sharded) / single["phases"]["load"],
        "memory_goal": MEMORY_GOAL,
        "time_goal": TIME_GOAL,
    }


def write_folder(folder: Path, cfg: GPTConfig, dtype: torch.dtype) -> int:
    """A random Llama folder of shape `cfg` (`config.json`, safetensors files and their index,
    as `save_pretrained` shards them); returns the tensors' bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / hf.CONFIG).write_text(json.dumps(hf.hf_config(cfg, {}, None)))
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in GPT(cfg).named_parameters()}
    names = hf.hf_names(cfg)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for ours, theirs in names.items():
        tensor = torch.empty(shapes[ours], dtype=dtype).normal_(0, 0.02, generator=generator)
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][theirs] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()  # free each shard once written
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / hf.INDEX).write_text(json.dumps(index))
    return total


def read_through(folder: Path) -> None:
    """Read every file of `folder` once, so that both cases start with the files in the page
    cache (the folder was just written, but the other case's memory may have evicted it)."""
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def run_processes(kind: str, folder: Path, shape: str, count: int) -> list[dict[str, Any]]:
    """Start `count` processes of `measure_main` (ranks, torchrun-style, when `kind` is
    fsdp); their results."""
    from hpctrain.launch.local import free_port

    port = free_port()
    code = "from hpctrain.bench.weights_import import measure_main; measure_main()"
    procs = []
    for rank in range(count):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if kind == "fsdp":
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(count),
                LOCAL_WORLD_SIZE=str(count),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        command = [sys.executable, "-c", code, kind, str(folder), shape]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"bench import: a {kind} process failed: {outputs}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def resident_bytes(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (peak) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def measured(load: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Run `load`; its wall time, phases and peak resident growth in bytes."""
    with contextlib.suppress(OSError):  # elsewhere the lifetime peak: an upper bound
        Path("/proc/self/clear_refs").write_text("5")  # peak := now (Linux >= 4.0)
    before = resident_bytes("VmRSS")
    start, cpu = time.perf_counter(), self_cpu_seconds()
    phases = load()
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": self_cpu_seconds() - cpu,
        "phases": phases,
        "peak_bytes": resident_bytes("VmHWM") - before,
    }


def measure_main() -> None:
    """One process of `run_processes`: `KIND FOLDER SHAPE_JSON`; prints its figures as JSON."""
    kind, folder, shape = sys.argv[1:]
    cfg = GPTConfig(**json.loads(shape))
    if kind == "single":
        result = measured(lambda: load_single(folder, cfg))
        print(json.dumps(result), flush=True)
        return
    # Imported before the clock starts: start-up, not the load.
    import torch.distributed as dist
    import torch.distributed.fsdp

    import hpctrain.models.init_from
    import hpctrain.parallel.parallelize  # noqa: F401
    from hpctrain.distributed import process_group, resolve_env

    env = resolve_env()
    device = torch.device("cpu")
    with process_group(env, device):
        dist.barrier()
        result = measured(lambda: load_fsdp(folder, cfg, env.world_size, device))
        dist.barrier()
    print(json.dumps(result), flush=True)


def load_single(folder: str, cfg: GPTConfig) -> dict[str, float]:
    """The GPT built (random fp32), `load_file` of each file, `load_state_dict`."""
    from safetensors.torch import load_file

    start = time.perf_counter()
    torch.manual_seed(0)
    model = GPT(cfg)
    built = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(hf.weight_files(folder).values())):
        tensors.update(load_file(path))
    model.load_state_dict({ours: tensors[theirs] for ours, theirs in hf.hf_names(cfg).items()})
    return {"build": built - start, "load": time.perf_counter() - built}


class ImportTask:
    """The part of the causal_lm task that `init_from` uses: the GPT of a known shape."""

    def __init__(self, cfg: GPTConfig) -> None:
        self.model_cfg = cfg

    def build_model(self) -> GPT:
        return GPT(self.model_cfg)


def load_fsdp(
    folder: str, cfg: GPTConfig, world_size: int, device: torch.device
) -> dict[str, float]:
    """The trainer's path: meta build, FSDP2 shards, each rank's rows from the folder."""
    from hpctrain.config import Config, with_overrides
    from hpctrain.models import init_from
    from hpctrain.parallel.parallelize import parallelize
    from hpctrain.parallel.precision import device_facts, plan_training

    run = with_overrides(
        Config(),
        [f"model.init_from={folder}", "train.strategy=fsdp", "train.precision=fp32"],
    )
    plan = plan_training(run.train, device_facts(device), world_size)
    task = ImportTask(cfg)
    start = time.perf_counter()
    model = parallelize(
        init_from.build_model(task, run, plan.strategy).model, run.train, plan, device
    )
    built = time.perf_counter()
    init_from.load_initial_weights(model, run, task)
    return {"build": built - start, "load": time.perf_counter() - built}


def format_results(result: dict[str, Any]) -> str:
    gb = 1e9
    single, ranks = result["single"], result["ranks"]
    slowest = max(result["fsdp"], key=lambda r: r["seconds"])
    fsdp_peak = max(r["peak_bytes"] for r in result["fsdp"])

    def phases(r: dict[str, Any]) -> str:
        return (
            f"{r['seconds']:.1f} s (build {r['phases']['build']:.1f} s, load "
            f"{r['phases']['load']:.1f} s; CPU {r['cpu_seconds']:.1f} s)"
        )

    def verdict(ratio: float, goal: float) -> str:
        return "met" if ratio <= goal else "missed"

    return "\n".join(
        [
            f"import of a {result.get('preset', 'GPT')}-shaped Hugging Face folder "
            f"({result['n_layers']} layers, dim {result['dim']}, vocabulary "
            f"{result['vocab_size']:,}; {result['num_params'] / 1e9:.2f}e9 parameters): "
            f"{result['file_dtype']} files {result['file_bytes'] / gb:.2f} GB, fp32 model "
            f"{result['model_bytes'] / gb:.2f} GB",
            f"one process (GPT built, load_file, load_state_dict): {phases(single)}, "
            f"peak host memory +{single['peak_bytes'] / gb:.2f} GB = "
            f"{result['single_memory_ratio']:.2f}x the model",
            f"FSDP2, {ranks} gloo ranks (meta build, each rank's rows), slowest rank: "
            f"{phases(slowest)}, peak host memory per rank +{fsdp_peak / gb:.2f} GB = "
            f"{result['memory_ratio']:.2f}x the model",
            f"peak per rank / model = {result['memory_ratio']:.2f}x (goal <= "
            f"{result['memory_goal']}x: {verdict(result['memory_ratio'], result['memory_goal'])})"
            f"; FSDP2 time / one process = {result['time_ratio']:.2f}x (goal <= "
            f"{result['time_goal']}x: {verdict(result['time_ratio'], result['time_goal'])}; "
            f"the load phases alone: {result['load_time_ratio']:.2f}x)",
        ]
    )
