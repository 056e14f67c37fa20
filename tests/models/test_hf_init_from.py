"""`model.init_from` besides Hugging Face folders: torchvision state dicts (a new head when
the number of classes differs) and warm starts from an hpctrain run (`model.init_from_ema`)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights
from hpctrain.config import Config, ConfigError, load_config, with_overrides
from hpctrain.distributed import DistEnv
from hpctrain.models import build_classifier, init_from
from hpctrain.train.trainer import Trainer
from tests.support.lm_kit import SEQ_LEN, write_token_shards

torchvision = pytest.importorskip("torchvision")
# The part of a 3-class task `load_initial_weights` reads: tensors of 3 rows may start anew.
THREE_CLASSES = SimpleNamespace(num_classes=3)


def resnet_file(path: Path) -> dict[str, torch.Tensor]:
    """A 1,000-class resnet18 state dict as a `weights=` download leaves it (random here)."""
    torch.manual_seed(3)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(state, path)
    return state


def test_a_torchvision_file_gives_the_backbone_and_a_new_head(tmp_path: Path) -> None:
    source = resnet_file(tmp_path / "resnet18-f37072fd.pth")
    cfg = with_overrides(
        Config(), ["model.name=resnet18", f"model.init_from={tmp_path / 'resnet18-f37072fd.pth'}"]
    )
    torch.manual_seed(0)
    model = build_classifier("resnet18", 3, 64)
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
    line = init_from.load_initial_weights(model, cfg, task=THREE_CLASSES)
    assert line.endswith("re-initialised (shapes differ): fc.bias, fc.weight")
    for key, value in model.state_dict().items():
        expected = head[key] if key.startswith("fc.") else source[key]
        assert torch.equal(value, expected), key
    del source["layer4.1.bn2.running_var"]
    torch.save(source, tmp_path / "resnet18-f37072fd.pth")
    with pytest.raises(
        ConfigError, match=r"model.init_from=.*: missing keys: layer4.1.bn2.running_var$"
    ):
        init_from.load_initial_weights(build_classifier("resnet18", 3, 64), cfg, task=THREE_CLASSES)
    # another architecture: its keys are listed, nothing is loaded
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "resnet34.pth")
    cfg34 = with_overrides(cfg, [f"model.init_from={tmp_path / 'resnet34.pth'}"])
    with pytest.raises(ConfigError, match=r"unexpected keys: layer1.2.bn1.bias"):
        init_from.load_initial_weights(
            build_classifier("resnet18", 3, 64), cfg34, task=THREE_CLASSES
        )


def lm_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={shards / 'index.json'}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.workers_per_rank=0",
        "causal_lm.dim=32",
        "causal_lm.n_layers=2",
        "causal_lm.n_heads=4",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.every_steps=2",
        "logging.progress=lines",
        *extra,
    ]


def fit(*overrides: str) -> Trainer:
    cfg = load_config(None, list(overrides))
    trainer = Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    assert trainer.fit() == 0
    return trainer


def test_warm_start_from_a_run_and_from_its_ema(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = tmp_path / "shards"
    write_token_shards(shards, 1, seed=1)
    source = tmp_path / "pretrain"
    fit(*lm_overrides(shards, source, "train.max_steps=2", "train.lr=0.01", "train.ema_decay=0.5"))
    store, name, manifest = locate_checkpoint(str(source))
    trained = read_model_weights(store, name, manifest)
    averaged = read_model_weights(store, name, manifest, ema=True)
    for ema, expected in ((False, trained), (True, averaged)):
        run_dir = tmp_path / f"finetune-{ema}"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hpctrain"):
            warm = fit(
                *lm_overrides(shards, run_dir, "train.max_steps=1", "train.lr=0", "seed=7"),
                f"model.init_from={source}",
                f"model.init_from_ema={str(ema).lower()}",
            )
        assert warm.state.step == 1  # its own counter, from 0
        assert "a new run from step 0" in caplog.text
        weights = {k: v for k, v in warm.model.state_dict().items()}
        assert weights.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(weights[key], value), key


def test_init_from_of_no_known_kind_is_one_line(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    index = write_token_shards(shards, 1, seed=1)
    (tmp_path / "notes").mkdir()
    cases = {
        str(index): r"a JSON file \(an index or a model card\), not weights",
        str(tmp_path / "notes"): r"a folder that is neither a Hugging Face model folder",
    }
    for path, message in cases.items():
        cfg = load_config(None, [*lm_overrides(shards, tmp_path / "r"), f"model.init_from={path}"])
        with pytest.raises(ConfigError, match=f"^model.init_from={path}: {message}"):
            Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    torch.save({}, tmp_path / "w.pt")
    ema_of_a_file = ["model.init_from=" + str(tmp_path / "w.pt"), "model.init_from_ema=true"]
    with pytest.raises(ConfigError, match=r"^model.init_from_ema=true: model.init_from=.*w.pt is"):
        init_from.check(with_overrides(Config(), ema_of_a_file), None)


def test_preflight_checks_that_init_from_exists_and_is_known(tmp_path: Path) -> None:
    from hpctrain.launch.preflight import check_init_from

    torch.save({}, tmp_path / "w.pt")
    assert check_init_from(Config()) is None
    ok = check_init_from(with_overrides(Config(), [f"model.init_from={tmp_path / 'w.pt'}"]))
    assert ok is not None and ok.ok and "a state dict file" in ok.message
    for path, message in (
        ("meta-llama/Llama-3.2-1B", "hf download meta-llama/Llama-3.2-1B --local-dir DIR"),
        (str(tmp_path / "absent"), "no such file or folder"),
    ):
        failed = check_init_from(with_overrides(Config(), [f"model.init_from={path}"]))
        assert failed is not None and not failed.ok and message in failed.message


def test_a_segmentation_file_gets_new_heads_for_other_classes(tmp_path: Path) -> None:
    from hpctrain.models import build_segmenter

    torch.manual_seed(4)
    source = build_segmenter("lraspp_mobilenet_v3_large", 21).state_dict()  # VOC's 21 classes
    torch.save(source, tmp_path / "lraspp.pth")
    cfg = with_overrides(Config(), [f"model.init_from={tmp_path / 'lraspp.pth'}"])
    model = build_segmenter("lraspp_mobilenet_v3_large", 3)
    line = init_from.load_initial_weights(model, cfg, task=THREE_CLASSES)
    heads = [k for k in source if k.startswith(("classifier.low_", "classifier.high_"))]
    assert line.endswith(f"re-initialised (shapes differ): {', '.join(sorted(heads))}")
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in source.items() if k not in heads)


@pytest.mark.slow  # trains a step: seconds
@pytest.mark.parametrize(
    ("source_shape", "named"),
    [
        ({"vocab_size": 301}, "tok_embeddings.weight [301, 32] (the model's [257, 32])"),
        ({"n_kv_heads": 2}, "blocks.0.attention.wk.weight [16, 32] (the model's [32, 32])"),
    ],
    ids=["another-vocabulary", "other-kv-heads"],
)
def test_a_weights_file_that_would_reinitialise_embeddings_or_kv_is_refused(
    tmp_path: Path, source_shape: dict, named: str
) -> None:
    """Item 14: a tensor other than a head of classes that would start anew (was an INFO
    line) is refused in one line naming it, before any step; opting in loads the rest."""
    from hpctrain.models.gpt import GPT, GPTConfig

    shards = tmp_path / "shards"
    write_token_shards(shards, 1, seed=1)
    shape = {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 4, "tie_embeddings": True}
    shape |= source_shape  # the run's model: gpt-tiny's tied embeddings at these sizes
    torch.manual_seed(5)
    source = GPT(GPTConfig(**shape)).state_dict()
    torch.save(source, tmp_path / "other.pt")
    overrides = [
        *lm_overrides(shards, tmp_path / "r", "train.max_steps=1"),
        f"model.init_from={tmp_path / 'other.pt'}",
    ]
    trainer = Trainer(
        load_config(None, overrides),
        DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"),
        torch.device("cpu"),
    )
    with pytest.raises(ConfigError, match=r"^model.init_from=\S+: would start anew") as info:
        trainer.fit()
    assert named in str(info.value) and "model.init_from_reinit_mismatched=true" in str(info.value)
    assert "\n" not in str(info.value) and trainer.state.step == 0
    opted = fit(*overrides, "model.init_from_reinit_mismatched=true", "train.lr=0")
    for key, value in opted.model.state_dict().items():  # lr 0: the weights as loaded
        if value.shape == source[key].shape:
            assert torch.equal(value, source[key]), key
