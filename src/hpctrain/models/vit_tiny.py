"""A DeiT-Tiny-sized ViT built from torchvision's VisionTransformer."""

from __future__ import annotations

from torch import nn

from hpctrain.config import ConfigError


def vit_tiny(num_classes: int, image_size: int) -> nn.Module:
    """A DeiT-Tiny-sized ViT (192 wide, 12 blocks, 3 heads): torchvision's VisionTransformer.

    Patches of 16 px from 128 px up (196 tokens at 224 px), 4 px below (64 tokens at 32 px,
    as CIFAR ViTs do), so it also trains on a CPU at small sizes.
    """
    from torchvision.models.vision_transformer import VisionTransformer

    patch_size = 16 if image_size >= 128 else 4
    if image_size % patch_size:
        raise ConfigError(
            f"model.image_size={image_size}: vit_tiny needs a multiple of its {patch_size} px patches"
        )
    return VisionTransformer(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=12,
        num_heads=3,
        hidden_dim=192,
        mlp_dim=768,
        num_classes=num_classes,
    )
