"""``digits_stroke``: how much a sample's strokes look like handwriting, by three pixel statistics (no classifier).

An auxiliary reward of the digits miniature (GARDO's gate, ``algorithm.gate_rewards``): it sees what the reward
classifier ignores. On the ink intensity (the image projected on the palette colour it reads, 16×16):

- ``ink``: the share of pixels with intensity > 0.3 (a filled shape covers more);
- ``solid``: the share with intensity > 0.9 (saturated plateaus);
- ``tv``: the mean absolute difference between neighbouring pixels (speckle and hard edges raise it).

Each is standardised by its mean and std over sklearn's real digits rendered as samples arrive, and the score is
``exp(−½·mean_k z_k²)`` in (0, 1]: 1 at the real digits' mean statistics. It shares no weights or decisions with the
reward, the gold judges or the realness check (which measures the distance to the nearest real digit).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from rewards.base import Reward, register_reward
from rewards.digits.data import COLOUR_NAMES, load_digit_intensities
from rewards.digits.judge2 import ink_intensity, read_colour, render


def stroke_statistics(images: torch.Tensor) -> torch.Tensor:
    """uint8 (or float in [0, 1]) ``[B, 3, 16, 16]`` → ``[B, 3]``: ink share, solid share, total variation."""
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    ink = ink_intensity(x, read_colour(x))[:, 0]
    tv = (ink[:, 1:, :] - ink[:, :-1, :]).abs().mean((1, 2)) + (ink[:, :, 1:] - ink[:, :, :-1]).abs().mean((1, 2))
    return torch.stack([(ink > 0.3).float().mean((1, 2)), (ink > 0.9).float().mean((1, 2)), tv], 1)


@lru_cache(maxsize=1)
def real_statistics() -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [3], std [3])`` of :func:`stroke_statistics` over sklearn's 1797 digits, each in a seeded palette colour."""
    intensity, _ = load_digit_intensities()
    colour = torch.randint(len(COLOUR_NAMES), (len(intensity),), generator=torch.Generator().manual_seed(7))
    s = stroke_statistics(render(intensity, colour))
    return s.mean(0), s.std(0)


@register_reward("digits_stroke")
class DigitsStroke(Reward):
    """``exp(−½·mean_k z_k²)`` of the stroke statistics' z-scores against real digits (module docstring)."""

    unit = "score in (0, 1]"

    def __init__(self, device: str = "cpu"):
        self.mean, self.std = real_statistics()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, 16, 16):
            raise ValueError(f"digits_stroke reads images [B, 3, 16, 16] (the miniature's size), got {tuple(images.shape)}")
        z = (stroke_statistics(images.cpu()) - self.mean) / self.std
        return {self.name: torch.exp(-0.5 * (z**2).mean(1))}
