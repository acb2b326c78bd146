"""Rewards of image editing that read the source image (``needs_source = True``, see ``rewards.base``).

* ``source_similarity``: the structural similarity (SSIM, Wang et al. 2004) of the edited image to its
  source, the preservation term editing recipes add to an instruction-following reward so that the policy
  does not repaint what the instruction did not ask to change.

SSIM of two images ``x, y`` in [0, 1], per channel, with local Gaussian-weighted statistics (window
``11 × 11``, ``σ = 1.5``; smaller images use the largest odd window that fits):

    SSIM = (2 μx μy + C1)(2 σxy + C2) / ((μx² + μy² + C1)(σx² + σy² + C2)),  C1 = (0.01)², C2 = (0.03)²

averaged over the positions where the whole window fits and over the three channels (the convention of
scikit-image's ``structural_similarity(..., gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
data_range=1)``). It is 1 for identical images and lies in [−1, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards.base import Reward, register_reward

C1, C2 = 0.01**2, 0.03**2


def gaussian_window(size: int, sigma: float = 1.5) -> torch.Tensor:
    """Normalised separable Gaussian ``[size]`` (float64)."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    w = torch.exp(-(x**2) / (2 * sigma**2))
    return w / w.sum()


def ssim(x: torch.Tensor, y: torch.Tensor, *, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Per-image SSIM ``[B]`` of float images ``x, y`` ``[B, C, H, W]`` in [0, 1] (see the module docstring).

    The window shrinks to the largest odd size ≤ ``min(H, W)`` for small images; statistics are computed in
    float64 over the valid region only (no padding)."""
    if x.shape != y.shape or x.ndim != 4:
        raise ValueError(f"ssim needs two image batches of one shape [B, C, H, W], got {tuple(x.shape)} and {tuple(y.shape)}")
    size = min(window, x.shape[-2], x.shape[-1])
    size -= 1 - size % 2
    g = gaussian_window(size, sigma).to(x.device)
    c = x.shape[1]
    kh, kw = g.view(1, 1, size, 1).repeat(c, 1, 1, 1), g.view(1, 1, 1, size).repeat(c, 1, 1, 1)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(t, kh, groups=c), kw, groups=c)

    x, y = x.double(), y.double()
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    s = ((2 * mx * my + C1) * (2 * cxy + C2)) / ((mx * mx + my * my + C1) * (vx + vy + C2))
    return s.mean(dim=(1, 2, 3)).float()


@register_reward("source_similarity")
class SourceSimilarity(Reward):
    """SSIM of each edited image to its source image (preservation of what the edit should keep)."""

    unit = "SSIM"
    scale = (-1.0, 1.0)
    input = "uint8"
    needs_source = True

    def __call__(self, images, prompts, metadata=None, *, source_images=None):
        if source_images is None:
            raise ValueError("source_similarity compares each edit with its source: call it with source_images=")
        if source_images.shape != images.shape:
            raise ValueError(f"source_similarity: sources {tuple(source_images.shape)} and edits {tuple(images.shape)} differ in shape; resize the sources to the output size")
        return {self.name: ssim(images.float() / 255.0, source_images.float() / 255.0)}
