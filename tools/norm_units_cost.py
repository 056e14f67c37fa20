"""What keeping BatchNorm in fp32 units costs under FSDP2: collectives and time per step.

    python tools/norm_units_cost.py [--model resnet18] [--steps 12] [--image-size 32]

Starts 2 gloo ranks on this machine and trains the model under FSDP2 (fp32, so that every
variant runs) in three layouts, interleaved step by step: blocks + root only; plus all norms in
ONE extra fp32 unit (what `hpctrain.parallel.parallelize.shard_fsdp2` does under bf16/fp16); plus one
unit PER norm. Prints FSDP2's collectives per step and the median step time of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from hpctrain.launch.local import free_port
from hpctrain.models import build_classifier
from hpctrain.parallel.parallelize import FP32_NORMS, find_blocks

LAYOUTS = ("blocks", "norms-grouped", "norms-each")
COUNTED = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


def build(layout: str, model_name: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_classifier(model_name, 10, image_size=32)
    norms = [m for m in model.modules() if isinstance(m, FP32_NORMS)]
    if layout == "norms-grouped":
        fully_shard(norms, reshard_after_forward=False)
    elif layout == "norms-each":
        for norm in norms:
            fully_shard(norm)
    for _, _, block in find_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def worker(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    counts: Counter[str] = Counter()
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*a: Any, _name: str = name, _f: Any = original, **k: Any) -> Any:
            counts[_name] += 1
            return _f(*a, **k)

        setattr(dist, name, counted)
    models = {layout: build(layout, args.model) for layout in LAYOUTS}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x = torch.randn(4, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (4,))
    times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    per_step: dict[str, int] = {}
    for step in range(args.steps):
        for layout in LAYOUTS:
            counts.clear()
            dist.barrier()
            start = time.perf_counter()
            nn.functional.cross_entropy(models[layout](x), y).backward()
            optims[layout].step()
            optims[layout].zero_grad()
            if step >= 2:  # warm-up
                times[layout].append(time.perf_counter() - start)
            per_step[layout] = sum(counts.values())
    if rank == 0:
        queue.put({k: (per_step[k], statistics.median(v)) for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(free_port(), args, queue), nprocs=2)
    result = queue.get()
    base_time = result["blocks"][1]
    print(f"{args.model}, FSDP2 on 2 gloo ranks, batch 4 x {args.image_size} px, fp32:")
    for layout, (collectives, seconds) in result.items():
        print(
            f"  {layout:14s} {collectives:3d} collectives/step  {seconds * 1000:7.1f} ms/step "
            f"({seconds / base_time - 1:+.1%})"
        )


if __name__ == "__main__":
    main()
