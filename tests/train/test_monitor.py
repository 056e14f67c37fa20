"""MetricMonitor: which evaluations are among the best, early stopping, resumed state."""

from __future__ import annotations

import math

import pytest

from hpctrain.config import ConfigError
from hpctrain.observe.metrics import MetricMonitor


def record(step: int, value: float) -> dict:
    return {"kind": "eval", "step": step, "epoch": 0, "val_loss": value, "val_accuracy": 1 - value}


def test_keep_best_says_when_to_save_and_patience_when_to_stop():
    monitor = MetricMonitor("val_loss", mode="min", keep_best=2, patience=2)
    enters = [monitor.observe(record(s, v)) for s, v in [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.8)]]
    # 0.9 and 0.5 fill the two places; 0.7 beats 0.9; 0.8 is worse than both kept (0.5, 0.7)
    assert enters == [True, True, True, False]
    assert monitor.best == [0.5, 0.7]
    assert monitor.evals_since_best == 2 and monitor.should_stop  # 0.7, 0.8: not below 0.5
    assert monitor.score_at(4) == 0.8 and monitor.score_at(3) is None


def test_state_continues_after_a_resume_and_nan_is_never_best():
    monitor = MetricMonitor("val_accuracy", mode="max", keep_best=1, patience=3)
    monitor.observe(record(1, 0.5))  # accuracy 0.5
    monitor.observe(record(2, 0.6))  # accuracy 0.4: no better
    resumed = MetricMonitor("val_accuracy", mode="max", keep_best=1, patience=3)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.best == [0.5] and resumed.evals_since_best == 1
    assert not resumed.observe({"kind": "eval", "step": 3, "val_accuracy": math.nan})
    assert not resumed.should_stop
    assert not resumed.observe(record(4, 0.9))
    assert resumed.should_stop
    other = MetricMonitor("val_loss", mode="min")
    other.load_state_dict(monitor.state_dict())  # another metric: starts afresh
    assert other.best == [] and other.evals_since_best == 0


def test_misconfigured_monitor_is_named():
    with pytest.raises(ConfigError, match="checkpoint.keep_best needs checkpoint.monitor"):
        MetricMonitor("", keep_best=2)
    with pytest.raises(ConfigError, match="train.early_stop_patience needs checkpoint.monitor"):
        MetricMonitor("", patience=2)
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.monitor='val_acc': not in the evaluation record \(val_loss, val_accuracy\)",
    ):
        MetricMonitor("val_acc").observe(record(1, 0.5))
    assert not MetricMonitor("").observe(record(1, 0.5))  # off: never saves


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_a_run_stops_early_keeps_its_best_and_profiles_the_chosen_steps(shapes_shards, tmp_path):
    """val_samples never changes: the first evaluation stays the best (a tie goes to the
    earlier step), and two more without a better value stop the run."""
    import json

    from tests.support.train_kit import run_hpctrain, train_args

    run_dir = tmp_path / "run"
    proc = run_hpctrain(
        "train",
        *train_args(
            shapes_shards,
            run_dir,
            "train.max_steps=10",
            "train.eval_every=1",
            "checkpoint.monitor=val_samples",
            "checkpoint.keep_best=1",
            "checkpoint.keep_last=1",
            "train.early_stop_patience=2",
            "profile.steps=2-3",
        ),
    )
    assert "early stop at step 3: 2 evaluations without a better val_samples" in proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 3
    root = run_dir / "checkpoints"
    assert (root / "best").read_text() == "step-1\n"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-1", "step-3"]
    manifest = json.loads((root / "step-3" / "manifest.json").read_text())
    assert manifest["metadata"]["monitor"]["evals_since_best"] >= 2
    trace = json.loads((run_dir / "profile" / "rank-0.steps-2-3.pt.trace.json").read_text())
    assert trace["traceEvents"]


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_monitor_without_validation_data_is_refused(shapes_shards, tmp_path):
    from tests.support.train_kit import run_hpctrain, train_args

    proc = run_hpctrain(
        "train",
        *train_args(shapes_shards, tmp_path / "run", "data.val=", "checkpoint.monitor=val_loss"),
        check=False,
    )
    assert proc.returncode == 2
    assert "checkpoint.monitor=val_loss: needs data.val" in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["task=segmentation", "checkpoint.monitor=val_accuracy"],
         "checkpoint.monitor=val_accuracy: task segmentation reports val_loss, val_mIoU, "
         "val_pixel_accuracy, val_samples (with this config); monitor one of them"),
        (["task=causal_lm", "checkpoint.monitor=val_accuracy"],
         "task causal_lm reports val_loss, val_perplexity, val_targets, val_bits_per_byte, "
         "val_samples"),
        (["task=causal_lm", "data.tokenizer=/x/tokenizer.json", "data.loss_mask=false",
          "checkpoint.monitor=val_bits_per_byte"],
         "task causal_lm reports val_loss, val_perplexity, val_samples"),
        (["classification.multi_label=true", "checkpoint.monitor=val_accuracy"],
         "task image_classification reports val_loss, val_mAP, val_f1, val_f1_micro, "),
        (["task=segmentation", "checkpoint.monitor=val_mIoU"], ""),
        (["task=causal_lm", "checkpoint.monitor=val_perplexity"], ""),
        (["checkpoint.monitor=val_top5"], ""),
        (["checkpoint.monitor=val_samples"], ""),
        # a task that does not declare its metrics: its first evaluation checks the monitor
        (["task=examples.custom_task:ThumbnailMLP", "checkpoint.monitor=val_anything"], ""),
    ],
)  # fmt: skip
def test_a_monitor_the_task_never_reports_is_refused_before_any_work(overrides, refused):
    from hpctrain.config import load_config
    from hpctrain.tasks.task import check_monitor

    cfg = load_config(None, overrides)
    if not refused:
        check_monitor(cfg)
        return
    with pytest.raises(ConfigError) as info:
        check_monitor(cfg)
    assert refused in str(info.value)


def test_the_trainer_and_preflight_refuse_it_before_training(shapes_shards, tmp_path):
    # configs/demo.yaml monitors val_accuracy; with task=segmentation it trained 40 steps,
    # then failed at its first evaluation
    from hpctrain.config import load_config, with_overrides
    from hpctrain.launch.preflight import preflight
    from hpctrain.launch.profiles import load_profile
    from tests.support.train_kit import REPO, tiny_run_overrides
    from tests.train.test_trainer import build

    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        tiny_run_overrides(shapes_shards, tmp_path / "run", "task=segmentation"),
    )
    with pytest.raises(ConfigError, match="checkpoint.monitor=val_accuracy: task segmentation"):
        build(cfg)
    assert not (tmp_path / "run").exists()  # nothing done, nothing written
    checks = preflight(with_overrides(cfg, ["slurm.profile=local-dev"]), load_profile("local-dev"),
                       data=False, environment=False)  # fmt: skip
    monitor = [c for c in checks if c.name == "checkpoint.monitor"]
    assert len(monitor) == 1 and not monitor[0].ok
    assert "task segmentation reports val_loss, val_mIoU" in monitor[0].message
