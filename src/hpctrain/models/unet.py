"""A small U-Net for semantic segmentation that trains in minutes on a CPU."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions with GroupNorm. GroupNorm, not BatchNorm: segmentation batches
    are small, and a norm without running statistics needs no fp32 special case under FSDP2
    mixed precision (see `parallel/parallelize.py` FP32_NORMS)."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.GroupNorm(min(8, cout // 4), cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.GroupNorm(min(8, cout // 4), cout),
        nn.ReLU(inplace=True),
    )


class UpBlock(nn.Module):
    """Upsample ×2, concatenate the encoder's skip connection, two convolutions."""

    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.conv = _conv_block(cin + cskip, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        # to the skip's exact size: odd input sides do not halve evenly
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """Encoder of `depth` conv blocks (each halving the resolution after it), a mirrored
    decoder with skip connections, and a 1x1 head: logits [B, num_classes, H, W] at the
    input's resolution, for any H and W.

    `blocks` lists the encoder and decoder blocks, so `parallel/parallelize.py` checkpoints and
    shards each of them (`find_blocks`).
    """

    def __init__(self, num_classes: int, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        channels = [width * 2**i for i in range(depth + 1)]  # 16, 32, 64, 128
        encoders = [_conv_block(3, channels[0])]
        encoders += [_conv_block(cin, cout) for cin, cout in itertools.pairwise(channels)]
        decoders = [
            UpBlock(channels[i + 1], channels[i], channels[i]) for i in reversed(range(depth))
        ]
        self.depth = depth
        self.blocks = nn.ModuleList([*encoders, *decoders])
        self.head = nn.Conv2d(channels[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i in range(self.depth + 1):
            x = self.blocks[i](x)
            if i < self.depth:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for block in list(self.blocks)[self.depth + 1 :]:
            x = block(x, skips.pop())
        return self.head(x)
