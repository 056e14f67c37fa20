"""One rank of a 2-process gloo job: a Hugging Face import under FSDP2, built on the meta
device (the trainer's path) and built whole as before (`init_from.builds_on_meta` patched
off), compared tensor for tensor.

Started by `test_init_from_meta.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/meta_worker.py HF_FOLDER SHARDS WORK PRECISION [STRATEGY]

STRATEGY: fsdp (the default), hsdp or fsdp-tp (FSDP2 x TP 2: tensors split by columns and
rows, each rank's piece taken from the tensor read whole, `hf.read_split`).
Prints `equal` on success; any difference fails an assert (exit status 1).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpctrain.config import load_config  # noqa: E402
from hpctrain.distributed import choose_device, process_group, resolve_env  # noqa: E402
from hpctrain.models import hf, init_from  # noqa: E402
from tests.models.test_hf import run_overrides, tokens  # noqa: E402
from tests.support.train_kit import trainer_built_on_meta  # noqa: E402

LM_VOCAB = 301


def imported(
    folder: str, shards: str, run_dir: Path, precision: str, env: Any, strategy: str = "fsdp"
) -> dict:
    """The full weights, EMA and logits of a trainer started from `folder`, and whether its
    model was built on the meta device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    overrides = run_overrides(Path(folder), Path(shards), run_dir)
    cfg = load_config(
        None,
        [
            *overrides,
            # hsdp on 2 ranks: replicate 1 x shard 2; fsdp-tp: shard 1 x tp 2
            f"train.strategy={strategy.removesuffix('-tp')}",
            f"train.tp_degree={2 if strategy.endswith('-tp') else 1}",
            f"train.precision={precision}",
            "train.ema_decay=0.9",
            "train.compile=false",
            "train.freeze=['blocks.0.*']",  # frozen parameters stay frozen on meta too
        ],
    )
    trainer, on_meta = trainer_built_on_meta(cfg, env, torch.device("cpu"))
    trainer.init_weights()
    model = trainer.model
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert trainer.ema is not None
    ema = [w.full_tensor() for w in trainer.ema.weights]
    with torch.no_grad():
        logits = model.eval()(tokens(LM_VOCAB))
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    return {"meta": on_meta, "weights": weights, "ema": ema, "logits": logits, "frozen": frozen}


def main() -> None:
    folder, shards, work, precision = sys.argv[1:5]
    strategy = sys.argv[5] if len(sys.argv) > 5 else "fsdp"
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    with process_group(env, device):
        on_meta = imported(folder, shards, Path(work) / "meta", precision, env, strategy)
        builds_on_meta = init_from.builds_on_meta
        init_from.builds_on_meta = lambda cfg, strategy: False  # today's path: built whole
        try:
            whole = imported(folder, shards, Path(work) / "whole", precision, env, strategy)
        finally:
            init_from.builds_on_meta = builds_on_meta
    assert on_meta["meta"] and not whole["meta"]
    assert on_meta["frozen"] == whole["frozen"] and len(whole["frozen"]) == 9, whole["frozen"]
    assert on_meta["weights"].keys() == whole["weights"].keys()
    for key, value in whole["weights"].items():
        assert torch.equal(on_meta["weights"][key], value), key
    for a, b in zip(on_meta["ema"], whole["ema"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(on_meta["logits"], whole["logits"])
    from safetensors.torch import load_file

    source = load_file(Path(folder) / hf.WEIGHTS)  # and both are the file's values
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(folder), folder)
    for ours, theirs in hf.hf_names(cfg).items():
        assert torch.equal(on_meta["weights"][ours], source[theirs].float()), ours
    print("equal", flush=True)


if __name__ == "__main__":
    main()
