"""DiffusionNFT (Zheng et al. 2025): negative-aware fine-tuning on the forward process.

Sample with the ``old`` policy (any solver, deterministic by default), map rewards to ``r ∈ [0, 1]``
(``losses.nft_reward_to_r``), train the ``default`` policy with the NFT objective on re-noised clean
samples (:func:`nft_objective_loss`), then move the old policy towards it by the EMA schedule (:func:`old_decay`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from tensordict import TensorDict

from diffrl.algorithms.advantages import check_group_size
from diffrl.algorithms.base import BASE, Algorithm, Granularity, MicroBatchObjective, ObjectiveSpec, RolloutPlan, StepResult, register_algorithm, sample_only_plan
from diffrl.algorithms.losses import nft_loss, nft_reward_to_r
from diffrl.algorithms.objectives import renoised_clean_samples
from diffrl.config import AlgorithmConfig, Check, at_least, between, one_of, positive
from diffrl.sampling.schedules import WindowMasks

OLD_SCHEDULES = {
    "copy": (0.0, 0.0, 0),
    "linear_to_0_5": (0.001, 0.5, 0),
    "delayed_linear": (0.0075, 0.999, 75),
    "constant": (0.0, 0.5, 0),
}
"""The old policy's decay schedules: name → default (rate, max, delay)."""


@dataclass
class NFTConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {
        "nft_beta": positive(), "nft_num_timesteps": at_least(1), "old_schedule": one_of(*OLD_SCHEDULES),
        "old_decay_rate": at_least(0, integer=False), "old_decay_max": between(0, 1), "old_decay_delay": at_least(0),
        "nft_policy_scale": positive(),
    }

    name: str = "nft"
    trainer: str = "nft"
    nft_beta: float = 1.0
    """DiffusionNFT β"""
    nft_adaptive_weight: bool = True
    """DiffusionNFT's x0-space adaptively weighted loss"""
    nft_num_timesteps: Optional[int] = None
    """noise levels of the sampler schedule trained per sample (null: all K)"""
    old_schedule: str = "linear_to_0_5"
    """old-policy EMA decay: copy | linear_to_0_5 | delayed_linear | constant"""
    old_decay_rate: Optional[float] = None
    """decay increase per RL step (null: the schedule's default)"""
    old_decay_max: Optional[float] = None
    """largest decay (null: the schedule's default)"""
    old_decay_delay: Optional[int] = None
    """delayed_linear: RL steps at decay 0 (null: 75)"""
    nft_policy_scale: float = 1.0
    """factor on the policy term, the KL term unscaled (the reference code multiplies it by its adv_clip_max, 5)"""


class NFTObjective(MicroBatchObjective):
    """DiffusionNFT (Zheng et al. 2025) on the clean samples ``latents[:, -1]`` of rollouts drawn by the
    ``old`` policy: at the noise levels of the sampler's schedule (each sample in its own random order,
    ``num_timesteps`` of them, default all), fresh noise, then :func:`nft_objective_loss`
    between the trained policy (``default``), the old policy and the target ``ε − x0``; optional velocity
    KL to the reference (adapters disabled). Needs ``batch["nft_r"]`` (``[B]`` in ``[0, 1]``). Its spec: pieces per
    micro-batch, the old policy, the base reference when ``kl_beta > 0``.
    """

    def __init__(self, *, nft_beta: float, adaptive_weight: bool, kl_beta: float, num_timesteps: int | None, policy_scale: float):
        super().__init__(ObjectiveSpec(name="nft", granularity=Granularity.MICRO_BATCH, reference=BASE if kl_beta > 0 else None, old_policy=True))
        self.nft_beta, self.adaptive_weight, self.kl_beta = nft_beta, adaptive_weight, kl_beta
        self.num_timesteps, self.policy_scale = num_timesteps, policy_scale

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        guidance, r = engine.sampler.guidance_scale, micro["nft_r"].to(engine.adapter.device)
        for piece in renoised_clean_samples(engine, micro, seed, self.num_timesteps, "nft"):
            with torch.no_grad(), engine.old_policy() as old:
                v_old = old.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            v_ref = None
            if self.spec.reference is not None:
                with torch.no_grad(), engine.reference_policy(self.spec.reference) as ref:
                    v_ref = ref.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            v_theta = engine.adapter.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            loss, metrics = nft_objective_loss(
                v_theta, v_old, piece.target, r, nft_beta=self.nft_beta, adaptive_weight=self.adaptive_weight, sigma=piece.sigma,
                policy_scale=self.policy_scale, kl_beta=self.kl_beta, v_ref=v_ref,
            )
            yield loss, piece.weight, metrics


def nft_objective_loss(v_theta, v_old, v_target, r, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT's loss as the objective trains it: :func:`diffrl.algorithms.losses.nft_loss` (eq. 7 of Zheng et al.
    2025, the ``1/β`` factor, the x0-space adaptive weight, the policy term scaled by ``policy_scale``)."""
    return nft_loss(v_theta, v_old, v_target, r, **kwargs)


def old_decay(schedule: str, step: int, *, rate: float | None = None, max_decay: float | None = None, delay: int | None = None) -> float:
    """DiffusionNFT's decay of the old policy after RL step ``step`` (old ← d·old + (1 − d)·current).

    ``copy``: 0 (old = current). ``linear_to_0_5``: ``min(rate·step, max)`` with rate 0.001 and max 0.5
    by default. ``delayed_linear``: 0 for ``step < delay``, then ``min(rate·(step − delay), max)`` with
    delay 75, rate 0.0075, max 0.999 by default (the reference code's three decay types).
    ``constant``: ``max`` at every step.
    """
    if schedule not in OLD_SCHEDULES:
        raise ValueError(f"unknown algorithm.old_schedule {schedule!r}; choose one of {sorted(OLD_SCHEDULES)}")
    d_rate, d_max, d_delay = OLD_SCHEDULES[schedule]
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


@register_algorithm("nft")
class NFT(Algorithm):
    Config = NFTConfig

    def objective(self) -> NFTObjective:
        a = self.config
        return NFTObjective(nft_beta=a.nft_beta, adaptive_weight=a.nft_adaptive_weight, kl_beta=a.kl_beta, num_timesteps=a.nft_num_timesteps,
                            policy_scale=a.nft_policy_scale)

    def validate(self, num_workers: int) -> None:
        old_decay(self.config.old_schedule, 1, rate=self.config.old_decay_rate, max_decay=self.config.old_decay_max, delay=self.config.old_decay_delay)
        check_group_size(self.run.group_size, f"algorithm={self.config.name}")  # r = ½ for every sample: only a pull towards the old policy

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        return sample_only_plan(self.run.sampler, masks, "old")

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        return self.run.batch.rows * int(self.config.nft_num_timesteps or self.run.sampler.num_steps), 1 + int(self.config.kl_beta > 0)

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        a = self.config
        traj["nft_r"] = nft_reward_to_r(scores["rewards"], traj["group_id"], adv_clip_max=a.adv_clip_max, std_mode=a.adv_std_mode, eps=a.adv_eps)
        del traj["metrics"]
        out = self.train_epochs(workers, traj, traj.shape[0], step)
        decay = old_decay(a.old_schedule, step + 1, rate=a.old_decay_rate, max_decay=a.old_decay_max, delay=a.old_decay_delay)
        workers.ema_update_adapter("default", "old", decay)
        return StepResult(out, {"r_mean": traj["nft_r"].mean().item(), "old_decay": decay})
