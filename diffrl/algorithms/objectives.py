"""Shared pieces of the objectives on clean samples (DiffusionNFT, Diffusion-DPO, AWM).

Policy-gradient losses score the recorded SDE transitions step by step (``losses.make_step_loss``).
Objectives instead re-noise the final clean latents with the forward process and regress the model's
prediction. Each objective is called by the engine on one micro-batch (``micro_losses(engine, micro,
seed)``) and yields ``(loss, weight, metrics)`` pieces whose weights sum to one, so gradient accumulation
equals one large batch.

The noise of each (sample, timestep) comes from a generator seeded by the sample's seed and the
optimizer step's ``seed`` (``diffrl.sampling.seeding``), so a piece is the same whatever micro-batch it falls in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from tensordict import TensorDict

from diffrl.sampling.sde import randn_per_sample
from diffrl.sampling.seeding import Stream, derive, generators


def forward_noise(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor, prediction_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_σ, target)``: the forward process at noise level ``sigma [B]`` and the prediction target.

    Flow models: ``x_σ = (1 − σ)·x0 + σ·ε``, target ``v = ε − x0``. Epsilon models (variance preserving,
    ``σ = √(1 − ᾱ)``): ``x_σ = √(1 − σ²)·x0 + σ·ε``, target ``ε``.
    """
    s = (sigma.to(x0.dtype) if x0.dtype == torch.float64 else sigma.float()).reshape(-1, *([1] * (x0.ndim - 1)))
    if prediction_type == "flow":
        return (1 - s) * x0 + s * noise, noise - x0
    if prediction_type == "epsilon":
        return torch.sqrt(1 - s**2) * x0 + s * noise, noise
    raise ValueError(f"unknown prediction_type {prediction_type!r}; use 'flow' or 'epsilon'")


def objective_noise(seeds: torch.Tensor, seed: int, k: int, shape, device) -> torch.Tensor:
    """``[B, *shape]`` standard normal noise of re-noising ``k`` of each sample (stream ``OBJECTIVE_NOISE``)."""
    gens = generators([derive(seed, Stream.OBJECTIVE_NOISE, int(s), k) for s in seeds.tolist()])
    return randn_per_sample((len(gens), *shape), gens, device)


def schedule_levels(sigmas: torch.Tensor, seeds: torch.Tensor, seed: int, n: int | None) -> torch.Tensor:
    """``[n, B]`` noise levels: each sample visits the sampler's levels (the schedule without its final
    0) in its own seeded random order, and the first ``n`` (default all) are trained (DiffusionNFT's
    per-sample shuffle of the timesteps)."""
    levels = sigmas[:-1]
    n = len(levels) if n is None else max(1, min(n, len(levels)))
    orders = [torch.randperm(len(levels), generator=g)[:n] for g in generators([derive(seed, Stream.NFT_TIMESTEPS, int(s)) for s in seeds.tolist()])]
    return levels[torch.stack(orders, 1)]


@dataclass(frozen=True)
class Renoised:
    """One noise level of a flow objective's micro-batch: ``x_t = (1 − σ)·x0 + σ·ε`` and the target ``ε − x0``."""

    sigma: torch.Tensor
    x_t: torch.Tensor
    target: torch.Tensor
    cond: TensorDict
    weight: float
    """the level's share of the micro-batch's loss (1 / number of levels)"""


def renoised_clean_samples(engine, micro: TensorDict, seed: int, num_timesteps: int | None, objective: str,
                           levels: torch.Tensor | None = None) -> Iterator[Renoised]:
    """The clean samples ``latents[:, -1]`` of ``micro`` re-noised at ``num_timesteps`` levels of the sampler's
    schedule (:func:`schedule_levels`; or the given ``levels [n, B]``) with the objective's noise
    (:func:`objective_noise`), on the engine's device.

    Raises:
        ValueError: for a model that does not predict velocity (``objective`` names the caller).
    """
    adapter = engine.adapter
    if adapter.prediction_type != "flow":
        raise ValueError(f"the {objective} objective needs a flow-matching model (velocity prediction)")
    device = adapter.device
    x0 = micro["latents"][:, -1].to(device)
    x0 = x0 if x0.dtype == torch.float64 else x0.float()  # fp32 compute; fp64 kept (the parity tests)
    cond = micro["cond"].to(device)
    if levels is None:
        levels = schedule_levels(micro["sigmas"][0], micro["seeds"], seed, num_timesteps)
    for k in range(levels.shape[0]):
        sigma = levels[k].to(device)
        x_t, target = forward_noise(x0, sigma, objective_noise(micro["seeds"], seed, k, x0.shape[1:], device), "flow")
        yield Renoised(sigma, x_t, target, cond, 1.0 / len(levels))
