"""SmallCNN: the classifier that trains in minutes on a CPU (the demo's model)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    """Four conv blocks and a linear head: trains in minutes on a CPU at 32–64 px."""

    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        channels = [3, width, 2 * width, 4 * width, 4 * width]
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2) if i < 3 else nn.Identity(),
            )
            for i, (cin, cout) in enumerate(itertools.pairwise(channels))
        )
        self.head = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
