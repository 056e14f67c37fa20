"""The built-in tasks' models, by name: hpctrain's small CPU-friendly ones and torchvision's.

Models are always randomly initialised (`weights=None`, `weights_backbone=None`): compute
nodes have no internet. Load weights from a checkpoint instead.
"""

from __future__ import annotations

from torch import nn

from hpctrain.config import ConfigError
from hpctrain.train.models.gpt import GPT, PRESETS, GPTConfig, flops_per_token, gpt_config
from hpctrain.train.models.small_cnn import SmallCNN
from hpctrain.train.models.unet import UNet
from hpctrain.train.models.vit_tiny import vit_tiny

__all__ = [
    "CLASSIFIERS",
    "GPT",
    "PRESETS",
    "SEGMENTERS",
    "GPTConfig",
    "SmallCNN",
    "UNet",
    "build_classifier",
    "build_segmenter",
    "check_model_name",
    "flops_per_token",
    "gpt_config",
    "vit_tiny",
]

# hpctrain's own models (besides every torchvision model of the kind)
CLASSIFIERS: tuple[str, ...] = ("small_cnn", "vit_tiny")
SEGMENTERS: tuple[str, ...] = ("unet",)


def build_classifier(name: str, num_classes: int, image_size: int = 224) -> nn.Module:
    """`small_cnn`, `vit_tiny` or any torchvision classification model, randomly initialised.

    `image_size` matters to ViTs only (their position embeddings have one entry per patch).
    """
    if name == "small_cnn":
        return SmallCNN(num_classes)
    if name == "vit_tiny":
        return vit_tiny(num_classes, image_size)
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name!r}: not small_cnn, vit_tiny nor a torchvision classification "
            "model (e.g. resnet18, resnet50, vit_b_16)"
        )
    if name.startswith("vit_"):
        return torchvision.models.get_model(
            name, weights=None, num_classes=num_classes, image_size=image_size
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def build_segmenter(name: str, num_classes: int) -> nn.Module:
    """`unet` or a torchvision segmentation model (`fcn_resnet50`, `deeplabv3_resnet50`,
    `lraspp_mobilenet_v3_large`, ...), randomly initialised, backbone included.

    torchvision's models return `{"out": logits}`; the segmentation task reads either form.
    """
    if name == "unet":
        return UNet(num_classes)
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models.segmentation)
    if name not in available:
        raise ConfigError(
            f"model.name={name!r}: not unet nor a torchvision segmentation model "
            f"({', '.join(sorted(available))})"
        )
    return torchvision.models.get_model(
        name, weights=None, weights_backbone=None, num_classes=num_classes
    )


def check_model_name(task: str, name: str) -> None:
    """Refuse a `model.name` that the built-in `task` cannot build, without building it
    (for `hpctrain preflight`); empty is the task's default. Other tasks are not checked.

    Raises:
        ConfigError: naming the model and what the task accepts.
    """
    if name and task == "causal_lm":
        if name not in PRESETS:
            raise ConfigError(f"model.name={name!r}: task causal_lm takes {', '.join(PRESETS)}")
        return
    if not name or task not in ("image_classification", "segmentation"):
        return
    import torchvision

    if task == "image_classification":
        own, module, kind = CLASSIFIERS, torchvision.models, "classification"
    else:
        own, module, kind = SEGMENTERS, torchvision.models.segmentation, "segmentation"
    if name not in own and name not in torchvision.models.list_models(module=module):
        raise ConfigError(
            f"model.name={name!r}: task {task} takes {', '.join(own)} or a torchvision {kind} model"
        )
