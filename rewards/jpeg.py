"""JPEG (in)compressibility, DDPO's first tasks (Black et al. 2024, "Training Diffusion Models with
Reinforcement Learning", sec. 6.1): the size of the image saved as JPEG at quality 95, in kB.

``jpeg_compressibility`` = −size (smaller files score higher), ``jpeg_incompressibility`` = +size.

>>> import torch
>>> flat, noise = torch.full((1, 3, 32, 32), 128, dtype=torch.uint8), torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
>>> reward = JpegCompressibility()
>>> bool(reward(flat, ["a"])["jpeg_compressibility"] > reward(noise, ["a"])["jpeg_compressibility"])
True
"""

from __future__ import annotations

import io

import torch

from rewards.base import Reward, register_reward


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """``[B]`` size in kB (1000 bytes) of each uint8 ``[B, 3, H, W]`` image saved as JPEG."""
    from PIL import Image

    sizes = []
    for image in images.cpu():
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """−(JPEG size in kB at ``quality``); higher = more compressible."""

    unit = "−kB"

    def __init__(self, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        return {self.name: -jpeg_size_kb(images, self.quality)}


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(JpegCompressibility):
    """+(JPEG size in kB at ``quality``); higher = less compressible."""

    unit = "kB"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        return {self.name: jpeg_size_kb(images, self.quality)}
