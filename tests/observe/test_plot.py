"""`hpctrain plot`: the plots a run's records call for (#43 item 14), and a quiet matplotlib."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpctrain.cli.main import main
from hpctrain.observe.plot import (
    BITS_PER_BYTE,
    SAMPLES_PER_S,
    TOKENS_PER_S,
    plots_for,
    series_points,
)


def write_metrics(run_dir: Path, records: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def lm_records() -> list[dict[str, Any]]:
    train = [
        {"kind": "train", "step": s, "epoch": 0, "loss": 2.0 / s, "samples_per_s": 10.0,
         "tokens_per_s": 1280.0, "data_wait_fraction": 0.0, "data_wait_fraction_worst": 0.0}
        for s in (1, 2, 3, 4)
    ]  # fmt: skip
    evals = [{"kind": "eval", "step": 4, "epoch": 0, "val_loss": 0.7, "val_bits_per_byte": 1.01}]
    return train + evals


def test_a_language_model_run_plots_bits_per_byte_and_tokens_per_second(
    tmp_path: Path, capsys: Any
) -> None:
    records = lm_records()
    plots = plots_for(records)
    assert BITS_PER_BYTE in plots and TOKENS_PER_S in plots and SAMPLES_PER_S not in plots
    train_bits, val_bits = (series_points(records, s) for s in BITS_PER_BYTE.series)
    assert train_bits[0] == (1, 2.0 / math.log(2)) and val_bits == [(4, 1.01)]
    assert series_points(records, TOKENS_PER_S.series[0])[0] == (1, 1280.0)
    run_dir = write_metrics(tmp_path / "lm", records)
    assert main(["plot", str(run_dir)]) == 0
    written = {line.split("/")[-1] for line in capsys.readouterr().out.splitlines()}
    assert {"loss.png", "bits_per_byte.png", "throughput.png", "data_wait.png"} <= written
    assert (run_dir / "bits_per_byte.png").stat().st_size > 1000


def test_an_image_run_plots_samples_per_second_and_no_bits() -> None:
    records = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in lm_records()[:4]]
    plots = plots_for(records)
    assert SAMPLES_PER_S in plots and TOKENS_PER_S not in plots and BITS_PER_BYTE not in plots


def test_matplotlib_s_info_logs_stay_out_of_the_output(tmp_path: Path) -> None:
    """On a fresh machine matplotlib's first import logs "generated new fontManager" (INFO);
    through a handler whose stream a previous test had closed it failed a test with "Logging
    error" (#43). A fresh MPLCONFIGDIR makes the first import happen here."""
    run_dir = write_metrics(tmp_path / "run", lm_records())
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from hpctrain.observe.plot import plot_run\n"
        f"plot_run({str(run_dir)!r})\n"
    )
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "mpl").is_dir()  # matplotlib built its caches in this process
    assert "fontManager" not in proc.stderr and "INFO" not in proc.stderr, proc.stderr
