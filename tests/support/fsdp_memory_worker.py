"""One rank of the 2-process gloo job of `tests/parallel/test_fsdp_memory.py`: what FSDP2 keeps
and builds (issue #38: items 5 and 6, and two of its low items).

    python tests/support/fsdp_memory_worker.py IMAGE_SHARDS TOKEN_SHARDS OUT_DIR

- accumulation: FSDP2 (shard 2) and HSDP (replicate 2 x shard 1) with `grad_accum_steps=2`:
  between micro-steps, the bytes of unsharded gradients FSDP2 holds, and the final weights;
  then the same runs with the accumulation of before (`set_requires_gradient_sync(False)` on
  the first micro-step: the gradients are not reduce-scattered until the last one);
- meta: a fresh GPT (FSDP2, fp32) and a BatchNorm CNN (HSDP, bf16) built by the Trainer, with
  whether it built on the meta device, their full initial weights, and the weights of a CPU
  build from the same seed (today's initialisation); then two training steps;
- gathered: a GPT under FSDP2 bf16: the dtypes of a block's RoPE tables, and whether the
  root's parameters are still gathered after the forward (plain tensors, not DTensors).

Rank 0 writes `OUT_DIR/<case>.pt` (weights) and `OUT_DIR/facts.json`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # examples.custom_task

import hpctrain.train.step as step_module  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from tests.support.train_kit import full_weights, trainer_built_on_meta  # noqa: E402

MLP = ["task=examples.custom_task:ThumbnailMLP", "task_options.hidden=32"]
GPT = ["task=causal_lm", "model.name=gpt-tiny", "data.seq_len=32", "data.batch_size=4"]
CNN = ["task=image_classification", "model.name=small_cnn", "model.image_size=16"]
ACCUMULATION = {
    "fsdp-fp32": ["train.strategy=fsdp", "train.precision=fp32"],
    "hsdp-fp32": ["train.strategy=hsdp", "train.shard_degree=1", "train.precision=fp32"],
    "fsdp-bf16": ["train.strategy=fsdp", "train.precision=bf16"],
}
META = {
    "gpt-fsdp-fp32": [*GPT, "train.strategy=fsdp", "train.precision=fp32"],
    "cnn-hsdp-bf16": [*CNN, "train.strategy=hsdp", "train.shard_degree=1", "train.precision=bf16"],
}


def config(run_dir: Path, data: Path, overrides: list[str], steps: int) -> Any:
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"data.train={data}",
            "data.batch_size=8",
            "data.workers_per_rank=0",
            "data.shuffle_buffer=16",
            f"train.max_steps={steps}",
            "train.log_every=1",
            "train.lr=0.01",
            "train.schedule=constant",
            "train.deterministic=true",
            "checkpoint.final=false",
            "logging.progress=lines",
            *overrides,
        ],
    )


def unsharded_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of full-size gradients FSDP2 holds for its sharded parameters (FSDP2 internals:
    no public API says where an unreduced gradient waits; torch 2.14's names)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                waiting = [param.unsharded_accumulated_grad]
                if hasattr(param, "_unsharded_param"):
                    waiting.append(param._unsharded_param.grad)
                total += sum(g.numel() * g.element_size() for g in waiting if g is not None)
    return total


def reduced_gradients(model: torch.nn.Module) -> int:
    """Gradients reduce-scattered already: sharded parameters with a gradient, and under HSDP
    the reduce-scatter outputs FSDP2 keeps until their all-reduce across the replicas (its
    internals again)."""
    from torch.distributed.fsdp import FSDPModule

    count = sum(1 for p in model.parameters() if p.grad is not None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            count += sum(1 for g in groups if g._partial_reduce_output is not None)
    return count


@contextlib.contextmanager
def accumulation_of_before() -> Iterator[None]:
    """The accumulation before #38 item 5: no reduce-scatter before the last micro-step."""

    @contextlib.contextmanager
    def no_gradient_sync(model: Any, skip: bool) -> Iterator[None]:
        if skip:
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    current = step_module.no_gradient_sync
    step_module.no_gradient_sync = no_gradient_sync
    try:
        yield
    finally:
        step_module.no_gradient_sync = current


def accumulate(env: Any, shards: Path, out: Path, name: str, overrides: list[str]) -> dict:
    """A 3-step run with 2 micro-steps per step; what FSDP2 held between micro-steps."""
    from hpctrain.train.trainer import Trainer

    data = shards / "train" / "index.json"
    cfg = config(out / name, data, [*MLP, *overrides, "train.grad_accum_steps=2"], 3)
    trainer = Trainer(cfg, env, torch.device("cpu"))
    seen: list[dict[str, int]] = []
    loss = trainer.task.loss
    calls = 0

    def spying_loss(model: Any, batch: Any) -> Any:
        nonlocal calls
        if calls % 2 == 1:  # the second micro-step: the first one's backward is done
            seen.append(
                {
                    "unsharded_bytes": unsharded_gradient_bytes(trainer.model),
                    "reduced": reduced_gradients(trainer.model),
                }
            )
        calls += 1
        return loss(model, batch)

    trainer.task.loss = spying_loss  # type: ignore[method-assign]
    assert trainer.fit() == 0
    weights = full_weights(trainer.model)
    if env.is_main:
        torch.save(weights, out / f"{name}.pt")
    return {"between": seen, "losses": _losses(out / name)}


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"kind": "train"' in x]


def fresh_build(env: Any, data: Path, out: Path, name: str, overrides: list[str]) -> dict:
    """The Trainer's initial weights and a CPU build's of the same seed, then 2 steps."""
    cfg = config(out / name, data, overrides, 2)
    trainer, on_meta = trainer_built_on_meta(cfg, env, torch.device("cpu"))
    initial = full_weights(trainer.model)
    torch.manual_seed(cfg.seed)  # what the Trainer did before building: today's build
    reference = trainer.task.build_model().state_dict()
    if env.is_main:
        torch.save({"trainer": initial, "cpu": reference}, out / f"{name}.pt")
    assert trainer.fit() == 0
    return {"on_meta": on_meta, "losses": _losses(out / name)}


def gathered(env: Any, data: Path, out: Path) -> dict:
    """One bf16 FSDP2 step of the GPT, watched from a block and from the root."""
    from torch.distributed.tensor import DTensor

    cfg = config(out / "gathered", data, [*GPT, "train.strategy=fsdp", "train.precision=bf16"], 1)
    trainer, _ = trainer_built_on_meta(cfg, env, torch.device("cpu"))
    model = trainer.model
    facts: dict[str, Any] = {}

    def block_inputs(module: Any, args: tuple) -> None:
        facts["block_inputs"] = [str(a.dtype) for a in args if isinstance(a, torch.Tensor)]

    def after_forward(module: Any, args: Any, output: Any) -> None:
        weight = module.tok_embeddings.weight
        facts["root_after_forward"] = "sharded" if isinstance(weight, DTensor) else "gathered"

    model.blocks[0].register_forward_pre_hook(block_inputs)
    model.register_forward_hook(after_forward)
    assert trainer.fit() == 0
    return facts


def main() -> None:
    shards, tokens, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    facts: dict[str, Any] = {"accumulation": {}, "before": {}, "meta": {}}
    with process_group(env, device):
        for name, overrides in ACCUMULATION.items():
            facts["accumulation"][name] = accumulate(env, shards, out, name, overrides)
            with accumulation_of_before():
                facts["before"][name] = accumulate(env, shards, out, f"{name}-before", overrides)
        for name, overrides in META.items():
            data = tokens if name.startswith("gpt") else shards / "train" / "index.json"
            facts["meta"][name] = fresh_build(env, data, out, name, overrides)
        facts["gathered"] = gathered(env, tokens, out)
    for case in facts["meta"].values():
        assert all(math.isfinite(x) for x in case["losses"]), case
    if env.is_main:
        (out / "facts.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
