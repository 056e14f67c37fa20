"""One rank of the tensor-parallel jobs of `test_tp.py` (gloo, CPU, causal_lm).

    python tests/support/tp_worker.py SHARDS OUT_DIR two|four|one

- `two` (2 ranks): flat FSDP2 baselines; the GPT split over a 2-rank TP mesh against the
  same GPT in one piece, on fixed tokens (with and without document positions).
- `four` (4 ranks, two pretended nodes of 2): FSDP2 2 x TP 2 and HSDP 2 x 1 x TP 2, whose
  data-parallel layout (2 ranks) is the baselines'; refusals (heads, vision task).
- `one` (a single process): the 2-step runs of `two` and `four` continued alone.
Rank 0 writes each run's full weights to `OUT_DIR/<case>.pt`.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.models.gpt import GPT, GPTConfig
from hpctrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.support.train_kit import full_weights  # noqa: E402

TP = ["train.tp_degree=2"]
TIED = ["causal_lm.tie_embeddings=true"]
# bf16 with fp32 reduction, accumulation (no reduction on the first micro-batch), clipping
# by the global norm of 2-D DTensor gradients, an EMA sharded like the parameters
MIXED = [
    "train.precision=bf16",
    "train.grad_accum_steps=2",
    "data.batch_size=2",
    "train.grad_clip=0.1",
    "train.ema_decay=0.9",
    "train.ema_eval=true",
]
TWO = {
    "fsdp": (["train.strategy=fsdp"], 4),
    "fsdp-tied": (["train.strategy=fsdp", *TIED], 4),
    "fsdp-half": (["train.strategy=fsdp"], 2),
    "fsdp-mixed": (["train.strategy=fsdp", *MIXED], 3),
}
FOUR = {
    "fsdp-tp": (["train.strategy=fsdp", *TP], 4),
    "fsdp-tp-tied": (["train.strategy=fsdp", *TP, *TIED, "train.activation_checkpointing=true"], 4),
    "hsdp-tp": (["train.strategy=hsdp", *TP], 4),
    "fsdp-tp-half": (["train.strategy=fsdp", *TP], 2),
    "fsdp-tp-mixed": (["train.strategy=fsdp", *TP, *MIXED], 3),
}
ONE = {"fsdp-to-one": "fsdp-half", "tp-to-one": "fsdp-tp-half"}
REFUSED = {
    "heads": ["train.strategy=fsdp", *TP, "causal_lm.n_kv_heads=1"],
    "vision": [
        "train.strategy=fsdp",
        *TP,
        "task=image_classification",
        "model.name=small_cnn",
        "data.seq_len=0",
    ],
}


def overrides(shards: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "data.seq_len=32",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "data.shuffle_buffer=8",
        "data.sample_log=true",
        "causal_lm.dim=32",
        "causal_lm.n_layers=2",
        "causal_lm.n_heads=4",
        "causal_lm.n_kv_heads=2",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.lr=0.01",
        "train.schedule=constant",  # a run stopped at step 2 continues on the same course
        "train.precision=fp32",
        "train.deterministic=true",
        "logging.progress=lines",
        *extra,
    ]


def train(env, device, shards: Path, run_dir: Path, steps: int, extra: list[str]) -> None:
    trainer = Trainer(load_config(None, overrides(shards, run_dir, steps, *extra)), env, device)
    assert trainer.fit() == 0
    weights = full_weights(trainer.model)
    if env.is_main:
        torch.save(weights, run_dir.parent / f"{run_dir.name}.pt")


def split_logits(env, out: Path) -> None:
    """The GPT split over 2 ranks computes the logits of the GPT in one piece."""
    from torch.distributed.device_mesh import init_device_mesh

    for tied in (False, True):
        cfg = GPTConfig(
            vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=tied
        )
        torch.manual_seed(0)
        whole = GPT(cfg)
        split = GPT(cfg)
        split.load_state_dict(whole.state_dict())
        split.parallelize_tensors(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
        positions = torch.tensor([list(range(6)) + list(range(10))] * 2)
        for pos in (None, positions):
            expected, got = whole(tokens, pos), split(tokens, pos)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            if pos is not None:  # the mask matters: without it the logits differ
                assert not torch.allclose(split(tokens), got, atol=1e-3)
    if env.is_main:
        (out / "split-logits.ok").write_text("ok")


def refusals(env, device, shards: Path, out: Path) -> None:
    for name, extra in REFUSED.items():
        try:
            Trainer(load_config(None, overrides(shards, out / name, 1, *extra)), env, device)
        except ConfigError as exc:
            if env.is_main:
                (out / f"{name}.refused").write_text(str(exc))


def main() -> None:
    shards, out, job = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    if job == "one":
        for name, source in ONE.items():
            shutil.copytree(out / source, out / name)
            (out / name / "metrics.jsonl").unlink()
            train(env, device, shards, out / name, 4, ["data.val="])
        return
    with process_group(env, device):
        cases = TWO if job == "two" else FOUR
        for name, (extra, steps) in cases.items():
            train(env, device, shards, out / name, steps, extra)
        if job == "two":
            split_logits(env, out)
        else:
            refusals(env, device, shards, out)


if __name__ == "__main__":
    main()
