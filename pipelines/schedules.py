"""Sigma schedules of the flow-matching families (pure functions of numbers and tensors).

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


def flow_match_sigmas(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """``FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(K)``'s sigmas (static shift): with
    ``f(σ) = s·σ/(1 + (s − 1)·σ)`` and ``T`` training timesteps, ``σ_min = f(1/T)``; ``f(linspace(1, σ_min, K))``
    followed by a final 0 (``[K + 1]``, float32)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
    s = float(shift)
    f = lambda x: s * x / (1 + (s - 1) * x)  # noqa: E731
    grid = torch.linspace(1.0, f(1.0 / num_train_timesteps), num_steps, dtype=torch.float64)
    return torch.cat([f(grid), torch.zeros(1, dtype=torch.float64)]).float()


def terminal_stretched_sigmas(num_steps: int, shift: float, terminal: float | None = None) -> torch.Tensor:
    """The sigmas of a pipeline that passes ``sigmas = linspace(1, 1/K, K)`` to ``FlowMatchEulerDiscreteScheduler``
    (QwenImagePipeline, ZImagePipeline): shifted ``σ' = s·σ / (1 + (s − 1)·σ)``, stretched so that ``1 − σ'`` ends at
    ``1 − terminal`` when the scheduler config sets ``shift_terminal``, then a final 0 (``[K + 1]``, float32)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
    s = float(shift)
    grid = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    sigmas = s * grid / (1 + (s - 1) * grid)
    if terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - one_minus / (one_minus[-1] / (1 - float(terminal)))
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)]).float()


def calculate_shift(image_seq_len: int, config: dict) -> float:
    """FluxPipeline's / QwenImagePipeline's ``calculate_shift``: ``μ = m·L + b`` through (``base_image_seq_len``,
    ``base_shift``) and (``max_image_seq_len``, ``max_shift``) of the scheduler config (defaults 256, 4096, 0.5, 1.15)."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def logit_normal_sigmas(n: int, *, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` training sigmas ``sigmoid(N(mean, std²))`` (SD3's logit-normal timestep sampling)."""
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
