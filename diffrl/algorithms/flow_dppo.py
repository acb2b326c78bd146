"""Flow-DPPO (Divergence Proximal Policy Optimization for flow matching models, arXiv:2606.11025; in verl-omni,
UniRL and Flow-Factory), after DPPO for LLMs (Qi et al., "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv:2602.04879).

Flow-GRPO's trust region is PPO's clip of the per-step ratio ``r = π_θ(x_{t−1}|x_t) / π_old(x_{t−1}|x_t)``, but
that ratio is one noisy sample of a high-dimensional Gaussian transition: it moves by ``O(‖Δμ‖/s)`` from the draw
alone, so the clip masks steps that barely changed and passes steps that changed a lot. A flow model's step is
Gaussian with a θ-independent std ``s = σ_t·√Δt``, so the divergence the trust region is about is exact and cheap:

    D_i = KL(π_old ‖ π_θ) per dim = mean_dims (μ_θ − μ_old)² / (2·s²)        (no gradient)

Flow-DPPO keeps Flow-GRPO's rollout, group advantages and ratio, and replaces the clip by an asymmetric mask on
``D``: a sample-step leaves the gradient only when it is outside the trust region *and* the update would push it
further the way its advantage pulls (corrective updates always stay):

    m_i = 0  if  D_i > δ  and  ((Â_i > 0 and r_i > 1) or (Â_i < 0 and r_i < 1)),  else 1
    L   = −mean_i m_i·r_i·Â_i  +  β_KL·mean_i KL(π_θ ‖ π_ref)_i

``δ`` is ``algorithm.kl_mask_threshold`` (verl-omni's ``kl_mask_threshold`` 1e-5 on Qwen-Image, Flow-Factory's
1e-6 on SD3.5). With one optimizer step per rollout ``μ_θ = μ_old``, ``D = 0`` and nothing is masked: the mask acts
from the second optimizer step on (``algorithm.mini_batch_size`` / ``algorithm.epochs``), which is where a trust
region matters. The rollout records each step's transition mean (the objective declares ``record_means``).

Choices: the reference of the optional KL is the model with its LoRA disabled (as Flow-GRPO here); off-policy
rollouts (rollout replicas with staleness, FP8 rollouts) are refused, since the mask needs the proximal policy's
step means, which the rollout does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict

from diffrl.algorithms.base import BASE, Granularity, ObjectiveSpec, StepObjective, register_algorithm
from diffrl.algorithms.losses import gaussian_kl_same_std, step_kl
from diffrl.algorithms.policy_gradient import GroupAdvantageAlgorithm
from diffrl.config import AlgorithmConfig, Check, positive


def divergence_mask(advantages: torch.Tensor, ratio: torch.Tensor, divergence: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]`` float: 0 where ``D > δ`` and the ratio has moved the way the advantage pulls, else 1."""
    outward = ((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1))
    return (~(outward & (divergence > threshold))).float()


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    threshold: float,
    kl_beta: float = 0.0,
    ref_mean: torch.Tensor | None = None,
    dt: torch.Tensor | None = None,
    kl_dt_scale: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-DPPO's per-step objective (module docstring).

    Args:
        log_prob: ``[B]`` current log-probs of the recorded samples (with grad); old_log_prob: ``[B]`` the rollout's.
        advantages: ``[B]``.
        mean: ``[B, …]`` current transition mean (with grad); old_mean: the rollout's (no grad); std: the step std,
            broadcastable to ``mean``.
        threshold: δ of the divergence mask.
        kl_beta, ref_mean, dt, kl_dt_scale: the optional KL to the reference, as in ``flow_grpo_loss``.
    Returns:
        ``(loss, metrics)``: ``policy_loss``, ``kl``, ``divergence_mean`` and ``divergence_max`` (of ``D``),
        ``masked_frac`` (sample-steps masked), ``ratio_mean``, ``ratio_std``, ``approx_kl`` (½·mean (Δlog p)²).
    """
    a = advantages.float().to(log_prob.device)
    log_ratio = log_prob.float() - old_log_prob.float().to(log_prob.device)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        divergence = gaussian_kl_same_std(mean.detach().float(), old_mean.float().to(mean.device), std.float())
        mask = divergence_mask(a, ratio.detach(), divergence, threshold)
    policy = -(mask * ratio * a).mean()
    metrics = {"policy_loss": policy.item(), "kl": 0.0}
    loss = policy
    if kl_beta > 0:
        if ref_mean is None:
            raise ValueError("flow_dppo: kl_beta > 0 needs the reference step mean ref_mean")
        kl = step_kl(mean, ref_mean, std, dt=dt, kl_dt_scale=kl_dt_scale, needed_by="flow_dppo").mean()
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    with torch.no_grad():
        metrics.update(
            divergence_mean=divergence.mean().item(), divergence_max=divergence.max().item(), masked_frac=(1 - mask).mean().item(),
            ratio_mean=ratio.mean().item(), ratio_std=ratio.std(unbiased=False).item() if ratio.numel() > 1 else 0.0,
            approx_kl=(0.5 * log_ratio**2).mean().item(),
        )
    return loss, metrics


class FlowDPPOStepLoss(StepObjective):
    """The engine's per-step loss ``fn(step, batch, k)``: reads ``batch["log_probs"][:, k]``, ``batch["means"][:, k]``
    (the rollout's transition means), ``batch["advantages"]`` and ``dt`` from ``batch["sigmas"]``. Its spec: rollouts
    record the step means; the base reference when ``kl_beta > 0``; no off-policy correction (the mask needs the
    proximal policy's step means)."""

    def __init__(self, *, threshold: float, kl_beta: float, kl_dt_scale: bool):
        super().__init__(ObjectiveSpec(name="flow_dppo", granularity=Granularity.STEP, reference=BASE if kl_beta > 0 else None, record_means=True))
        self.threshold, self.kl_beta, self.kl_dt_scale = threshold, kl_beta, kl_dt_scale

    def __call__(self, step: dict, batch: TensorDict, k: int):
        keys = set(batch.keys())
        if "means" not in keys:
            raise ValueError("flow_dppo needs the rollout step means batch['means'] [B, K, …] (recorded by a rollout whose request carries the objective's spec.record_means)")
        dt = batch["sigmas"][:, k] - batch["sigmas"][:, k + 1] if "sigmas" in keys else None
        return flow_dppo_loss(
            step["log_prob"], batch["log_probs"][:, k], batch["advantages"], mean=step["mean"], old_mean=batch["means"][:, k],
            std=step["std"], threshold=self.threshold, kl_beta=self.kl_beta, ref_mean=step.get("ref_mean"), dt=dt, kl_dt_scale=self.kl_dt_scale,
        )


@dataclass
class FlowDPPOConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"kl_mask_threshold": positive()}

    name: str = "flow_dppo"
    trainer: str = "flow_dppo"
    kl_mask_threshold: float = 1e-5
    """δ of the divergence mask: a sample-step moving outward with per-dim KL(π_old‖π_θ) above it leaves the gradient"""
    kl_dt_scale: bool = False
    """the optional KL to the reference with the dt factor ((μ−μ_ref)²/(2σ_t²)), as Flow-GRPO's"""


@register_algorithm("flow_dppo")
class FlowDPPO(GroupAdvantageAlgorithm):
    Config = FlowDPPOConfig

    def objective(self) -> FlowDPPOStepLoss:
        a = self.config
        return FlowDPPOStepLoss(threshold=a.kl_mask_threshold, kl_beta=a.kl_beta, kl_dt_scale=a.kl_dt_scale)
