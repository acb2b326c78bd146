"""Policy gradient on the per-step SDE log-probs: Flow-GRPO and its variants, DanceGRPO, GRPO-Guard, DDPO.

Sample SDE trajectories with the current policy, score them, turn rewards into advantages (group-relative,
or DDPO's per-prompt stat tracker), and take clipped-ratio steps on the trained steps' log-probs with the
loss of ``algorithm.loss`` (``diffrl.algorithms.losses``: ``flow_grpo``, ``grpo_guard``, ``ddpo``), whose
``StepLoss`` declares its needs (the base reference with ``kl_beta > 0``; truncated-IS correction of off-policy
rollouts for ``flow_grpo``/``ddpo``; recorded step means for ``grpo_guard``). The variants differ in the sampler (step kind, training window) and the loss, not in this class:
Flow-GRPO-Fast and MixGRPO are windows, DanceGRPO is ``sampler.kind=dance_sde`` with a random window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict

from diffrl.algorithms.advantages import (
    PerPromptStatTracker,
    aggregate_rewards,
    check_group_size,
    group_std_keep_mask,
    nonzero_advantage_keep_mask,
)
from diffrl.algorithms.base import Algorithm, StepResult, register_algorithm
from diffrl.algorithms.losses import STEP_LOSSES, StepLoss, make_step_loss
from diffrl.config import AlgorithmConfig, Check, at_least, between, one_of, positive


@dataclass
class PolicyGradientConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {
        "loss": one_of(*STEP_LOSSES), "clip_range": positive(), "adv_tracker_buffer": at_least(1), "adv_tracker_min_count": at_least(1),
        "rollout_is_cap": at_least(1, integer=False), "adv_std_ddof": between(0, 2, hi_open=True, note="0: population std, 1: unbiased"),
    }

    loss: str = "flow_grpo"
    """policy-gradient loss in the diffrl.algorithms.losses registry: flow_grpo | grpo_guard | ddpo"""
    clip_range: float = 0.2
    """PPO ratio clip ε"""
    kl_dt_scale: bool = False
    """Flow-GRPO KL with the dt factor ((μ−μ_ref)²/(2σ_t²)) instead of the exact Gaussian KL"""
    ratio_norm: bool = True
    """grpo_guard: normalise the log-ratio (RatioNorm)"""
    grad_reweight: bool = True
    """grpo_guard: reweight each step's surrogate by 1/Δt"""
    adv_drop_zero_std: bool = False
    """drop prompt groups whose rewards are all equal (counted in metrics)"""
    adv_drop_zero_advantage: bool = False
    """drop every sample whose advantage is exactly 0 before the update (flow_grpo): all-equal groups and any sample whose
    reward equals its group's mean (counted in metrics as dropped_samples)"""
    adv_std_ddof: float = 0.0
    """advantage std = sqrt(Σ(r − mean)²/(N − ddof)): 0 population (numpy, flow_grpo), 1 unbiased (torch.std), 1/T for
    verl-omni (torch.std of the rewards repeated over its T trained steps)"""
    adv_stat_tracker: bool = False
    """DDPO's per-prompt stat tracker instead of the current group's statistics"""
    adv_tracker_buffer: int = 32
    """stat tracker: rewards kept per prompt"""
    adv_tracker_min_count: int = 16
    """stat tracker: rewards of a prompt needed before its own statistics are used"""
    rollout_is_cap: float = 2.0
    """off-policy rollouts (distributed.max_staleness > 0): cap C of the truncated importance weight min(π_prox/μ, C) of each stale sample"""


class RewardAdvantages:
    """Rewards → advantages: group-relative statistics of the (weighted) rewards (std with ``ddof``), or DDPO's
    per-prompt stat tracker; clipped to ``±adv_clip_max``."""

    def __init__(self, config: AlgorithmConfig, reward_weights: dict[str, float], tracker: PerPromptStatTracker | None = None,
                 *, ddof: float = 0.0):
        self.config = config
        self.weights = reward_weights
        self.tracker = tracker
        self.ddof = float(ddof)

    def __call__(self, scores: dict, group_id: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        a = self.config
        if self.tracker is not None:
            return self.tracker.update(prompts, scores["rewards"]).clamp(-a.adv_clip_max, a.adv_clip_max)
        per_reward = {name: scores[f"reward/{name}"] for name in self.weights}
        extra = {"ddof": self.ddof} if self.ddof else {}
        if any(r.dtype == torch.float64 for r in per_reward.values()):  # float64 rewards (the parity tests) stay float64
            extra["dtype"] = torch.float64
        return aggregate_rewards(
            per_reward, self.weights, group_id, mode=a.reward_aggregation, std_mode=a.adv_std_mode, eps=a.adv_eps, clip_max=a.adv_clip_max,
            **extra,
        )

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict() if self.tracker is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.tracker is not None and state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])


class GroupAdvantageAlgorithm(Algorithm):
    """An algorithm trained once per rollout on its group-relative advantages (:class:`RewardAdvantages`, clipped to
    ``±adv_clip_max``), in ``algorithm.epochs`` passes of mini-batches: AWM, DGPO, Flow-DPPO. A subclass gives its
    ``Config``, ``objective`` and ``rollout_plan``; ``validate`` refuses groups of one (no group statistics)."""

    def __init__(self, config: AlgorithmConfig, run):
        super().__init__(config, run)
        self.advantages = RewardAdvantages(config, run.reward_weights)

    def validate(self, num_workers: int) -> None:
        check_group_size(self.run.group_size, f"algorithm={self.config.name}")

    def rollout_advantages(self, traj: TensorDict, scores: dict) -> torch.Tensor:
        """``[B]`` advantages of the rollout's samples."""
        return self.advantages(scores, traj["group_id"], list(traj.get("prompts").tolist()))

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        traj["advantages"] = self.rollout_advantages(traj, scores)
        del traj["metrics"]
        return StepResult(self.train_epochs(workers, traj, traj.shape[0], step), {"advantage_abs_mean": traj["advantages"].abs().mean().item()})


@register_algorithm("policy_gradient")
class PolicyGradient(Algorithm):
    Config = PolicyGradientConfig

    def __init__(self, config: PolicyGradientConfig, run):
        super().__init__(config, run)
        tracker = PerPromptStatTracker(config.adv_tracker_buffer, config.adv_tracker_min_count) if config.adv_stat_tracker else None
        if config.adv_stat_tracker and config.adv_std_ddof:
            raise ValueError("algorithm.adv_std_ddof applies to group statistics; the stat tracker (algorithm.adv_stat_tracker=true) uses population stds")
        self.advantages = RewardAdvantages(config, run.reward_weights, tracker, ddof=config.adv_std_ddof)

    def objective(self) -> StepLoss:
        a = self.config
        hyper = {"clip_range": a.clip_range, "kl_beta": a.kl_beta, "kl_dt_scale": a.kl_dt_scale, "rollout_is_cap": a.rollout_is_cap}
        if a.loss == "grpo_guard":
            hyper.update(ratio_norm=a.ratio_norm, grad_reweight=a.grad_reweight)
        return make_step_loss(a.loss, **hyper)

    def validate(self, num_workers: int) -> None:
        if not self.config.adv_stat_tracker:  # the tracker's statistics span steps (and the batch before a prompt has min_count rewards)
            check_group_size(self.run.group_size, f"algorithm={self.config.name}",
                             alternative="algorithm.adv_stat_tracker=true (DDPO's per-prompt statistics across steps)")

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        prompts = list(traj.get("prompts").tolist())
        traj["advantages"] = self.advantages(scores, traj["group_id"], prompts)
        record = {"advantage_abs_mean": traj["advantages"].abs().mean().item()}
        batch = traj
        keep = None
        if self.config.adv_drop_zero_std:
            keep, record["dropped_groups"] = group_std_keep_mask(scores["rewards"], traj["group_id"])
        if self.config.adv_drop_zero_advantage:
            nonzero, record["dropped_samples"] = nonzero_advantage_keep_mask(scores["rewards"], traj["group_id"])
            keep = nonzero if keep is None else keep & nonzero
        if keep is not None:  # rows that do not fill equal mini-batches are left out by train_epochs (rows_unused)
            if not bool(keep.any()):  # no reward signal in the step: no update
                return StepResult({"rows_unused": [0.0], "optimizer_steps": [0.0]}, record)
            batch = traj[keep]
        del batch["metrics"]
        return StepResult(self.train_epochs(workers, batch, traj.shape[0], step), record)

    def state_dict(self) -> dict:
        return {"advantages": self.advantages.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.advantages.load_state_dict(state.get("advantages", {}))
