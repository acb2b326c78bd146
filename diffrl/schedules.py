"""Sigma schedules and timestep samplers.

``sigma ∈ [0, 1]``, 1 = pure noise. A shifted schedule maps a uniform grid ``s`` through
``σ = shift·s / (1 + (shift − 1)·s)`` (SD3's time shift, Esser et al. 2024), which for shift > 1 spends
more steps at high noise.
"""

from __future__ import annotations

import torch


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 time shift: ``shift·σ / (1 + (shift − 1)·σ)``; identity for ``shift == 1``."""
    if shift <= 0:
        raise ValueError(f"sigma shift must be > 0, got {shift}")
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def shifted_sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """``[num_steps + 1]`` sigmas from 1 down to 0 (fp32): a uniform grid, then the shift."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
    return shift_sigma(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32), shift)


def logit_normal_sigmas(n: int, *, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` training sigmas ``sigmoid(N(mean, std²))`` (SD3's logit-normal timestep sampling)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
