"""The built-in tasks' models, by name: hpctrain's small CPU-friendly ones and torchvision's.

Each kind has a table name -> builder (`CLASSIFIERS`, `SEGMENTERS`; the GPT's shapes are
`gpt.PRESETS`); a name not in the table is looked up among torchvision's models of the kind.
A new model of a built-in task is one module here and one line in its table
(`docs/extending.md`). Models are always randomly initialised (`weights=None`,
`weights_backbone=None`): compute nodes have no internet. Load weights from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from hpctrain.config import ConfigError
from hpctrain.models.gpt import GPT, PRESETS, GPTConfig, flops_per_token, gpt_config
from hpctrain.models.small_cnn import SmallCNN
from hpctrain.models.unet import UNet
from hpctrain.models.vit_tiny import vit_tiny

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
    "check_classifier_name",
    "check_image_size",
    "check_segmenter_name",
    "flops_per_token",
    "gpt_config",
    "vit_tiny",
]

# hpctrain's own models, name -> builder (besides every torchvision model of the kind)
CLASSIFIERS: dict[str, Callable[[int, int], nn.Module]] = {  # (num_classes, image_size)
    "small_cnn": lambda num_classes, image_size: SmallCNN(num_classes),
    "vit_tiny": vit_tiny,
}
SEGMENTERS: dict[str, Callable[[int], nn.Module]] = {"unet": UNet}  # (num_classes)


# The smallest input each torchvision classifier family takes (found by forward passes of
# torchvision 0.29, checked by tests/models/test_torchvision_models.py): below it a pooling or
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
    if name in CLASSIFIERS:
        return CLASSIFIERS[name](num_classes, image_size)
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
    if name in SEGMENTERS:
        return SEGMENTERS[name](num_classes)
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


def check_classifier_name(name: str, image_size: int | None = None) -> None:
    """Refuse a classifier `name` that `build_classifier` cannot build, without building it;
    with `image_size`, a torchvision model's `model.image_size` too (`check_image_size`).

    Raises:
        ConfigError: naming the model and the classifiers there are.
    """
    import torchvision

    if name not in CLASSIFIERS and name not in torchvision.models.list_models(
        module=torchvision.models
    ):
        raise ConfigError(
            f"model.name={name!r}: task image_classification takes {', '.join(CLASSIFIERS)} or a "
            "torchvision classification model"
        )
    if image_size is not None and name not in CLASSIFIERS:
        check_image_size(name, image_size)


def check_segmenter_name(name: str) -> None:
    """Refuse a segmentation model `name` that `build_segmenter` cannot build, without building it.

    Raises:
        ConfigError: naming the model and the segmentation models there are.
    """
    import torchvision

    if name not in SEGMENTERS and name not in torchvision.models.list_models(
        module=torchvision.models.segmentation
    ):
        raise ConfigError(
            f"model.name={name!r}: task segmentation takes {', '.join(SEGMENTERS)} or a "
            "torchvision segmentation model"
        )
