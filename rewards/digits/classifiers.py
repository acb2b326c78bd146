"""Classifiers of the digits miniature: the reward model and the independent gold judge.

Both predict (digit, colour) from a ``[B, 3, 16, 16]`` image in [0, 1]. They differ in architecture,
seed and training split, so that a policy that exploits the reward classifier's blind spots shows
up as a gap between reward and gold accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from rewards.digits.data import COLOUR_NAMES
from rewards.digits.io import JsonSafetensorsMixin

ARCHITECTURES = ("cnn", "strided_cnn", "mlp")


class DigitsClassifier(JsonSafetensorsMixin, nn.Module):
    """Two heads (10 digits, 6 colours) over a small trunk.

    Args:
        architecture: ``"cnn"`` (3×3 convs + max-pooling, the reward model), ``"strided_cnn"``
            (5×5 conv then strided convs, the gold judge) or ``"mlp"``.
        width: hidden width.
    """

    def __init__(self, architecture: str = "cnn", width: int = 32):
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unknown classifier architecture {architecture!r}; choose one of {ARCHITECTURES}")
        self.architecture, self.width = architecture, width
        if architecture == "cnn":
            self.trunk = nn.Sequential(
                nn.Conv2d(3, width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
                nn.Conv2d(width, 2 * width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(2 * width * 16, 4 * width), nn.GELU(),
            )
        elif architecture == "strided_cnn":
            self.trunk = nn.Sequential(
                nn.Conv2d(3, width // 2, 5, padding=2), nn.ReLU(),
                nn.Conv2d(width // 2, width, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
                nn.Flatten(), nn.Dropout(0.1), nn.Linear(2 * width * 16, 4 * width), nn.ReLU(),
            )
        else:
            self.trunk = nn.Sequential(
                nn.Flatten(), nn.Linear(3 * 16 * 16, 8 * width), nn.ReLU(), nn.Dropout(0.1),
                nn.Linear(8 * width, 4 * width), nn.ReLU(),
            )
        self.digit_head = nn.Linear(4 * width, 10)
        self.colour_head = nn.Linear(4 * width, len(COLOUR_NAMES))

    @property
    def config(self) -> dict:
        return {"architecture": self.architecture, "width": self.width}

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``images [B, 3, 16, 16]`` in [0, 1] → (digit logits ``[B, 10]``, colour logits ``[B, 6]``)."""
        h = self.trunk(images * 2.0 - 1.0)
        return self.digit_head(h), self.colour_head(h)
