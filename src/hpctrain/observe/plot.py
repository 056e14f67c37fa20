"""PNG plots of a run's `metrics.jsonl`: loss, accuracy, throughput, data wait; and where its
allocated hours went (`plot_goodput`, from `hpctrain.launch.goodput`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpctrain.errors import UsageError

PLOTS = {
    # file name: (title, [(record kind, field, label)], y label)
    "loss.png": ("Loss", [("train", "loss", "train"), ("eval", "val_loss", "validation")], "loss"),
    "accuracy.png": (
        "Accuracy",
        [("train", "accuracy", "train (batch)"), ("eval", "val_accuracy", "validation")],
        "accuracy",
    ),
    "answers.png": (
        "Answers scored (eval.generate)",
        [
            ("eval", "val_exact_match", "exact match"),
            ("eval", "val_token_f1", "token F1"),
        ],
        "fraction of the validation prompts",
    ),
    "throughput.png": (
        "Throughput",
        [("train", "samples_per_s", "samples/s (all ranks)")],
        "samples/s",
    ),
    "data_wait.png": (
        "Time blocked on the loader",
        [
            ("train", "data_wait_fraction", "mean over ranks"),
            ("train", "data_wait_fraction_worst", "worst rank"),
        ],
        "fraction of step time",
    ),
}


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    written = []
    for name, (title, series, ylabel) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        drawn = False
        for kind, field, label in series:
            points = [
                (r["step"], r[field])
                for r in records
                if r.get("kind", "train") == kind and field in r
            ]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=label)
                drawn = True
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(run_dir / name)
            written.append(run_dir / name)
        plt.close(fig)
    return written


# One color per part of `hpctrain.launch.goodput.PARTS`, useful work first.
GOODPUT_COLORS = {
    "productive": "#2ca02c",
    "data_wait": "#bcbd22",
    "checkpoint": "#1f77b4",
    "evaluation": "#17becf",
    "lost": "#d62728",
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
