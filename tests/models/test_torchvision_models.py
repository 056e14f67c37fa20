"""torchvision classifiers as hpctrain builds them: one logits tensor, and the image sizes
each family takes checked before any work. Models are built and run on the meta device
(shapes only: no memory, no initialisation or compute cost)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision

from hpctrain.cli.main import main
from hpctrain.config import ConfigError
from hpctrain.errors import EXIT_CONFIG
from hpctrain.models import MIN_IMAGE_SIZE, build_classifier
from hpctrain.tasks.task import check_model_name
from tests.support.loader_kit import make_shards


def logits_of(model: torch.nn.Module, image_size: int) -> object:
    with torch.device("meta"):
        return model(torch.empty(2, 3, image_size, image_size))


@pytest.mark.parametrize(("name", "image_size"), [("googlenet", 32), ("inception_v3", 80)])
def test_googlenet_and_inception_give_one_logits_tensor_in_training(name, image_size):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning about their weight initialisation
        with torch.device("meta"):
            model = build_classifier(name, 5, image_size)
    model.train()
    out = logits_of(model, image_size)  # was GoogLeNetOutputs / InceptionOutputs
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5)


@pytest.mark.parametrize(
    ("name", "image_size", "fragment"),
    [
        ("vit_b_16", 40, "model.image_size=40 must be a multiple of its 16 px patches"),
        ("vit_h_14", 220, "model.image_size=220 must be a multiple of its 14 px patches"),
        ("inception_v3", 32, "model.image_size=32: the model needs at least 75 px"),
        ("alexnet", 32, "model.image_size=32: the model needs at least 63 px"),
        ("maxvit_t", 112, "model.image_size=112 gives block inputs of [28, 14, 7, 4] px"),
    ],
)
def test_an_image_size_the_model_cannot_take_is_refused_naming_both_keys(
    name, image_size, fragment
):
    with pytest.raises(ConfigError, match=rf"model.name={name}: .*{fragment}".replace("[", r"\[")):
        build_classifier(name, 3, image_size)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):  # preflight's check
        check_model_name("image_classification", name, image_size)


def torchvision_takes(name: str, image_size: int) -> bool:
    """Whether torchvision's own model (no hpctrain check) runs a forward pass at this size."""
    options: dict[str, object] = {}
    if name in ("googlenet", "inception_v3"):
        options.update(aux_logits=False, init_weights=False)
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None, num_classes=3, **options)
        logits_of(model.eval(), image_size)
    except RuntimeError:
        return False
    return True


FAMILIES = ("alexnet", "convnext_tiny", "densenet121", "googlenet", "inception_v3")
FAMILIES += ("squeezenet1_0", "squeezenet1_1", "vgg11")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_least_image_sizes_are_torchvision_s(name):
    least = next(v for k, v in MIN_IMAGE_SIZE.items() if name.startswith(k))
    assert torchvision_takes(name, least) and not torchvision_takes(name, least - 1)


def test_maxvit_is_built_for_model_image_size():
    with torch.device("meta"):
        model = build_classifier("maxvit_t", 4, 448)  # torchvision's default is 224
    assert logits_of(model.eval(), 448).shape == (2, 4)


def test_train_refuses_the_image_size_before_any_step(tmp_path, capsys):
    make_shards(tmp_path / "shards", [4])
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {{name: inception_v3, image_size: 32}}\n"
        f"data: {{train: {tmp_path / 'shards'}, batch_size: 2, workers_per_rank: 0}}\n"
        "train: {max_steps: 1, precision: fp32}\n"
    )
    assert main(["train", str(config)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "config error: model.name=inception_v3: model.image_size=32: the model needs at least 75 px"
        )
    )
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
