"""`hpctrain eval`: a checkpoint's model over `data.val`, under the same launchers as training.

The metrics are those the Trainer's evaluations compute (`hpctrain.train.evaluation`); the
record is one JSON line on stdout, a file under `RUN_DIR/eval/` and, with `logging.*`, an
entry in the run's trackers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from hpctrain.config import Config
from hpctrain.data.index import redact_url
from hpctrain.errors import UsageError
from hpctrain.files import write_atomic
from hpctrain.inference.session import inference_session
from hpctrain.observe.trackers import check_trackers
from hpctrain.tasks.answers import Share
from hpctrain.train.evaluation import evaluate, loss_counters, require_items

log = logging.getLogger("hpctrain")


def data_name(spec: str) -> str:
    """A short file-name-safe name for a dataset spec: `data/val/index.json` → `val`."""
    path = spec.rstrip("/").split("?", 1)[0]
    parts = [p for p in re.split(r"[/\\]", path) if p]
    leaf = parts[-1] if parts else "data"
    if leaf == "index.json" and len(parts) > 1:
        leaf = parts[-2]
    leaf = re.sub(r"\.(jsonl|json|tar)$", "", leaf)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", leaf) or "data"


def record_name(spec: str) -> str:
    """The data's part of an eval record's name: `data_name` and 8 hex digits of the resolved
    path (`val-1a2b3c4d`), so two data folders with one last name get two records."""
    spec = spec.split("?", 1)[0].rstrip("/")
    if "://" in spec:
        canonical = redact_url(spec)
    else:
        canonical = str(Path(spec).resolve())
    canonical = canonical.removesuffix("/index.json")
    return f"{data_name(spec)}-{hashlib.sha256(canonical.encode()).hexdigest()[:8]}"


def check_record_path(out: str) -> None:
    """Refuse an `--out` that cannot be the record's file (a folder), before any work."""
    if out and Path(out).is_dir():
        raise UsageError(f"--out {out}: is a folder; give the record's file name")


def run_eval(
    cfg: Config, *, checkpoint: str = "latest", out: str = "", tokenizer_spec: str = ""
) -> int:
    """`hpctrain eval` in this process, as one rank of the job; returns the exit code.

    Loads the model of `checkpoint` (`latest`, `best`, or a path: see
    `hpctrain.inference.session.find_checkpoint`), evaluates it over `cfg.data.val` with the
    task's `eval_metrics`/`summarize`, and rank 0 prints the record as one JSON line on
    stdout, writes it to `out` (default `RUN_DIR/eval/step-<N>.<data>-<hash>.json`, see
    `record_name`) and sends it to the trackers `logging.*` turns on.

    Raises:
        UsageError: `out` is a folder or cannot be written.
    """
    check_record_path(out)
    session = inference_session(
        cfg,
        checkpoint,
        cfg.data.val,
        key="data.val",
        predict=False,
        tokenizer_spec=tokenizer_spec,  # `--tokenizer`: eval.generate decodes with it
    )
    with session as run:
        assert run.loader is not None  # a session over data.val
        require_items(run.loader, "data.val", cfg.data.val, cfg.data.seq_len)
        if run.env.is_main:
            check_trackers(cfg.logging)  # a missing package fails before the work, not after
        env = run.env  # with eval.generate, each rank answers its share of the prompts
        share = Share(rank=env.rank, size=env.world_size, lockstep=env.is_distributed)
        label = f"evaluation of {run.checkpoint} (step {run.step})"
        if env.is_main:
            log.info("%s on %s: %d batches per rank", label, cfg.data.val, len(run.loader))
        metrics = evaluate(
            run.task, run.model, run.loader, run.precision, run.device, share=share, label=label
        )
        lost = loss_counters(run.loader, run.device)
        if not run.env.is_main:
            return 0
        name = data_name(cfg.data.val)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": run.step,
            "checkpoint": run.checkpoint,
            "weights": run.weights,
            **({"lora_base": run.lora_base} if run.lora_base else {}),
            "data": run.data,
            "world_size": run.env.world_size,
            **metrics,
            **lost,
        }
        default = Path(cfg.run_dir) / "eval" / f"step-{run.step}.{record_name(cfg.data.val)}.json"
        path = Path(out) if out else default
        record["record"] = str(path)
        write_atomic(path, (json.dumps(record, indent=1) + "\n").encode(), what="the record")
        print(json.dumps(record), flush=True)
        log_to_trackers(cfg, record, name, run.env.world_size)
        if any(lost.values()):
            log.warning(
                "evaluation lost data under data.on_error=skip: %s",
                ", ".join(f"{k} {v}" for k, v in lost.items() if v),
            )
        return 0


def log_to_trackers(cfg: Config, record: dict[str, Any], name: str, world_size: int) -> None:
    """Send the record to the run's tracked run (W&B/MLflow) as `eval.<data>/<metric>`.

    Its own kind (`eval.<data>`) keeps it apart from the training's evaluations, which the
    trackers have at the same steps.
    """
    from hpctrain.observe.trackers import start_trackers

    trackers = start_trackers(cfg, world_size, resumed=True)
    if trackers is None:
        return
    kind = f"eval.{name}"
    values = {
        f"{kind}/{k}": v
        for k, v in record.items()
        if k.startswith(("val_", "loader_")) and isinstance(v, (int, float))
    }
    status = "failed"
    try:
        trackers.log({"kind": kind, "step": record["step"], **values})
        status = "finished"
    finally:
        trackers.close(status)
