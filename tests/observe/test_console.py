"""The console line of a training record: where the run is (step/total, epoch/total), how
fast, and when it will end (#43 item 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpctrain.observe.metrics import Eta, MetricsWriter, console_line, format_duration


def train_record(step: int, epoch: int, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "step": step,
        "epoch": epoch,
        "loss": 0.5,
        "lr": 1e-3,
        "samples_per_s": 250.0,
        "data_wait_fraction": 0.01,
        "data_wait_fraction_worst": 0.02,
        "step_time_s": 0.2,
        **extra,
    }


def test_the_line_shows_step_and_epoch_of_their_totals_and_an_eta() -> None:
    line = console_line(train_record(300, 7), 1000, 24, eta_s=3725.0)
    assert line.startswith("step 300/1000 epoch 8/24 loss 0.5000 lr 1.00e-03 250.0 samples/s")
    assert line.endswith("step 200 ms ETA 1:02:05")


def test_a_causal_lm_line_counts_tokens_and_an_unknown_epoch_total_is_left_out() -> None:
    line = console_line(train_record(3, 0, tokens_per_s=51234.4), 10, 0, eta_s=65.0)
    assert "step 3/10 epoch 1 loss" in line and "51234 tokens/s" in line
    assert "samples/s" not in line and line.endswith("ETA 1:05")


def test_the_eta_follows_the_recent_wall_time_per_step() -> None:
    eta = Eta(total_steps=100, window=3)
    assert eta.update(10, step_time_s=0.5, now=0.0) == 90 * 0.5  # one record: the step time
    assert eta.update(20, step_time_s=0.5, now=20.0) == 80 * 2.0  # an evaluation was in there
    assert eta.update(30, step_time_s=0.5, now=30.0) == 70 * 1.5
    assert eta.update(40, step_time_s=0.5, now=40.0) == 60 * 1.0  # the window forgot it
    assert eta.update(100, step_time_s=0.5, now=100.0) == 0.0
    assert [format_duration(s) for s in (0, 59.6, 3600, 90061)] == [
        "0:00",
        "1:00",
        "1:00:00",
        "25:01:01",
    ]


def test_the_writer_prints_the_line_from_the_run_s_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = MetricsWriter(
        tmp_path, enabled=True, progress="lines", total_steps=40, tensorboard=False, num_epochs=4
    )
    writer.write(train_record(10, 0))
    writer.write(train_record(20, 1))
    writer.close()
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("step 10/40 epoch 1/4 ") and first.endswith("ETA 0:06")  # 30 x 0.2 s
    assert second.startswith("step 20/40 epoch 2/4 ") and " ETA 0:0" in second


def test_an_evaluation_line_counts_epochs_as_the_training_lines_and_counts_as_integers() -> None:
    """A run of 10 epochs showed `epoch 10/10` while training and `epoch=9` in its evaluation,
    and `val_samples=30.0000` (#49)."""
    from hpctrain.observe.metrics import eval_line

    record = {
        "kind": "eval",
        "step": 40,
        "epoch": 9,
        "val_loss": 0.5,
        "val_accuracy": 1.0,
        "val_samples": 30.0,
        "val_tokens_per_s": 1234.5,
    }
    assert eval_line(record, 10) == (
        "eval step=40 epoch=10/10 val_loss=0.5000 val_accuracy=1.0000 val_samples=30 "
        "val_tokens_per_s=1234.5000"
    )
