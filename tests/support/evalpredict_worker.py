"""One rank of a 2-process gloo job: train tiny runs, then `eval` and `predict` them in-process.

Started by `test_eval_predict.py` (RANK/WORLD_SIZE/MASTER_* set like torchrun):
    python tests/support/evalpredict_worker.py SHARDS CORRUPT_VAL OUT_DIR S3_URL

One process group serves every case (a 2-rank job costs ~10 s of start-up here). Each case
writes its eval record or prediction folder under OUT_DIR (S3_URL: one prediction to the
loopback S3 server); the test reads them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hpctrain.config import load_config
from hpctrain.distributed import choose_device, process_group, resolve_env
from hpctrain.inference.evaluate import run_eval
from hpctrain.inference.predict import run_predict
from hpctrain.train.trainer import Trainer


def main() -> None:
    shards, corrupt_val, out, s3_url = (
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]),
        sys.argv[4],
    )
    env = resolve_env()
    device = choose_device(env, prefer="cpu")
    torch.set_num_threads(1)
    common = [
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        "data.batch_size=16",
        "data.workers_per_rank=0",
        "data.shuffle_buffer=16",
        "model.image_size=16",
        "train.warmup_steps=0",
        "train.log_every=2",
        "logging.progress=lines",
    ]
    with process_group(env, device):
        # DDP, with the best checkpoint kept by validation loss; FSDP2, one step, no evaluation.
        for name, overrides in {
            "ddp": [
                "train.strategy=ddp",
                "train.max_steps=2",
                "train.eval_every=1",
                "checkpoint.monitor=val_loss",
                "checkpoint.mode=min",
                "checkpoint.keep_best=1",
                "checkpoint.keep_last=1",
            ],
            "fsdp": ["train.strategy=fsdp", "train.max_steps=1", "data.val="],
            # FSDP2 evaluating its EMA (train.ema_eval), the best checkpoint kept by it
            "ema": [
                "train.strategy=fsdp",
                "train.max_steps=2",
                "train.eval_every=1",
                "train.ema_decay=0.5",
                "train.ema_eval=true",
                "checkpoint.monitor=val_loss",
                "checkpoint.mode=min",
                "checkpoint.keep_best=1",
            ],
        }.items():
            cfg = load_config(None, [f"run_dir={out / name}", *common, *overrides])
            assert Trainer(cfg, env, device).fit() == 0
        ddp = load_config(out / "ddp" / "config.yaml")
        val = ddp.data.val
        fsdp = load_config(out / "fsdp" / "config.yaml", [f"data.val={val}"])
        assert run_eval(ddp, checkpoint="best", out=str(out / "eval-ddp-best.json")) == 0
        assert run_eval(fsdp, out=str(out / "eval-fsdp.json")) == 0
        # the FSDP2 checkpoint evaluated by a DDP model: the same weights, the same metrics
        # (`train.strategy=none`, refused for 2 training ranks, evaluates as DDP)
        fsdp_as_ddp = load_config(
            out / "fsdp" / "config.yaml", [f"data.val={val}", "train.strategy=none"]
        )
        assert run_eval(fsdp_as_ddp, out=str(out / "eval-fsdp-as-ddp.json")) == 0
        ema = load_config(out / "ema" / "config.yaml")
        assert run_eval(ema, checkpoint="best", out=str(out / "eval-ema-best.json")) == 0
        trained = load_config(out / "ema" / "config.yaml", ["train.ema_eval=false"])
        assert run_eval(trained, checkpoint="best", out=str(out / "eval-ema-trained.json")) == 0
        assert run_predict(ema, data=val, out=str(out / "pred-ema"), fmt="jsonl") == 0
        assert run_predict(ddp, data=val, out=str(out / "pred-ddp"), fmt="jsonl") == 0
        assert run_predict(fsdp, data=val, out=str(out / "pred-fsdp"), fmt="shards") == 0
        # A shard broken mid-file, read in a loader worker: what it loses is counted.
        skip = load_config(
            out / "ddp" / "config.yaml", ["data.on_error=skip", "data.workers_per_rank=1"]
        )
        corrupt = str(corrupt_val / "index.json")
        assert run_predict(skip, data=corrupt, out=str(out / "pred-skip"), fmt="jsonl") == 0
        assert run_predict(fsdp, data=val, out=s3_url, fmt="jsonl") == 0


if __name__ == "__main__":
    main()
