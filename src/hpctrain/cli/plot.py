"""`hpctrain plot RUN_DIR`: PNG plots next to the run's metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write PNG plots (loss, accuracy, throughput, data wait, goodput) from RUN_DIR/metrics.jsonl"
EPILOG = "example: hpctrain plot runs/demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    from hpctrain.observe.plot import plot_run
    from hpctrain.resilience.goodput_report import write_goodput_plot

    paths = plot_run(Path(args.run_dir))  # UsageError: no metrics there
    goodput = write_goodput_plot(args.run_dir)  # where the allocation's hours went
    if goodput is not None:
        paths.append(goodput)
    for path in paths:
        print(f"plot: {path}")
    return 0
