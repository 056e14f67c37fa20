"""The trainer in this process (no process group): precision, accumulation, the fp16 scaler
in checkpoints, the custom task, metrics, determinism, overfit, debug, epochs, channels_last."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.distributed import resolve_env
from hpctrain.train.trainer import Trainer
from tests.support import mlp_tasks as tasks
from tests.support.train_kit import REPO

CPU = torch.device("cpu")
MLP = "examples.custom_task:ThumbnailMLP"

TRAIN_FIELDS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "step_time_s",
    "data_wait_fraction",
    "data_wait_fraction_worst",
    "peak_memory_mb",
    "samples_seen",
    "loader_retries",
    "loader_shards_failed",
    "loader_samples_lost",
}


def make_config(shards: Path, run_dir: Path, *overrides: str) -> Config:
    """A tiny, fast in-process run on the custom-task MLP (override `task` for others)."""
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"task={MLP}",
            "task_options.hidden=32",
            f"data.train={shards / 'train' / 'index.json'}",
            f"data.val={shards / 'val' / 'index.json'}",
            "data.batch_size=16",
            "data.workers_per_rank=0",
            "data.shuffle_buffer=16",
            "model.image_size=16",
            "train.max_steps=4",
            "train.log_every=1",
            "train.lr=0.01",
            "train.strategy=none",
            "train.deterministic=true",
            "logging.progress=lines",
            *overrides,
        ],
    )


def build(cfg: Config) -> Trainer:
    return Trainer(cfg, resolve_env({}), CPU)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_single_process_precisions_train_finite(
    shapes_shards: Path, tmp_path: Path, precision: str
) -> None:
    trainer = build(make_config(shapes_shards, tmp_path, f"train.precision={precision}"))
    before = weights(trainer)
    assert trainer.fit() == 0
    after = weights(trainer)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before), "nothing trained"
    assert all(r["loss"] == r["loss"] for r in train_records(tmp_path))  # no NaN


def test_custom_task_loss_falls_and_metrics_have_every_field(
    shapes_shards: Path, tmp_path: Path
) -> None:
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "train.max_steps=60",
        "train.lr=0.01",
        "train.schedule=constant",
        "task_options.hidden=128",
        "data.batch_size=32",
    )
    assert build(cfg).fit() == 0
    records = train_records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 61))
    for r in records:
        assert r.keys() >= TRAIN_FIELDS, f"missing {TRAIN_FIELDS - r.keys()}"
        assert 0.0 <= r["data_wait_fraction"] <= r["data_wait_fraction_worst"] <= 1.0
        assert r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_memory_mb"] > 0
        assert r["grad_norm"] > 0 and r["lr"] > 0
    first = sum(r["loss"] for r in records[:10]) / 10
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last < first - 0.2, f"loss did not fall: {first:.3f} -> {last:.3f}"
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[-1]["val_samples"] == 80 and 0 <= evals[-1]["val_accuracy"] <= 1


def test_gradient_accumulation_equals_one_step_on_the_larger_batch(
    shapes_shards: Path, tmp_path: Path
) -> None:
    common = ("train.optimizer=sgd", "train.lr=0.1", "data.val=")
    accumulated = build(
        make_config(shapes_shards, tmp_path / "a", *common, "train.grad_accum_steps=4")
    )
    single = build(make_config(shapes_shards, tmp_path / "b", *common, "data.batch_size=64"))
    single.loader.set_epoch(0)
    batches = [b for _, b in zip(range(2), single.loader, strict=False)]
    assert all(len(b["key"]) == 64 for b in batches)

    def quarters(batch: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v[i * 16 : (i + 1) * 16] for k, v in batch.items()} for i in range(4)]

    initial = weights(single)
    assert all(torch.equal(v, initial[k]) for k, v in weights(accumulated).items())
    for batch in batches:  # two steps: momentum carries the first step's gradient
        accumulated.train_step(iter(quarters(batch)))
        single.train_step(iter([batch]))
    for name, value in weights(single).items():
        torch.testing.assert_close(weights(accumulated)[name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights(single)["1.weight"], initial["1.weight"]), "nothing trained"


def test_fp16_grad_scaler_state_survives_a_checkpoint_round_trip(
    shapes_shards: Path, tmp_path: Path
) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        if torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype != torch.float16:
            pytest.skip("this torch has no fp16 autocast on CPU")
    cfg = make_config(shapes_shards, tmp_path, "train.precision=fp16", "train.max_steps=3")
    first = build(cfg)
    assert first.scaler is not None
    assert first.fit() == 0
    saved = first.scaler.state_dict()
    assert saved["_growth_tracker"] == 3  # three finite steps since the last change of scale
    resumed = build(cfg)
    assert resumed.scaler is not None and resumed.scaler.state_dict() != saved
    resumed.resume()
    assert resumed.scaler.state_dict() == saved
    assert resumed.state.step == 3


def test_same_seed_twice_gives_bitwise_equal_weights(shapes_shards: Path, tmp_path: Path) -> None:
    # Real worker processes and the random jitter of the custom task's transform.
    overrides = ("data.workers_per_rank=1", "train.max_steps=5", "data.val=")
    runs = []
    for name in ("a", "b"):
        trainer = build(make_config(shapes_shards, tmp_path / name, *overrides))
        assert trainer.fit() == 0
        runs.append(weights(trainer))
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name
    other = build(make_config(shapes_shards, tmp_path / "c", *overrides, "seed=1"))
    assert not torch.equal(weights(other)["1.weight"], runs[0]["1.weight"])


def test_overfit_one_batch_drives_the_loss_near_zero(shapes_shards: Path, tmp_path: Path) -> None:
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "train.overfit_batches=1",
        "train.max_steps=60",
        "train.schedule=constant",
        "task_options.hidden=64",
        "data.val=",
        "train.log_every=10",
    )
    assert build(cfg).fit() == 0
    losses = [r["loss"] for r in train_records(tmp_path)]
    assert losses[-1] < 0.05, losses


def test_max_epochs_runs_whole_epochs(
    shapes_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "train.max_steps=0",
        "train.max_epochs=2",
        "data.batch_size=64",
        "data.val=",
        "data.sample_log=true",
    )
    trainer = build(cfg)
    assert trainer.steps_per_epoch == 320 // 64
    assert trainer.fit() == 0
    assert trainer.state.step == 2 * trainer.steps_per_epoch
    lines = read_jsonl(tmp_path / "samples" / "rank-0.jsonl")
    by_epoch: dict[int, list[str]] = {}
    for line in lines:
        by_epoch.setdefault(line["epoch"], []).extend(line["keys"])
    assert sorted(by_epoch) == [0, 1]
    assert len(by_epoch[0]) == len(set(by_epoch[0])) == 320
    assert sorted(by_epoch[0]) == sorted(by_epoch[1]) and by_epoch[0] != by_epoch[1]
    # the console says where the run is and when it ends (#43 item 10)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" loss ")[0] for line in lines[4:6]] == [
        "step 5/10 epoch 1/2",
        "step 6/10 epoch 2/2",
    ]
    assert lines[-1].startswith("step 10/10 epoch 2/2 ") and lines[-1].endswith(" ETA 0:00")


def test_channels_last_converts_the_model(shapes_shards: Path, tmp_path: Path) -> None:
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "task=image_classification",
        "model.name=small_cnn",
        "model.channels_last=true",
        "train.max_steps=1",
        "data.val=",
    )
    trainer = build(cfg)
    conv = trainer.model.blocks[0][0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and conv.shape[1] == 3
    assert trainer.fit() == 0
    assert torch.isfinite(conv).all()


def test_tensorboard_missing_is_a_config_error_before_any_work(
    shapes_shards: Path, tmp_path: Path
) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        cfg = make_config(shapes_shards, tmp_path, "logging.tensorboard=true", "data.val=")
        assert build(cfg).fit() == 0
        assert any((tmp_path / "tensorboard").iterdir())
        return
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs the tensorboard"):
        build(make_config(shapes_shards, tmp_path, "logging.tensorboard=true"))
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_debug_flag_loads_in_process_with_anomaly_detection(
    shapes_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpctrain.cli.main import main

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    tasks.SEEN["anomaly"].clear()
    tasks.SEEN["transform_pids"].clear()
    code = main(
        [
            "train",
            str(REPO / "configs" / "demo.yaml"),
            f"run_dir={tmp_path}",
            "task=tests.support.mlp_tasks:RecordingMLP",
            f"data.train={shapes_shards / 'train' / 'index.json'}",
            "data.val=",
            "checkpoint.monitor=",  # the demo config ranks checkpoints by val_accuracy
            "checkpoint.keep_best=0",
            "data.batch_size=16",
            "data.workers_per_rank=2",
            "train.max_steps=3",
            "train.warmup_steps=0",
            "logging.progress=lines",
            "--debug",
        ]
    )
    assert code == 0
    assert tasks.SEEN["anomaly"] == [True] * 3
    assert tasks.SEEN["transform_pids"] == {os.getpid()}, "debug mode must load in-process"
    assert not torch.is_anomaly_enabled(), "anomaly detection must end with the run"
    assert len(train_records(tmp_path)) == 3


def test_tensorboard_scalars_when_installed(
    shapes_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's calls, through a stand-in `torch.utils.tensorboard` (not installed here)."""
    import sys
    import types

    calls: list[tuple[str, float, int]] = []

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            assert log_dir.endswith("tensorboard")
            calls.append(("dir", 0.0, 0))

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            calls.append((tag, value, step))

        def close(self) -> None:
            calls.append(("closed", 0.0, 0))

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    cfg = make_config(shapes_shards, tmp_path, "logging.tensorboard=true", "train.max_steps=2")
    assert build(cfg).fit() == 0
    tags = {tag for tag, _, _ in calls}
    assert {"dir", "closed", "train/loss", "train/data_wait_fraction", "eval/val_loss"} <= tags
    assert [step for tag, _, step in calls if tag == "train/loss"] == [1, 2]


@pytest.mark.parametrize("workers", [0, 1])
def test_task_decode_collate_and_summarize_hooks_are_used(
    shapes_shards: Path, tmp_path: Path, workers: int
) -> None:
    run_dir = tmp_path / "hooks"
    cfg = make_config(
        shapes_shards,
        run_dir,
        "task=tests.support.mlp_tasks:HookedMLP",
        f"data.workers_per_rank={workers}",
        "train.max_steps=2",
    )
    assert build(cfg).fit() == 0
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["members"] for r in records if r["kind"] == "train"] == [2.0, 2.0]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert final["val_counted"] == final["val_samples"] == 80  # padding left out
    assert final["val_classes_seen"] == 10 and 0 <= final["val_accuracy"] <= 1


def test_the_samples_remainder_drop_leaves_out_are_logged_at_the_start(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    with caplog.at_level(logging.INFO):
        build(make_config(shapes_shards, tmp_path, "data.batch_size=120", "data.val="))
    dropped = [r for r in caplog.records if "data.remainder=drop" in r.getMessage()]
    assert [r.levelname for r in dropped] == ["WARNING"]  # a quarter of the data: loud
    assert dropped[0].getMessage() == (
        "data.remainder=drop: 80 of 320 samples, 25%, do not fill a batch on every rank and "
        "are left out of each epoch, a different 80 each epoch (data.remainder=pad keeps "
        "them, as padding)"
    )


def test_checkpoint_final_false_saves_nothing_at_the_end(
    shapes_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A benchmark's run (#38 item 11): no final checkpoint, also with a monitor whose final
    evaluation has no saved step to annotate; a preemption would still save."""
    cfg = make_config(
        shapes_shards,
        tmp_path / "run",
        "checkpoint.final=false",
        "checkpoint.monitor=val_accuracy",
        "train.max_steps=2",
    )
    assert build(cfg).fit() == 0
    assert list((tmp_path / "run" / "checkpoints").glob("step-*")) == []
    out = capsys.readouterr().out
    assert "checkpoint: none saved (checkpoint.final=false)" in out
    assert [r["kind"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")][-1] == "eval"
