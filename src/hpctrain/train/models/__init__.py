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
    "check_image_size",
    "check_model_name",
    "flops_per_token",
    "gpt_config",
    "vit_tiny",
]

# hpctrain's own models (besides every torchvision model of the kind)
CLASSIFIERS: tuple[str, ...] = ("small_cnn", "vit_tiny")
SEGMENTERS: tuple[str, ...] = ("unet",)


# The smallest input each torchvision classifier family takes (found by forward passes of
# torchvision 0.29, checked by tests/train/test_torchvision_models.py): below it a pooling or
# convolution window is larger than its feature map and the first step fails. Families not
# listed take any model.image_size (>= 8); ViTs and MaxViT have their own rule (below).
MIN_IMAGE_SIZE: dict[str, int] = {
    "alexnet": 63,
    "convnext_": 32,
    "densenet": 29,
    "googlenet": 15,
    "inception_v3": 75,
    "squeezenet1_0": 21,
    "squeezenet1_1": 17,
    "vgg": 32,
}
MAXVIT_PARTITION = 7  # maxvit_t's window: every block's input must be a multiple of it


def _maxvit_block_sizes(image_size: int) -> list[int]:
    """The input side of each of maxvit_t's 4 blocks: the stem and every block's first layer
    halve the side (a 3x3 convolution of stride 2 and padding 1), as torchvision's
    `_make_block_input_shapes`."""
    side, sizes = (image_size - 1) // 2 + 1, []
    for _ in range(4):
        side = (side - 1) // 2 + 1
        sizes.append(side)
    return sizes


def check_image_size(name: str, image_size: int) -> None:
    """Refuse a `model.image_size` that torchvision classifier `name` cannot take, before
    any work (it would fail at the first forward pass, after the queue wait).

    Raises:
        ConfigError: naming model.name, model.image_size and what the model needs.
    """
    where = f"model.name={name}: model.image_size={image_size}"
    if name.startswith("vit_"):
        patch = int(name.rsplit("_", 1)[1])  # vit_b_16: 16 px patches
        if image_size % patch:
            raise ConfigError(f"{where} must be a multiple of its {patch} px patches")
    if name.startswith("maxvit_"):
        sizes = _maxvit_block_sizes(image_size)
        if any(side % MAXVIT_PARTITION for side in sizes):
            raise ConfigError(
                f"{where} gives block inputs of {sizes} px; each must be a multiple of its "
                f"{MAXVIT_PARTITION} px partitions (e.g. model.image_size 224, 448)"
            )
    for prefix, least in MIN_IMAGE_SIZE.items():
        if name.startswith(prefix) and image_size < least:
            raise ConfigError(f"{where}: the model needs at least {least} px")


def build_classifier(name: str, num_classes: int, image_size: int = 224) -> nn.Module:
    """`small_cnn`, `vit_tiny` or any torchvision classification model, randomly initialised.

    `image_size` matters to ViTs and MaxViT (their position tables and windows follow the
    input) and is checked against what the model can take (`check_image_size`). GoogLeNet and
    Inception v3 are built without their auxiliary heads: a training step reads one logits
    tensor, and the heads only exist for ImageNet-era training recipes.
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
    check_image_size(name, image_size)
    options: dict[str, object] = {}
    if name.startswith("vit_"):
        options["image_size"] = image_size
    elif name.startswith("maxvit_"):
        options["input_size"] = (image_size, image_size)
    elif name in ("googlenet", "inception_v3"):
        # init_weights=True: their own truncated-normal init (what None picks, with a warning)
        options.update(aux_logits=False, init_weights=True)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)


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


def check_model_name(task: str, name: str, image_size: int | None = None) -> None:
    """Refuse a `model.name` that the built-in `task` cannot build, without building it
    (for `hpctrain preflight`); empty is the task's default. Other tasks are not checked.
    With `image_size`, a classifier's `model.image_size` is checked too (`check_image_size`).

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
    if image_size is not None and task == "image_classification" and name not in own:
        check_image_size(name, image_size)
