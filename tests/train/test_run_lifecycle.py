"""Starting, resuming and ending a run in this process: a fresh start over an older run's
checkpoints, validation data without sequences, resumes that fail or change precision,
the evaluations at the end."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from examples.custom_task import ThumbnailMLP
from torch import nn

from hpctrain.checkpoint import CheckpointError
from hpctrain.config import Config, ConfigError, load_config
from hpctrain.data.mixture import MixtureError
from hpctrain.distributed import resolve_env
from hpctrain.errors import EXIT_DATA
from hpctrain.inference.evaluate import run_eval
from hpctrain.tasks.classes import ClassNamesError
from hpctrain.train.trainer import Trainer
from tests.support import lm_kit
from tests.support.train_kit import REPO, run_hpctrain

CPU = torch.device("cpu")
MLP = "examples.custom_task:ThumbnailMLP"


def make_config(shards: Path, run_dir: Path, *overrides: str) -> Config:
    """A tiny in-process run on the custom-task MLP, saving every 2 steps."""
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"task={MLP}",
            "task_options.hidden=16",
            f"data.train={shards / 'train' / 'index.json'}",
            "data.batch_size=16",
            "data.workers_per_rank=0",
            "data.shuffle_buffer=16",
            "model.image_size=16",
            "train.max_steps=4",
            "train.strategy=none",
            "checkpoint.every_steps=2",
            "checkpoint.keep_last=10",
            "logging.progress=lines",
            *overrides,
        ],
    )


def fit(cfg: Config) -> Trainer:
    trainer = Trainer(cfg, resolve_env({}), CPU)
    assert trainer.fit() == 0
    return trainer


def saved_seed(step_dir: Path) -> int:
    """The `seed` of the config the run that saved `step_dir` had."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    seeds = [
        line for line in manifest["metadata"]["config"].splitlines() if line.startswith("seed:")
    ]
    return int(seeds[0].split(":")[1])


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("new_steps", [2, 6])
def test_resume_none_sets_the_older_runs_checkpoints_aside(
    shapes_shards: Path, tmp_path: Path, new_steps: int, caplog: pytest.LogCaptureFixture
) -> None:
    fit(make_config(shapes_shards, tmp_path, "seed=1"))
    root = tmp_path / "checkpoints"
    assert {"step-2", "step-4"} <= names(root)
    with caplog.at_level(logging.WARNING):
        fresh = make_config(
            shapes_shards,
            tmp_path,
            "seed=7",
            f"train.max_steps={new_steps}",
            "checkpoint.resume=none",
        )
        fit(fresh)
    steps = sorted(n for n in names(root) if n.startswith("step-"))
    assert steps == sorted(f"step-{s}" for s in range(2, new_steps + 1, 2))
    assert all(saved_seed(root / s) == 7 for s in steps), "the older run's steps are mixed in"
    assert (root / "latest").read_text().strip() == f"step-{new_steps}"
    # Nothing of the older run is deleted; the log names each one set aside.
    assert {".abandoned-step-2", ".abandoned-step-4"} <= names(root)
    assert saved_seed(root / ".abandoned-step-4") == 1
    text = caplog.text
    assert "set aside step-2" in text and "set aside step-4" in text and "--resume none" in text
    # The next start resumes the new run, not the older one.
    again = Trainer(
        make_config(shapes_shards, tmp_path, "seed=7", f"train.max_steps={new_steps}"),
        resolve_env({}),
        CPU,
    )
    again.resume()
    assert again.state.step == new_steps
    assert again.checkpoints.loaded_manifest is not None
    assert again.checkpoints.loaded_manifest["metadata"]["config"] == saved_config(root, new_steps)
    again.checkpoints.close()


@pytest.mark.parametrize("source", ["run", "step-2"])
def test_resume_none_warm_starting_from_its_own_run_reads_the_weights_first(
    shapes_shards: Path, tmp_path: Path, source: str
) -> None:
    # #37 item 9: `--resume none` set the checkpoints aside, then failed to read the one
    # model.init_from named in the same folder: nothing committed was left to start from.
    fit(make_config(shapes_shards, tmp_path, "seed=1"))
    root = tmp_path / "checkpoints"
    init_from = tmp_path if source == "run" else root / source
    expected = "step-4" if source == "run" else source
    fresh = Trainer(
        make_config(
            shapes_shards,
            tmp_path,
            "seed=7",
            "train.max_steps=2",
            "checkpoint.resume=none",
            f"model.init_from={init_from}",
        ),
        resolve_env({}),
        CPU,
    )
    fresh.resume()
    assert fresh.state.step == 0  # a new run: step 0, fresh optimizer
    copy = make_config(shapes_shards, tmp_path / "copy", "seed=1")
    source_run = Trainer(copy, resolve_env({}), CPU)
    shutil.copytree(root / f".abandoned-{expected}", tmp_path / "copy" / "checkpoints" / expected)
    source_run.resume()  # the source step's weights, as a plain resume reads them
    for name, value in source_run.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name
    source_run.checkpoints.close()
    # the older run's checkpoints are set aside (kept), not lost: the new run's are its own
    assert {".abandoned-step-2", ".abandoned-step-4"} <= names(root)
    assert not {"step-2", "step-4", "latest"} & names(root)
    fresh.checkpoints.close()


def saved_config(root: Path, step: int) -> Any:
    return json.loads((root / f"step-{step}" / "manifest.json").read_text())["metadata"]["config"]


# ---------------------------------------------------------------- validation data, the end


def lm_config(run_dir: Path, train: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            "task=causal_lm",
            f"data.train={train}",
            f"data.seq_len={lm_kit.SEQ_LEN}",
            "data.batch_size=4",
            "data.workers_per_rank=0",
            "causal_lm.dim=16",
            "causal_lm.n_layers=1",
            "causal_lm.n_heads=2",
            "train.max_steps=1",
            "train.strategy=none",
            "logging.progress=lines",
            *overrides,
        ],
    )


def test_validation_data_without_a_sequence_is_refused_before_training_and_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = lm_kit.write_token_shards(tmp_path / "train", 1, seed=1)
    monkeypatch.setattr(lm_kit, "TOKENS_PER_SHARD", lm_kit.SEQ_LEN)  # one id short
    val = lm_kit.write_token_shards(tmp_path / "val", 2, seed=2)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        Trainer(lm_config(run_dir, train, f"data.val={val}"), resolve_env({}), CPU)
    assert str(info.value) == (
        f"data.val={val}: no sequence of data.seq_len={lm_kit.SEQ_LEN}: every shard holds "
        f"fewer than {lm_kit.SEQ_LEN + 1} tokens (lower data.seq_len or give more text)"
    )
    assert not (run_dir / "checkpoints").exists()  # refused before any training
    fit(lm_config(run_dir, train))  # without data.val: a checkpoint to evaluate
    with pytest.raises(ConfigError, match=r"^data.val=.*: no sequence of data.seq_len=32"):
        run_eval(lm_config(run_dir, train, f"data.val={val}"))


def test_eval_runs_with_the_kernel_settings_of_the_training(tmp_path: Path) -> None:
    """eval and predict set torch's kernels as training does (`configure_backends`): here
    `train.deterministic`, observable on a CPU (TF32 and cuDNN's autotuner for GPUs come
    from the same call: tests/parallel/test_precision.py). Before, they set nothing."""
    train = lm_kit.write_token_shards(tmp_path / "train", 1, seed=1)
    run_dir = tmp_path / "run"
    fit(lm_config(run_dir, train))
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        cfg = lm_config(run_dir, train, f"data.val={train}", "train.deterministic=true")
        assert run_eval(cfg) == 0
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(saved)


class FailingEvalMLP(ThumbnailMLP):
    """The custom-task MLP whose evaluation fails (a bug in a user's metrics)."""

    def eval_metrics(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise RuntimeError("a bug in eval_metrics")


def test_the_last_step_is_saved_before_the_final_evaluation(
    shapes_shards: Path, tmp_path: Path
) -> None:
    cfg = make_config(
        shapes_shards,
        tmp_path,
        f"task={__name__}:FailingEvalMLP",
        f"data.val={shapes_shards / 'val' / 'index.json'}",
        "train.max_steps=3",
        "train.eval_every=0",
    )
    with pytest.raises(RuntimeError, match="a bug in eval_metrics"):
        Trainer(cfg, resolve_env({}), CPU).fit()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-3"


def test_the_final_evaluation_scores_the_last_checkpoint(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """Saved before its evaluation, the last step still gets its score and `best`."""
    trainer = fit(
        make_config(
            shapes_shards,
            tmp_path,
            f"data.val={shapes_shards / 'val' / 'index.json'}",
            "train.max_steps=3",
            "train.eval_every=0",
            "checkpoint.every_steps=0",
            "checkpoint.monitor=val_accuracy",
            "checkpoint.keep_best=1",
        )
    )
    root = tmp_path / "checkpoints"
    manifest = json.loads((root / "step-3" / "manifest.json").read_text())
    assert manifest["score"] == {"monitor": "val_accuracy", "value": trainer.monitor.best[0]}
    assert manifest["metadata"]["monitor"] == trainer.monitor.state_dict()
    assert (root / "best").read_text().strip() == "step-3"


# ---------------------------------------------------------------- resumes


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("task_options.hidden=8", "task_options.hidden=8 (saved: 16)"),
        ("train.optimizer=sgd", "train.optimizer='sgd' (saved: 'adamw')"),
    ],
)
def test_a_failed_resume_names_the_changed_key_and_keeps_config_yaml(
    shapes_shards: Path, tmp_path: Path, change: str, named: str
) -> None:
    fit(make_config(shapes_shards, tmp_path, "train.max_steps=2"))
    saved = (tmp_path / "config.yaml").read_text()
    with pytest.raises(CheckpointError) as info:
        Trainer(make_config(shapes_shards, tmp_path, change), resolve_env({}), CPU).fit()
    message = str(info.value)
    # the cause first, torch's words ("Missing key ...") after it (#49)
    assert "step-2: the config differs from the checkpoint's in " in message
    assert "\n" not in message
    assert named in message and "train.max_steps=4 (saved: 2)" in message
    assert "--checkpoint none (the load failed: " in message
    assert (tmp_path / "config.yaml").read_text() == saved  # `eval` of the run still works


@pytest.mark.parametrize("saved_precision", ["fp32", "bf16"])
def test_a_resume_into_fp16_starts_a_fresh_gradient_scaler(
    shapes_shards: Path, tmp_path: Path, saved_precision: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Moving a run from an A100 (bf16) to a V100 (fp16): the checkpoint has no scaler."""
    with torch.autocast("cpu", dtype=torch.float16):
        if torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype != torch.float16:
            pytest.skip("this torch has no fp16 autocast on CPU")
    fit(
        make_config(
            shapes_shards, tmp_path, f"train.precision={saved_precision}", "train.max_steps=1"
        )
    )
    with caplog.at_level(logging.WARNING):
        resumed = fit(
            make_config(shapes_shards, tmp_path, "train.precision=fp16", "train.max_steps=2")
        )
    assert resumed.state.step == 2 and resumed.scaler is not None
    assert "the checkpoint of step 1 has no fp16 gradient scaler" in caplog.text
    # ... and the scaler saved from then on comes back on the next resume
    again = Trainer(
        make_config(shapes_shards, tmp_path, "train.precision=fp16", "train.max_steps=2"),
        resolve_env({}),
        CPU,
    )
    again.resume()
    assert "scaler" not in again.checkpoints.missing_states
    again.checkpoints.close()


def test_a_resume_with_an_added_mixture_source_plans_it_from_the_next_epoch(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    curated, web = shapes_shards / "train", shapes_shards / "val"
    two = f"{{path: {curated}, name: curated}}, {{path: {web}, name: web}}"
    fit(make_config(shapes_shards, tmp_path, f"data.train=[{two}]", "train.max_steps=2"))
    three = f"data.train=[{two}, {{path: {web}, name: extra}}]"
    with caplog.at_level(logging.INFO):
        resumed = fit(make_config(shapes_shards, tmp_path, three, "train.log_every=1"))
    assert "mixture sources added (extra) at epoch 0: epoch 1 starts a new plan" in caplog.text
    assert resumed.state.step == 4 and resumed.state.epoch == 1  # epoch 0 ended at step 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    assert last["samples_seen/extra"] > 0
    # Other changes are refused, naming the sources and the way on.
    one = f"data.train=[{{path: {curated}, name: curated}}, {{path: {web}, name: other}}]"
    with pytest.raises(MixtureError) as info:  # a data error: exit 3
        fit(make_config(shapes_shards, tmp_path, one))
    message = str(info.value)
    assert message.startswith(
        "the mixture's sources changed since the checkpoint: removed web; removed extra; "
        "added other before them."
    )
    assert "the saved sources (curated, web, extra) unchanged and in that order" in message
    assert "--resume none" in message and "other shards" not in message
    bigger = f"data.train=[{{path: {curated}, name: curated}}, {{path: {curated}, name: web}}]"
    with pytest.raises(MixtureError, match=r"changed web \(2 -> 8 shards, 80 -> 320 samples\)"):
        fit(make_config(shapes_shards, tmp_path, bigger))


@pytest.mark.parametrize(("max_steps", "evaluated"), [(4, [2, 4]), (5, [2, 4, 5])])
def test_the_last_step_is_evaluated_once(
    shapes_shards: Path, tmp_path: Path, max_steps: int, evaluated: list[int]
) -> None:
    fit(
        make_config(
            shapes_shards,
            tmp_path,
            f"data.val={shapes_shards / 'val' / 'index.json'}",
            f"train.max_steps={max_steps}",
            "train.eval_every=2",
        )
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == evaluated


def test_a_step_both_best_and_due_is_saved_once(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An evaluation among the best saves the step; the periodic save of that step is the same
    save, not a second attempt ("already committed; not saved again" after every evaluation)."""
    with caplog.at_level(logging.INFO):
        fit(
            make_config(
                shapes_shards,
                tmp_path,
                f"data.val={shapes_shards / 'val' / 'index.json'}",
                "train.eval_every=2",
                "checkpoint.monitor=val_loss",
                "checkpoint.keep_best=1",
            )
        )
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "not saved again" in m], messages
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-4"]


def test_a_resume_is_logged_once_with_its_checkpoint(
    shapes_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fit(make_config(shapes_shards, tmp_path, "train.max_steps=2"))
    with caplog.at_level(logging.INFO):
        fit(make_config(shapes_shards, tmp_path, "train.max_steps=3"))
    resumed = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert resumed == [f"resumed from step 2 (epoch 0) of {tmp_path / 'checkpoints' / 'step-2'}"]


@pytest.mark.distributed
def test_local_ranks_say_how_they_were_started(tmp_path: Path) -> None:
    """`--nproc 2` spawns the ranks itself: no torchrun is involved (a data error ends them)."""
    proc = run_hpctrain(
        "train",
        str(REPO / "configs" / "demo.yaml"),
        f"run_dir={tmp_path / 'run'}",
        f"data.train={tmp_path / 'nope' / 'index.json'}",
        "--nproc",
        "2",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "[rank 0] INFO rank 0/2 on cpu (local spawn: hpctrain train --nproc 2)" in proc.stderr
    assert "torchrun" not in proc.stderr


def test_a_resume_on_data_of_other_classes_is_refused_before_any_step(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """Sibling of #31 items 6, 7: data.train re-converted with its classes renamed or reordered
    resumed and trained on shifted labels (the checkpoint's class 1 is now another class)."""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    shutil.copytree(shapes_shards / "train", data / "train")
    fit(make_config(data, run_dir, "train.max_steps=2"))
    saved_config = (run_dir / "config.yaml").read_text()
    index_path = data / "train" / "index.json"
    index = json.loads(index_path.read_text())
    saved = index["class_names"]
    index["class_names"] = saved[::-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ClassNamesError) as info:
        fit(make_config(data, run_dir))
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == EXIT_DATA
    assert (
        f"data.train names the classes {saved[::-1]}, the checkpoint of step 2 {saved}" in message
    )
    assert "--resume none" in message
    assert not (run_dir / "checkpoints" / "step-4").exists()  # not a step trained
    assert (run_dir / "config.yaml").read_text() == saved_config
    # A checkpoint saved before class names were stored resumes as before.
    manifest_path = run_dir / "checkpoints" / "step-2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["metadata"]["class_names"]
    manifest_path.write_text(json.dumps(manifest))
    assert fit(make_config(data, run_dir)).state.step == 4


def test_a_finished_run_started_again_says_it_is_complete_and_trains_nothing(
    shapes_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_config(shapes_shards, tmp_path, "train.max_steps=2")
    fit(cfg)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    trainer = fit(cfg)
    out = capsys.readouterr().out
    assert out.strip() == (
        f"run complete: {tmp_path} is at step 2 of 2 (train.max_steps=2): nothing trained; "
        "to train further, a larger train.max_steps; to start again, another run_dir "
        "(or --checkpoint none)"
    )
    assert trainer.state.step == 2
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in steps if "loss" in r or "val_loss" in r] == [
        r
        for r in (json.loads(line) for line in metrics.splitlines())
        if "loss" in r or "val_loss" in r
    ]  # no step and no evaluation added


def test_a_batch_larger_than_the_data_says_so_in_the_user_s_words(
    shapes_shards: Path, tmp_path: Path
) -> None:
    """Not `fewer than train.grad_accum_steps=1 batches per epoch` (#49)."""
    index = shapes_shards / "train" / "index.json"
    num = sum(s["num_samples"] for s in json.loads(index.read_text())["shards"])
    cfg = make_config(shapes_shards, tmp_path, f"data.batch_size={num + 1}")
    with pytest.raises(ConfigError) as info:
        Trainer(cfg, resolve_env({}), CPU)
    assert str(info.value) == (
        f"data.batch_size={num + 1}: batch_size {num + 1} > {num} samples per rank "
        f"({index}: {num} over 1 rank(s)); set data.batch_size to {num} or less"
    )
    cfg = make_config(
        shapes_shards, tmp_path, "data.batch_size=16", f"train.grad_accum_steps={num}"
    )
    with pytest.raises(ConfigError, match=rf"train.grad_accum_steps={num} batches of 16 "):
        Trainer(cfg, resolve_env({}), CPU)


def test_a_long_evaluation_says_where_it_is(
    shapes_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The final evaluation of a resnet50 fine-tune was 58 s without a word (#49): a line when
    it starts, and its count, rate and ETA while it lasts (here every batch: no quiet time)."""
    from hpctrain.observe import waits

    monkeypatch.setattr(waits, "QUIET_S", 0.0)
    val = f"data.val={shapes_shards / 'val' / 'index.json'}"
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        fit(make_config(shapes_shards, tmp_path, "train.max_steps=2", val, "train.eval_every=0"))
    said = [r.getMessage() for r in caplog.records]
    assert "final evaluation of step 2 on data.val" in said
    progress = [m for m in said if m.startswith("evaluation of step 2: ")]
    assert progress and "batches/s" in progress[-1] and "ETA" in progress[-1]
