"""GARDO (Gated and Adaptive Regularization with Diversity-aware Optimization; He et al., "Reinforcing Diffusion Models
without Reward Hacking", arXiv:2512.24138; reference code tinnerhrhe/GARDO on flow_grpo) on Flow-GRPO.

Flow-GRPO's rollout, ratio and PPO clip, with three changes aimed at reward hacking:

1. **Gated KL.** Only the samples the reward is least sure about pay the KL. Each sample of the step's batch is ranked
   (1 = best) by the optimised reward ``r`` and by each auxiliary reward ``a_k`` (``algorithm.gate_rewards``: rewards
   of ``reward.names``, usually with weight 0: scored, never optimised); its uncertainty is

       u_i = mean_k rank_{a_k}(i) − rank_r(i)

   (positive: the reward ranks it higher than the auxiliary rewards do, the reward-hacking suspect). Among the samples
   with ``u ≥ 0`` the top share ``p`` (``u`` above their ``1 − p`` quantile) is gated. ``p`` adapts as the reference
   code's risk compensator: it starts at ``gate_fraction``; when the mean ``u`` of the kept samples exceeds the largest
   of the last 20 steps' means it grows ×1.1, below the smallest it shrinks ×0.9, clipped to [0.02, 0.2]. The step KL
   ``KL_i = mean_dims (μ_θ − μ_ref)² / (2s²)`` (Flow-GRPO's, ``losses.step_kl``) is averaged over the gated samples:
   each row carries ``gate_weight_i = g_i · B / G`` (``G`` gated among ``B``), so ``mean_i gate_weight_i·KL_i`` is the
   gated mean on the whole batch and the same for any micro-batching.
2. **Adaptive reference.** The KL's reference is not the base model but a second LoRA adapter (``old``), a copy of the
   policy at the start, reset to the current policy after a step whose mean KL exceeds ``kl_reset_threshold`` or
   ``reset_every`` steps after the last reset (reference code: 3e-4 and 15 epochs).
3. **Diversity-aware advantages.** ``d_i`` = cosine distance of the sample's clean latent to the nearest other sample
   of its prompt group (the reference code: DINOv3 features of the images; here the latents, which for the pixel-space
   miniatures are the images); ``A_i = (r_i − mean_g r)·m_i`` with ``m_i = d_i / mean_g d`` when ``r_i ≥ mean_g r`` and 1
   otherwise: among the good samples the novel ones weigh more. As the reference code, no division by the group's std;
   clipped to ``±adv_clip_max``.

The reference code ranks ``rank_main − mean rank_aux`` (1 = best), the opposite sign to the paper's description of
gating the samples whose reward is over-confident; this module follows the paper (the sign is in :func:`uncertainty`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from tensordict import TensorDict

from diffrl.algorithms.base import OLD, Granularity, ObjectiveSpec, StepObjective, StepResult, register_algorithm
from diffrl.algorithms.losses import flow_grpo_loss, step_kl
from diffrl.algorithms.policy_gradient import GroupAdvantageAlgorithm
from diffrl.config import AlgorithmConfig, Check, at_least, between, positive

P_MIN, P_MAX, P_UP, P_DOWN, HISTORY = 0.02, 0.2, 1.1, 0.9, 20


def ranks(values: torch.Tensor) -> torch.Tensor:
    """``[B]`` rank of each value, 1 = largest (ties broken by position, as a stable sort)."""
    order = torch.sort(values.float(), descending=True, stable=True).indices
    out = torch.empty_like(order)
    out[order] = torch.arange(1, len(values) + 1)
    return out.float()


def uncertainty(reward: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    """``[B]`` ``u_i = mean_k rank_{aux_k}(i) − rank_reward(i)``: how much higher the reward ranks a sample than the
    auxiliary rewards do."""
    return torch.stack([ranks(a) for a in aux]).mean(0) - ranks(reward)


def gate(u: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[B]`` bool: among the samples with ``u ≥ 0``, those above the ``1 − fraction`` quantile of their ``u``."""
    kept = u[u >= 0]
    if kept.numel() == 0:
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = torch.quantile(kept.double(), 1.0 - fraction).to(u.dtype)
    return (u >= 0) & (u > threshold)


def nearest_cosine_distance(features: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """``[B]`` cosine distance ``1 − cos`` (cos clipped to [−1, 1]) from each row of ``features [B, D]`` to the nearest
    other row of its group; 0 for a sample alone in its group."""
    f = torch.nn.functional.normalize(features.flatten(1).double(), dim=1)
    d = 1.0 - (f @ f.T).clamp(-1.0, 1.0)
    same = group_id[:, None] == group_id[None, :]
    d = d.masked_fill(~same | torch.eye(len(f), dtype=torch.bool), float("inf"))
    nearest = d.min(1).values
    return torch.where(torch.isfinite(nearest), nearest, torch.zeros_like(nearest)).float()


def diversity_advantages(rewards: torch.Tensor, distance: torch.Tensor, group_id: torch.Tensor, clip_max: float) -> torch.Tensor:
    """``[B]`` GARDO's advantages: ``(r − mean_g r)·m`` with ``m = d / mean_g d`` where ``r ≥ mean_g r`` (1 elsewhere, and
    where the group's mean distance is 0), clipped to ``±clip_max``."""
    r, d = rewards.double(), distance.double()
    _, inv = torch.unique(group_id, return_inverse=True)
    n = int(inv.max()) + 1
    count = torch.zeros(n, dtype=torch.double).index_add_(0, inv, torch.ones_like(r))
    centred = r - (torch.zeros(n, dtype=torch.double).index_add_(0, inv, r) / count)[inv]
    mean_d = (torch.zeros(n, dtype=torch.double).index_add_(0, inv, d) / count)[inv]
    scale = torch.where((centred >= 0) & (mean_d > 0), d / mean_d.clamp_min(1e-12), torch.ones_like(d))
    return (centred * scale).clamp(-clip_max, clip_max).float()


def gardo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    gate_weight: torch.Tensor,
    *,
    clip_range: float,
    kl_beta: float,
    mean: torch.Tensor,
    ref_mean: torch.Tensor | None,
    std: torch.Tensor,
    dt: torch.Tensor | None = None,
    kl_dt_scale: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO's clipped surrogate plus ``β·mean_i gate_weight_i·KL_i`` (module docstring).

    Returns:
        ``(loss, metrics)``: Flow-GRPO's metrics, ``kl`` (the gated mean KL) and ``gated_frac`` (rows with a weight).
    """
    loss, metrics = flow_grpo_loss(log_prob, old_log_prob, advantages, clip_range=clip_range)
    w = gate_weight.float().to(log_prob.device)
    metrics["gated_frac"] = (w > 0).float().mean().item()
    if kl_beta > 0 and bool((w > 0).any()):
        kl = (w * step_kl(mean, ref_mean, std, dt=dt, kl_dt_scale=kl_dt_scale, needed_by="gardo")).mean()
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    return loss, metrics


class GARDOStepLoss(StepObjective):
    """The engine's per-step loss: reads ``batch["log_probs"][:, k]``, ``batch["advantages"]``, ``batch["gate_weight"]``
    and ``dt``. Its spec: the old policy, which is the reference of its KL (when ``kl_beta > 0``); no off-policy
    correction."""

    def __init__(self, *, clip_range: float, kl_beta: float, kl_dt_scale: bool):
        super().__init__(ObjectiveSpec(name="gardo", granularity=Granularity.STEP, reference=OLD if kl_beta > 0 else None, old_policy=True))
        self.clip_range, self.kl_beta, self.kl_dt_scale = clip_range, kl_beta, kl_dt_scale

    def __call__(self, step: dict, batch: TensorDict, k: int):
        dt = batch["sigmas"][:, k] - batch["sigmas"][:, k + 1] if "sigmas" in batch.keys() else None
        return gardo_loss(step["log_prob"], batch["log_probs"][:, k], batch["advantages"], batch["gate_weight"], clip_range=self.clip_range,
                          kl_beta=self.kl_beta, mean=step["mean"], ref_mean=step.get("ref_mean"), std=step["std"], dt=dt, kl_dt_scale=self.kl_dt_scale)


@dataclass
class GARDOConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {
        "clip_range": positive(), "gate_fraction": between(P_MIN, P_MAX), "kl_reset_threshold": positive(), "reset_every": at_least(1),
    }

    name: str = "gardo"
    trainer: str = "gardo"
    clip_range: float = 0.2
    """PPO ratio clip ε (Flow-GRPO's)"""
    kl_dt_scale: bool = False
    """the KL with the dt factor ((μ−μ_ref)²/(2σ_t²)), as Flow-GRPO's"""
    gate_rewards: list[str] = field(default_factory=list)
    """auxiliary rewards of the gate (names in reward.names, usually with weight 0: scored, not optimised)"""
    gate_fraction: float = 0.1
    """starting share p of the samples with u ≥ 0 that pay the KL (adapts within [0.02, 0.2])"""
    kl_reset_threshold: float = 3e-4
    """reset the reference to the policy after a step whose mean gated KL exceeds this"""
    reset_every: int = 15
    """and at the latest this many RL steps after the last reset"""
    diversity: bool = True
    """scale the positive advantages by the sample's distance to its group's nearest other sample"""


@register_algorithm("gardo")
class GARDO(GroupAdvantageAlgorithm):
    Config = GARDOConfig

    def __init__(self, config: GARDOConfig, run):
        super().__init__(config, run)
        self.p, self.u_means, self.since_reset = float(config.gate_fraction), [], 0

    def validate(self, num_workers: int) -> None:
        super().validate(num_workers)
        a = self.config
        if not a.gate_rewards:
            raise ValueError("algorithm=gardo needs algorithm.gate_rewards=[<auxiliary reward>, …] (rewards of reward.names, e.g. with weight 0)")
        missing = [n for n in a.gate_rewards if n not in self.run.reward_weights]
        if missing:
            raise ValueError(f"algorithm.gate_rewards={list(a.gate_rewards)}: {missing} not in reward.names {list(self.run.reward_weights)}; "
                             "add them there (weight 0 scores them without optimising them)")

    def objective(self) -> GARDOStepLoss:
        a = self.config
        return GARDOStepLoss(clip_range=a.clip_range, kl_beta=a.kl_beta, kl_dt_scale=a.kl_dt_scale)

    def rollout_advantages(self, traj: TensorDict, scores: dict) -> torch.Tensor:
        a = self.config
        if not a.diversity:
            return super().rollout_advantages(traj, scores)
        distance = nearest_cosine_distance(traj["latents"][:, -1], traj["group_id"])
        return diversity_advantages(scores["rewards"], distance, traj["group_id"], a.adv_clip_max)

    def gate_weights(self, scores: dict) -> tuple[torch.Tensor, float]:
        """``([B] gate_weight, mean u of the kept samples)`` of this step; adapts ``p`` after gating."""
        u = uncertainty(scores["rewards"], [scores[f"reward/{n}"] for n in self.config.gate_rewards])
        g = gate(u, self.p)
        kept = u[u >= 0]
        u_mean = float(kept.mean()) if kept.numel() else 0.0
        if self.u_means:
            if u_mean > max(self.u_means):
                self.p = min(P_MAX, self.p * P_UP)
            elif u_mean < min(self.u_means):
                self.p = max(P_MIN, self.p * P_DOWN)
        self.u_means = (self.u_means + [u_mean])[-HISTORY:]
        weight = g.float() * (len(g) / max(1, int(g.sum())))
        return weight, u_mean

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        traj["advantages"] = self.rollout_advantages(traj, scores)
        p = self.p
        traj["gate_weight"], u_mean = self.gate_weights(scores)
        del traj["metrics"]
        metrics = self.train_epochs(workers, traj, traj.shape[0], step)
        self.since_reset += 1
        kl = metrics.get("kl", [0.0])
        reset = self.config.kl_beta > 0 and (sum(kl) / max(1, len(kl)) > self.config.kl_reset_threshold or self.since_reset >= self.config.reset_every)
        if reset:
            workers.ema_update_adapter("default", "old", 0.0)
            self.since_reset = 0
        record = {"advantage_abs_mean": traj["advantages"].abs().mean().item(), "gate_p": p, "gate_u_mean": u_mean,
                  "gated_rows": float((traj["gate_weight"] > 0).sum()), "reference_reset": float(reset)}
        return StepResult(metrics, record)

    def state_dict(self) -> dict:
        return {"p": self.p, "u_means": list(self.u_means), "since_reset": self.since_reset}

    def load_state_dict(self, state: dict) -> None:
        self.p = float(state.get("p", self.config.gate_fraction))
        self.u_means = [float(x) for x in state.get("u_means", [])]
        self.since_reset = int(state.get("since_reset", 0))
