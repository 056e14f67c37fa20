"""PNG plots of a run's `metrics.jsonl`: loss, accuracy, throughput, data wait; for a language
model also bits per byte (the `bytes` tokenizer) and tokens/s instead of samples/s, and the
answers' scores (`eval.generate`); and where its allocated hours went (`plot_goodput`, from
`hpctrain.resilience.goodput`)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.errors import UsageError


@dataclass(frozen=True)
class Series:
    """One line of a plot: `field` of the records of `kind`, times `scale`."""

    kind: str  # "train" or "eval"
    field: str
    label: str
    scale: float = 1.0


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file name
    title: str
    series: tuple[Series, ...]
    ylabel: str


LOSS = Plot(
    "loss.png",
    "Loss",
    (Series("train", "loss", "train"), Series("eval", "val_loss", "validation")),
    "loss",
)
ACCURACY = Plot(
    "accuracy.png",
    "Accuracy",
    (Series("train", "accuracy", "train (batch)"), Series("eval", "val_accuracy", "validation")),
    "accuracy",
)
SAMPLES_PER_S = Plot(
    "throughput.png",
    "Throughput",
    (Series("train", "samples_per_s", "samples/s (all ranks)"),),
    "samples/s",
)
# causal_lm: what the run is measured by is tokens (hpctrain.models.flops.throughput_fields)
TOKENS_PER_S = Plot(
    "throughput.png",
    "Throughput",
    (Series("train", "tokens_per_s", "tokens/s (all ranks)"),),
    "tokens/s",
)
# causal_lm with the bytes tokenizer: a token is a byte, so bits per byte = loss (nats) / ln 2,
# the figure `make demo-lm` compares with the unigram baseline (tools/lm_report.py)
BITS_PER_BYTE = Plot(
    "bits_per_byte.png",
    "Bits per byte",
    (
        Series("train", "loss", "train (batch)", scale=1 / math.log(2)),
        Series("eval", "val_bits_per_byte", "validation"),
    ),
    "bits per byte",
)
# causal_lm with eval.generate: the validation prompts answered and scored (tasks/answers.py)
ANSWERS = Plot(
    "answers.png",
    "Answers scored (eval.generate)",
    (
        Series("eval", "val_exact_match", "exact match"),
        Series("eval", "val_token_f1", "token F1"),
    ),
    "fraction of the validation prompts",
)
DATA_WAIT = Plot(
    "data_wait.png",
    "Time blocked on the loader",
    (
        Series("train", "data_wait_fraction", "mean over ranks"),
        Series("train", "data_wait_fraction_worst", "worst rank"),
    ),
    "fraction of step time",
)


def plots_for(records: list[dict[str, Any]]) -> list[Plot]:
    """The plots a run's records call for: a language model's throughput is tokens/s, and
    its bits per byte are plotted when its evaluations report them (the bytes tokenizer)."""
    counts_tokens = any("tokens_per_s" in r for r in records)
    plots = [LOSS, ACCURACY, TOKENS_PER_S if counts_tokens else SAMPLES_PER_S, DATA_WAIT]
    if any("val_bits_per_byte" in r for r in records):
        plots.insert(1, BITS_PER_BYTE)
    if any("val_exact_match" in r for r in records):
        plots.insert(2, ANSWERS)
    return plots


def series_points(records: list[dict[str, Any]], series: Series) -> list[tuple[int, float]]:
    """(step, value) of `series` in the records, in their order."""
    return [
        (r["step"], r[series.field] * series.scale)
        for r in records
        if r.get("kind", "train") == series.kind and series.field in r
    ]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl (a last line cut by a kill is left out).

    Raises:
        UsageError: `run_dir` has no readable metrics.jsonl.
    """
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UsageError(f"{path}: no metrics (has this run logged a step yet?)")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"{path}: cannot read metrics: {exc.strerror or exc}") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # empty, or cut by a kill
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per plot that has data next to `metrics.jsonl`; returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)  # before matplotlib: a wrong folder fails at once
    # matplotlib logs at INFO (the first import on a machine: "generated new fontManager"),
    # which is no news to a user; warnings still show
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for plot in plots_for(records):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        drawn = False
        for series in plot.series:
            points = series_points(records, series)
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=series.label)
                drawn = True
        if drawn:
            ax.set_title(plot.title)
            ax.set_xlabel("step")
            ax.set_ylabel(plot.ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(run_dir / plot.name)
            written.append(run_dir / plot.name)
        plt.close(fig)
    return written


# One color per part of `hpctrain.resilience.goodput.PARTS`, useful work first.
GOODPUT_COLORS = {
    "productive": "#2ca02c",
    "data_wait": "#bcbd22",
    "checkpoint": "#1f77b4",
    "evaluation": "#17becf",
    "lost": "#d62728",
    "hung": "#e377c2",
    "startup": "#ff7f0e",
    "loop_overhead": "#9467bd",
    "tail": "#8c564b",
    "idle": "#7f7f7f",
}


def plot_goodput(
    bars: list[tuple[str, dict[str, float]]],
    labels: dict[str, str],
    unit: str,
    title: str,
    path: Path,
) -> Path:
    """A stacked bar per attempt (and per job script's time around them): its hours by part.

    Args:
        bars: (bar label, {part: hours}) in the order to draw.
        labels: the legend's words for each part.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars) + 3), 4.5), dpi=100)
    positions = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    for part, color in GOODPUT_COLORS.items():
        heights = [hours.get(part, 0.0) for _, hours in bars]
        if any(heights):
            ax.bar(positions, heights, bottom=bottoms, color=color, label=labels.get(part, part))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(positions, [label for label, _ in bars], rotation=30, ha="right")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
