"""Print a language-model run's validation bits per byte against the unigram baseline.

Reads RUN_DIR/config.yaml (the resolved config `hpctrain train` wrote) for the data, and the
last evaluation of RUN_DIR/metrics.jsonl; counts the tokens of the training and validation
shards (`hpctrain.data.unigram`) and prints both figures and their ratio. Exit code 1 when the
model is not below the baseline (or the run has no evaluation): `make demo-lm` fails then.

Example::

    python tools/lm_report.py runs/demo-lm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hpctrain.config import load_config
from hpctrain.data import open_index
from hpctrain.data.unigram import UnigramBaseline, unigram_baseline
from hpctrain.errors import HpctrainError


def last_eval(run_dir: Path) -> dict[str, Any] | None:
    """The last `"kind": "eval"` record of the run's metrics, or None."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("kind") == "eval"]
    return evals[-1] if evals else None


def model_bits(record: dict[str, Any], unit: str) -> float | None:
    """The evaluation's bits per `unit` (byte: `val_bits_per_byte`; token: from the loss)."""
    if unit == "byte":
        return record.get("val_bits_per_byte")
    loss = record.get("val_loss")
    return None if loss is None else loss / 0.6931471805599453  # nats -> bits


def report(run_dir: Path) -> tuple[str, bool]:
    """The report's text and whether the model beat the baseline."""
    cfg = load_config(str(run_dir / "config.yaml"))
    train = open_index(cfg.data.train, allow_pipe=cfg.data.allow_pipe)
    val = open_index(cfg.data.val, allow_pipe=cfg.data.allow_pipe) if cfg.data.val else None
    baseline: UnigramBaseline = unigram_baseline(train, cfg.data.train, val, cfg.data.val)
    record = last_eval(run_dir)
    bits = None if record is None else model_bits(record, baseline.unit)
    lines = []
    if record is None or bits is None:
        lines.append(f"{run_dir}: no evaluation with bits per {baseline.unit} in metrics.jsonl")
    else:
        lines.append(
            f"validation: {bits:.3f} bits per {baseline.unit} at step {record['step']} "
            f"(loss {record['val_loss']:.4f} nats per token)"
        )
    lines.append(baseline.describe())
    reference = (
        baseline.val_cross_entropy
        if baseline.val_cross_entropy is not None
        else baseline.train_entropy
    )
    beaten = bits is not None and bits < reference
    if bits is not None:
        lines.append(
            f"model / unigram baseline = {bits / reference:.2f} "
            f"({'below' if beaten else 'NOT below'} the baseline)"
        )
    return "\n".join(lines), beaten


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run folder (holds config.yaml)")
    args = parser.parse_args(argv)
    try:
        text, beaten = report(args.run_dir)
    except HpctrainError as exc:  # a missing run folder, an unreadable index or shard
        print(f"lm_report.py: {exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code
    print(text)
    return 0 if beaten else 1


if __name__ == "__main__":
    sys.exit(main())
