"""Advantage Weighted Matching (AWM; Xue et al., arXiv:2509.25050, 2025).

Formula (``awm_loss``): on a policy sample x0 (the rollout's final latent), a fresh ε and a noise level σ
drawn independently of the rollout's trajectory, ``x_σ = (1 − σ)·x0 + σ·ε``, the loss is the pretraining
flow-matching error weighted per sample by its advantage,
``L = mean_i Â_i·w(‖v_θ(x_σ) − (ε − x0)‖²) + β·mean ‖v_θ − v_ref‖²``, so good samples are pulled towards
their own flow-matching target and bad ones pushed away. The paper's argument: Flow-GRPO's per-step
likelihood is denoising score matching with noisy targets (x_{t−Δt} instead of x0), which adds variance;
AWM keeps the clean target of pretraining. Claim: up to 24× faster than Flow-GRPO on GenEval, OCR and
PickScore with SD3.5-Medium and FLUX, at equal quality.

Choices here: advantages group-relative (``adv_std_mode``, as Flow-GRPO) then ``clip(A, ±c)/c`` (the
reference code's scaling to [−1, 1]); ``awm_num_timesteps`` noise levels of the sampler's schedule per
sample, each sample in its own seeded order (the reference code stratifies the sampler's grid); one update
per rollout (on-policy: the reference code's PPO ratio is 1, so it is left out). Not implemented: the
reference code's second anchor to an EMA of the trained weights (``ema_beta``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict

from diffrl.algorithms.awm_loss import AWM_WEIGHTINGS, awm_loss
from diffrl.algorithms.base import RolloutPlan, register_algorithm, sample_only_plan
from diffrl.algorithms.objectives import renoised_clean_samples
from diffrl.algorithms.policy_gradient import GroupAdvantageAlgorithm
from diffrl.config import AlgorithmConfig, Check, at_least, one_of, positive
from diffrl.sampling.schedules import WindowMasks


@dataclass
class AWMConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"awm_weighting": one_of(*AWM_WEIGHTINGS), "awm_ghuber_power": positive(), "awm_num_timesteps": at_least(1)}

    name: str = "awm"
    trainer: str = "awm"
    awm_weighting: str = "ghuber"
    """per-sample weighting of the flow-matching error: uniform | sigma | sigma2 | huber | ghuber (the paper's released configs)"""
    awm_ghuber_power: float = 0.25
    """p of the ghuber weighting"""
    awm_num_timesteps: int = 4
    """noise levels of the sampler schedule trained per sample"""


class AWMObjective:
    """The AWM loss on the clean samples ``latents[:, -1]`` with ``batch["advantages"]``; velocity KL to the
    reference (adapters disabled) when ``kl_beta > 0``."""

    loss_name = "awm"

    def __init__(self, *, weighting: str, ghuber_power: float, num_timesteps: int, adv_clip_max: float, kl_beta: float):
        self.weighting, self.ghuber_power, self.num_timesteps = weighting, ghuber_power, num_timesteps
        self.adv_clip_max, self.kl_beta = adv_clip_max, kl_beta
        self.needs_reference = kl_beta > 0

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        guidance, advantages = engine.sampler.guidance_scale, micro["advantages"].to(engine.adapter.device)
        for piece in renoised_clean_samples(engine, micro, seed, self.num_timesteps, "awm"):
            v_ref = None
            if self.needs_reference:
                with torch.no_grad(), engine.reference() as ref:
                    v_ref = ref.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            v_theta = engine.adapter.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            loss, metrics = awm_loss(
                v_theta, piece.target, advantages, sigma=piece.sigma, weighting=self.weighting, ghuber_power=self.ghuber_power,
                adv_clip_max=self.adv_clip_max, kl_beta=self.kl_beta, v_ref=v_ref,
            )
            yield loss, piece.weight, {k: v for k, v in metrics.items() if math.isfinite(v)}


@register_algorithm("awm")
class AWM(GroupAdvantageAlgorithm):
    Config = AWMConfig

    def validate(self, num_workers: int) -> None:
        if self.config.awm_weighting not in AWM_WEIGHTINGS:
            raise ValueError(f"unknown algorithm.awm_weighting {self.config.awm_weighting!r}; choose one of {AWM_WEIGHTINGS}")
        if self.config.awm_num_timesteps < 1:
            raise ValueError(f"algorithm.awm_num_timesteps must be ≥ 1, got {self.config.awm_num_timesteps}")
        super().validate(num_workers)

    def objective(self):
        a = self.config
        return AWMObjective(weighting=a.awm_weighting, ghuber_power=a.awm_ghuber_power, num_timesteps=a.awm_num_timesteps, adv_clip_max=a.adv_clip_max, kl_beta=a.kl_beta)

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        return sample_only_plan(self.run.sampler, masks, "current")

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        return self.run.prompts_per_step * self.run.group_size * self.config.awm_num_timesteps, int(self.config.kl_beta > 0)
