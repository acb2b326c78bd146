"""Diffusion RL losses: pure functions of per-step tensors, selected by name from a registry.

Each loss takes the outputs of one denoising step for a micro-batch and returns ``(loss, metrics)``:
``loss`` a scalar to back-propagate, ``metrics`` a dict of floats (already detached).
"""

from __future__ import annotations

from typing import Callable

import torch

LOSSES: dict[str, Callable] = {}


def register_loss(name: str):
    def wrap(fn):
        LOSSES[name] = fn
        return fn

    return wrap


def get_loss(name: str) -> Callable:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {sorted(LOSSES)}")
    return LOSSES[name]


def gaussian_kl_same_std(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[B]``: KL(N(mean, std²) ‖ N(ref_mean, std²)) per dim, averaged over non-batch dims.

    For equal stds the KL is ``(mean − ref_mean)² / (2·std²)`` (Flow-GRPO's KL term).
    """
    kl = (mean - ref_mean) ** 2 / (2 * std.expand_as(mean) ** 2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


@register_loss("flow_grpo")
def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO's per-step objective (Liu et al. 2025, eq. 8), PPO clipping (Schulman et al. 2017).

        ratio = exp(log_prob − old_log_prob)
        L = mean_i max(−A_i·ratio_i, −A_i·clip(ratio_i, 1 − ε, 1 + ε)) + β·mean_i KL_i

    with ``KL_i = mean_dims (mean − ref_mean)² / (2·std²)`` between the policy's and the reference's
    Gaussian transitions (same std). The reference is the actor with its LoRA disabled.

    Args:
        log_prob: ``[B]`` current policy log-probs of the recorded ``prev_sample`` (with grad).
        old_log_prob: ``[B]`` rollout log-probs.
        advantages: ``[B]``.
        clip_range: ε.
        kl_beta: β; with β > 0, ``mean``, ``ref_mean`` and ``std`` are required.
    Returns:
        ``(loss, metrics)``: metrics ``policy_loss``, ``kl``, ``approx_kl`` (½·mean (Δlog p)²),
        ``clipfrac`` (fraction with ``|ratio − 1| > ε``), ``ratio_mean``, ``ratio_std``.
    """
    advantages = advantages.float()
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    loss = policy_loss
    kl_value = 0.0
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("flow_grpo with kl_beta > 0 needs mean, ref_mean and std")
        kl = gaussian_kl_same_std(mean.float(), ref_mean.float(), std.float()).mean()
        loss = loss + kl_beta * kl
        kl_value = kl.item()
    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.item(),
            "kl": kl_value,
            "approx_kl": (0.5 * log_ratio**2).mean().item(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean().item(),
            "ratio_mean": ratio.mean().item(),
            "ratio_std": ratio.std(unbiased=False).item() if ratio.numel() > 1 else 0.0,
        }
    return loss, metrics


def make_step_loss(name: str, **hyper):
    """Bind a policy-gradient loss of the registry to the engine's per-step interface.

    The returned ``fn(step, batch, k)`` reads the rollout log-probs ``batch["log_probs"][:, k]`` and
    ``batch["advantages"]``; ``fn.needs_reference`` is true when ``kl_beta > 0``.
    """
    loss = get_loss(name)

    def step_loss(step: dict, batch, k: int):
        return loss(
            step["log_prob"], batch["log_probs"][:, k], batch["advantages"],
            mean=step["mean"], ref_mean=step.get("ref_mean"), std=step["std"], **hyper,
        )

    step_loss.needs_reference = hyper.get("kl_beta", 0.0) > 0
    step_loss.loss_name = name
    return step_loss
