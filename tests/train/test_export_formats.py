"""`hpctrain export --format safetensors`, the model card of built-in models, and `--best`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import CheckpointManager, ModelOptimizerState
from hpctrain.cli.main import main
from hpctrain.config import Config, config_to_yaml, with_overrides
from hpctrain.errors import UsageError
from hpctrain.inference.export import export_weights, format_of
from hpctrain.models import build_classifier


def save_checkpoints(
    root: Path, cfg: Config, num_classes: int, scores: dict[int, float]
) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints laid out as the Trainer saves them (model under "app"), one per step with
    different weights; returns each step's model state."""
    model = build_classifier(cfg.model.name, num_classes, cfg.model.image_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(
        str(root), keep_last=1, monitor="val_accuracy", mode="max", keep_best=1
    )
    saved = {}
    for step, score in scores.items():
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * step)
        manager.save(
            step,
            {"app": ModelOptimizerState(model, optimizer)},
            metadata={"config": config_to_yaml(cfg)},
            score=score,
        )
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manager.close()
    return saved


LOAD_WITHOUT_HPCTRAIN = textwrap.dedent(
    """
    import json, sys
    from safetensors import safe_open
    from safetensors.torch import load_file
    tensors = load_file(sys.argv[1])
    with safe_open(sys.argv[1], framework="pt") as f:
        metadata = f.metadata()
    assert not any(m == "hpctrain" or m.startswith("hpctrain.") for m in sys.modules)
    print(json.dumps({"names": sorted(tensors), "step": metadata["hpctrain_step"],
                      "sum": float(sum(t.double().sum() for t in tensors.values()))}))
    """
)


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_safetensors_loads_without_hpctrain_and_the_card_rebuilds_the_model(tmp_path):
    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=32"])  # classes: 0
    saved = save_checkpoints(tmp_path / "ck", cfg, num_classes=3, scores={1: 0.5, 2: 0.4})

    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", str(tmp_path / "ck"), str(out)]) == 0  # the format from the name
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HPCTRAIN, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert loaded["names"] == sorted(saved[2]) and loaded["step"] == "2"
    expected_sum = float(sum(t.double().sum() for t in saved[2].values()))
    assert loaded["sum"] == pytest.approx(expected_sum, rel=1e-12)

    card = json.loads(out.with_name(out.name + ".json").read_text())
    assert card["task"] == "image_classification" and card["step"] == 2
    assert card["model"] == {
        "name": "small_cnn",
        "num_classes": 3,  # from the weights: the config said 0 (take it from the index)
        "image_size": 32,
        "channels_last": False,
    }
    assert card["weights"] == "model.safetensors" and card["format"] == "safetensors"
    assert card["multi_label"] is False
    from safetensors.torch import load_file

    model = build_classifier(**{k: card["model"][k] for k in ("name", "num_classes", "image_size")})
    model.load_state_dict(load_file(out))  # strict: exactly the model's names and shapes
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[2][key]), key


def test_best_exports_the_checkpoint_the_pointer_names(tmp_path):
    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=16"])
    saved = save_checkpoints(tmp_path / "ck", cfg, num_classes=4, scores={1: 0.9, 2: 0.1, 3: 0.2})
    out = tmp_path / "best.pt"
    result = export_weights(str(tmp_path / "ck"), out, best=True)
    assert result.step == 1 and result.model_card == tmp_path / "best.pt.json"
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[k], saved[1][k]) for k in saved[1])
    assert json.loads((tmp_path / "best.pt.json").read_text())["format"] == "pt"
    newest = export_weights(str(tmp_path / "ck"), tmp_path / "newest.pt", fmt="pt")
    assert newest.step == 3


def test_no_best_pointer_and_bad_formats_are_named(tmp_path):
    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=16"])
    model = build_classifier("small_cnn", 2, 16)
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    manager.save(
        5,
        {"app": ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))},
        metadata={"config": config_to_yaml(cfg)},
    )
    manager.close()
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "m.pt"), "--best"]) == 4
    with pytest.raises(UsageError, match="--format onnx: must be one of pt|safetensors"):
        format_of("m.onnx", "onnx")
    assert format_of("m.safetensors", None) == "safetensors" and format_of("m.bin", None) == "pt"


def test_a_custom_task_gets_weights_but_no_card(tmp_path):
    cfg = with_overrides(Config(), ["task=tests.support.slow_tasks:SlowImageClassification"])
    model = torch.nn.Linear(3, 2)
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    manager.save(
        1,
        {"app": ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))},
        metadata={"config": config_to_yaml(cfg)},
    )
    manager.close()
    result = export_weights(str(tmp_path / "ck"), tmp_path / "w.safetensors")
    assert result.model_card is None and not (tmp_path / "w.safetensors.json").exists()
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "w.safetensors")) == ["bias", "weight"]


def test_each_export_keeps_its_own_card_and_a_json_out_is_refused(tmp_path, capsys):
    """#31 item 23, #32 item 3: `export RUN w.json` wrote the card over the weights; the
    cards of `model.safetensors` and `model.pt` were both `model.json`."""
    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=16"])
    save_checkpoints(tmp_path / "ck", cfg, num_classes=3, scores={1: 0.5})
    for name in ("model.safetensors", "model.pt"):
        assert main(["export", str(tmp_path / "ck"), str(tmp_path / name)]) == 0
    for name, fmt in (("model.safetensors", "safetensors"), ("model.pt", "pt")):
        card = json.loads((tmp_path / f"{name}.json").read_text())
        assert (card["weights"], card["format"]) == (name, fmt)
    assert not (tmp_path / "model.json").exists()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "weights.json")]) == 2
    assert "weights.json: a .json name is a model card's" in capsys.readouterr().err
    assert not (tmp_path / "weights.json").exists()


def test_an_export_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=16"])
    save_checkpoints(tmp_path / "ck", cfg, num_classes=3, scores={1: 0.5})
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(UsageError, match="cannot write the export") as caught:
        export_weights(str(tmp_path / "ck"), tmp_path / "file" / "model.pt")
    assert "\n" not in str(caught.value) and str(tmp_path / "file" / "model.pt") in str(
        caught.value
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.pt.json").mkdir()  # a folder where the card goes
    with pytest.raises(UsageError, match="model.pt.json: cannot write the export"):
        export_weights(str(tmp_path / "ck"), tmp_path / "out" / "model.pt")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.pt", "model.pt.json"]
