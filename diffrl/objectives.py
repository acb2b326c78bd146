"""Objectives on clean samples: DiffusionNFT and Diffusion-DPO wired to the model.

Policy-gradient losses score the recorded SDE transitions step by step (``losses.make_step_loss``).
The objectives here instead re-noise the final clean latents with the forward process and regress the
model's prediction, as DiffusionNFT and Diffusion-DPO do. Each objective is called by the engine on one
micro-batch and yields ``(loss, weight, metrics)`` pieces whose weights sum to the micro-batch's share of
the mini-batch, so gradient accumulation equals one large batch.

The noise of each (sample, timestep) comes from a generator seeded by the sample's seed and the
optimizer step's ``seed``, so a piece is the same whatever micro-batch it falls in.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from diffrl.losses import dpo_loss, nft_loss
from diffrl.rollout import make_generators, sample_seed
from diffrl.sde import randn_per_sample


def forward_noise(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor, prediction_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_σ, target)``: the forward process at noise level ``sigma [B]`` and the prediction target.

    Flow models: ``x_σ = (1 − σ)·x0 + σ·ε``, target ``v = ε − x0``. Epsilon models (variance preserving,
    ``σ = √(1 − ᾱ)``): ``x_σ = √(1 − σ²)·x0 + σ·ε``, target ``ε``.
    """
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    if prediction_type == "flow":
        return (1 - s) * x0 + s * noise, noise - x0
    if prediction_type == "epsilon":
        return torch.sqrt(1 - s**2) * x0 + s * noise, noise
    raise ValueError(f"unknown prediction_type {prediction_type!r}; use 'flow' or 'epsilon'")


def _noise(seeds: torch.Tensor, seed: int, k: int, shape, device) -> torch.Tensor:
    gens = make_generators([sample_seed(seed, int(s), k, 1) for s in seeds.tolist()])
    return randn_per_sample((len(gens), *shape), gens, device)


def _train_sigmas(sigmas: torch.Tensor, seeds: torch.Tensor, seed: int, n: int | None) -> torch.Tensor:
    """``[n, B]`` noise levels: each sample visits the sampler's levels (the schedule without its final
    0) in its own seeded random order, and the first ``n`` (default all) are trained (DiffusionNFT's
    per-sample shuffle of the timesteps)."""
    levels = sigmas[:-1]
    n = len(levels) if n is None else max(1, min(n, len(levels)))
    orders = [torch.randperm(len(levels), generator=g)[:n] for g in make_generators([sample_seed(seed, int(s), 0, 4) for s in seeds.tolist()])]
    return levels[torch.stack(orders, 1)]


class NFTObjective:
    """DiffusionNFT (Zheng et al. 2025) on the clean samples ``latents[:, -1]`` of rollouts drawn by the
    ``old`` policy: at the noise levels of the sampler's schedule (each sample in its own random order,
    ``num_timesteps`` of them, default all), fresh noise, then ``losses.nft_loss``
    between the trained policy (``default``), the old policy and the target ``ε − x0``; optional velocity
    KL to the reference (adapters disabled). Needs ``batch["nft_r"]`` (``[B]`` in ``[0, 1]``).
    """

    loss_name = "nft"

    def __init__(self, *, nft_beta: float, adaptive_weight: bool = True, kl_beta: float = 0.0, num_timesteps: int | None = None):
        self.nft_beta, self.adaptive_weight, self.kl_beta = nft_beta, adaptive_weight, kl_beta
        self.num_timesteps = num_timesteps
        self.needs_reference = kl_beta > 0

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        adapter = engine.adapter
        if adapter.prediction_type != "flow":
            raise ValueError("the nft objective needs a flow-matching model (velocity prediction)")
        device = adapter.device
        x0 = micro["latents"][:, -1].to(device).float()
        cond = micro["cond"].to(device)
        levels = _train_sigmas(micro["sigmas"][0], micro["seeds"], seed, self.num_timesteps)
        for k in range(levels.shape[0]):
            sigma = levels[k].to(device)
            x_t, target = forward_noise(x0, sigma, _noise(micro["seeds"], seed, k, x0.shape[1:], device), "flow")
            with torch.no_grad(), engine.old_policy() as old:
                v_old = old.predict(x_t, sigma, cond, engine.sampler.guidance_scale)
            v_ref = None
            if self.needs_reference:
                with torch.no_grad(), engine.reference() as ref:
                    v_ref = ref.predict(x_t, sigma, cond, engine.sampler.guidance_scale)
            v_theta = adapter.predict(x_t, sigma, cond, engine.sampler.guidance_scale)
            loss, metrics = nft_loss(
                v_theta, v_old, target, micro["nft_r"].to(device), nft_beta=self.nft_beta,
                adaptive_weight=self.adaptive_weight, sigma=sigma, kl_beta=self.kl_beta, v_ref=v_ref,
            )
            yield loss, 1.0 / len(levels), metrics


class DPOObjective:
    """Diffusion-DPO (Wallace et al. 2023) on pairs ``latents_w``/``latents_l`` (clean, ``[B, …]``) with
    ``cond``: ``num_timesteps`` noise levels per pair drawn uniformly in ``(0, 1)`` (the paper's uniform
    t), winner and loser sharing the noise and the level; errors of the trained model and of the reference
    (adapters disabled) go to ``losses.dpo_loss``.
    """

    loss_name = "dpo"
    needs_reference = True

    def __init__(self, *, dpo_beta: float, num_timesteps: int = 1):
        if num_timesteps < 1:
            raise ValueError(f"algorithm.dpo_num_timesteps must be ≥ 1, got {num_timesteps}")
        self.dpo_beta, self.num_timesteps = dpo_beta, num_timesteps

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        adapter = engine.adapter
        device = adapter.device
        x_w, x_l = micro["latents_w"].to(device).float(), micro["latents_l"].to(device).float()
        cond = micro["cond"].to(device)
        for k in range(self.num_timesteps):
            gens = make_generators([sample_seed(seed, int(s), k, 2) for s in micro["seeds"].tolist()])
            u = torch.stack([torch.rand((), generator=g) for g in gens]).to(device)
            sigma = (0.001 + 0.998 * u).float()
            noise = _noise(micro["seeds"], seed, k, x_w.shape[1:], device)
            xt_w, target_w = forward_noise(x_w, sigma, noise, adapter.prediction_type)
            xt_l, target_l = forward_noise(x_l, sigma, noise, adapter.prediction_type)
            x_both, sigma_both = torch.cat([xt_w, xt_l]), torch.cat([sigma, sigma])
            cond_both = torch.cat([cond, cond])
            target_both = torch.cat([target_w, target_l])
            pred = adapter.predict(x_both, sigma_both, cond_both, engine.sampler.guidance_scale)
            with torch.no_grad(), engine.reference() as ref:
                ref_pred = ref.predict(x_both, sigma_both, cond_both, engine.sampler.guidance_scale)
            dims = tuple(range(1, pred.ndim))
            err = ((pred.float() - target_both) ** 2).mean(dim=dims)
            ref_err = ((ref_pred.float() - target_both) ** 2).mean(dim=dims)
            n = x_w.shape[0]
            loss, metrics = dpo_loss(err[:n], err[n:], ref_err[:n], ref_err[n:], dpo_beta=self.dpo_beta)
            yield loss, 1.0 / self.num_timesteps, metrics


def old_decay(schedule: str, step: int, *, rate: float | None = None, max_decay: float | None = None, delay: int | None = None) -> float:
    """DiffusionNFT's decay of the old policy after RL step ``step`` (old ← d·old + (1 − d)·current).

    ``copy``: 0 (old = current). ``linear_to_0_5``: ``min(rate·step, max)`` with rate 0.001 and max 0.5
    by default. ``delayed_linear``: 0 for ``step < delay``, then ``min(rate·(step − delay), max)`` with
    delay 75, rate 0.0075, max 0.999 by default (the reference code's three decay types).
    ``constant``: ``max`` at every step.
    """
    defaults = {
        "copy": (0.0, 0.0, 0),
        "linear_to_0_5": (0.001, 0.5, 0),
        "delayed_linear": (0.0075, 0.999, 75),
        "constant": (0.0, 0.5, 0),
    }
    if schedule not in defaults:
        raise ValueError(f"unknown algorithm.old_schedule {schedule!r}; choose one of {sorted(defaults)}")
    d_rate, d_max, d_delay = defaults[schedule]
    rate = d_rate if rate is None else rate
    max_decay = d_max if max_decay is None else max_decay
    delay = d_delay if delay is None else delay
    if not 0.0 <= max_decay <= 1.0:
        raise ValueError(f"algorithm.old_decay_max must be in [0, 1], got {max_decay}")
    if schedule == "copy":
        return 0.0
    if schedule == "constant":
        return max_decay
    if step < delay:
        return 0.0
    return min(rate * (step - delay), max_decay) if math.isfinite(rate) else max_decay
