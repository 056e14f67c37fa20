"""One rank of the 2-process gloo job behind `test_warm_start_sharded.py`: warm starts from an
hpctrain run folder into sharded models, each rank reading its own pieces of the checkpoint.

    python tests/support/warm_start_worker.py WORK

WORK holds `lm-source/` and `cnn-source/` (run folders trained in one process by the test),
`lm-shards/`, `cnn-shards/` and `expected.pt` (the sources' weights, read whole by the test).
Reading a checkpoint whole (`read_model_weights`) is made to fail here, so every case proves
the sharded read. Prints `equal` on success; any difference fails an assert (exit status 1).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hpctrain.checkpoint.weights as checkpoint_weights  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from tests.models.test_hf_init_from import lm_overrides  # noqa: E402
from tests.support.train_kit import (  # noqa: E402
    full_weights,
    tiny_run_overrides,
    trainer_built_on_meta,
)

# case -> (source, overrides, read the EMA, built on meta, keys re-initialised)
CASES: dict[str, tuple[str, list[str], bool, bool, tuple[str, ...]]] = {
    "lm-fsdp": ("lm", ["train.strategy=fsdp"], False, True, ()),
    "lm-hsdp-ema": ("lm", ["train.strategy=hsdp", "train.ema_decay=0.9"], True, True, ()),
    "lm-fsdp-tp": ("lm", ["train.strategy=fsdp", "train.tp_degree=2"], False, True, ()),
    "lm-fsdp-bf16-ckpt": (
        "lm",
        ["train.strategy=fsdp", "train.precision=bf16", "train.activation_checkpointing=true"],
        False,
        True,
        (),
    ),
    # BatchNorm's running statistics are persistent buffers: in the checkpoint, so on meta
    "cnn-fsdp": ("cnn", ["train.strategy=fsdp"], False, True, ()),
    # 12 classes, not 10: the head starts anew, so built whole; the rest is read sharded
    "cnn-new-head": (
        "cnn",
        ["train.strategy=fsdp", "model.num_classes=12"],
        False,
        False,
        ("head.bias", "head.weight"),
    ),
}


def warm_start(work: Path, case: str, env: Any) -> None:
    source, extra, ema, meta, fresh = CASES[case]
    run_dir = work / case
    if source == "lm":
        overrides = lm_overrides(work / "lm-shards", run_dir, "train.max_steps=1")
    else:
        overrides = tiny_run_overrides(
            work / "cnn-shards", run_dir, "train.max_steps=1", "data.workers_per_rank=0"
        )
    cfg = load_config(
        None if source == "lm" else str(REPO / "configs" / "demo.yaml"),
        [
            *overrides,
            *extra,
            "seed=11",  # other than the source's: loaded values cannot be a same-seed build
            f"model.init_from={work / f'{source}-source'}",
            f"model.init_from_ema={str(ema).lower()}",
        ],
    )
    trainer, on_meta = trainer_built_on_meta(cfg, env, torch.device("cpu"))
    assert on_meta == meta, (case, on_meta)
    with caplog() as lines:
        trainer.init_weights()
    text = "\n".join(lines)
    assert "(each rank read its shards)" in text, (case, text)
    if fresh:
        assert f"re-initialised (shapes differ): {', '.join(fresh)}" in text, (case, text)
    weights = full_weights(trainer.model)
    expected = torch.load(work / "expected.pt")[f"{source}-{'ema' if ema else 'model'}"]
    if env.is_main:  # cpu_offload: the full weights are gathered on rank 0 only
        assert sorted(weights) == sorted(expected), (case, sorted(set(weights) ^ set(expected)))
        for key, value in expected.items():
            if key in fresh:
                assert weights[key].shape != value.shape, (case, key)
                continue
            assert torch.equal(weights[key], value), (case, key)
    if trainer.ema is not None:  # the EMA starts from the loaded weights
        for name, averaged in zip(trainer.ema.names, trainer.ema.weights, strict=True):
            assert torch.equal(averaged.full_tensor(), expected[name]), (case, name)
    trainer.checkpoints.close()


@contextlib.contextmanager
def caplog() -> Iterator[list[str]]:
    """The messages `hpctrain` logs inside the block."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("hpctrain")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main() -> None:
    work = Path(sys.argv[1])
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)

    def whole(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a sharded warm start read the checkpoint whole")

    checkpoint_weights.read_model_weights = whole
    with process_group(env, device):
        for case in CASES:
            warm_start(work, case, env)
            print(f"{case}: equal", flush=True)
    print("equal", flush=True)


if __name__ == "__main__":
    main()
