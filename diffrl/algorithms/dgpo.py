"""Direct Group Preference Optimization (DGPO; Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv:2510.08425, ICLR 2026; code github.com/Luo-Yihong/DGPO, in Flow-Factory).

DGPO drops the policy gradient (and with it the SDE sampler): rollouts are deterministic (ODE or DPM-Solver),
and the model learns the group-level preference ``p(G⁺ ≻ G⁻) = σ(R_θ(G⁺) − R_θ(G⁻))`` of a prompt's samples
split by reward, where a sample's implicit reward is DPO's: the drop of its flow-matching error against the
reference. The gradient of that Bradley–Terry likelihood over groups is an advantage-weighted flow-matching
loss with one sigmoid weight per group. With a policy sample x0 (the rollout's final latent), ε ~ N(0, I) and a
noise level σ of the sampler's schedule, ``x_σ = (1 − σ)·x0 + σ·ε``, target ``v* = ε − x0``:

    e_i     = mean_dims (v_θ(x_σ) − v*)²,   e_i^ref = mean_dims (v_ref(x_σ) − v*)²       (flow-matching errors)
    s_i     = Â_i · β · (e_i − e_i^ref) / G                                            (no gradient)
    w_g     = σ( Σ_{i ∈ g} s_i )                                                      (one weight per group g)
    L       = mean_i w_{g(i)} · Â_i · e_i  +  β_KL · mean_i mean_dims (v_θ − v_ref)²

``Â_i`` are group-relative advantages clipped to ``±algorithm.adv_clip_max``, ``G`` the group size, ``β`` is
``algorithm.dgpo_beta`` (the reference code's ``beta_dpo``: 10–100 with CFG rollouts, 100 in its configs).
A group whose good samples already beat the reference (``Σ s < 0``) gets a small weight; one whose model is
still worse than the reference on its good samples a weight near 1, so training concentrates where the
preference is not yet learned.

The group sums need every member of a group at the current weights before any gradient: the objective's
``prepare_batch`` computes ``e`` and ``e^ref`` of the whole batch gradient-free (summed across data-parallel
ranks), so the update does not depend on the micro-batch size. Choices: one update per rollout, so the
reference code's PPO-style clip against the sampling policy (ratio 1 on-policy) is left out, as for AWM; the
reference is the model with its LoRA disabled (the reference code's default mode; its EMA reference is not
implemented); noise levels are ``algorithm.dgpo_num_timesteps`` of the sampler's schedule per sample, in each
sample's seeded order (the reference code shares M levels across the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from diffrl.algorithms.base import BASE, Granularity, MicroBatchObjective, ObjectiveSpec, RolloutPlan, register_algorithm, sample_only_plan
from diffrl.algorithms.objectives import renoised_clean_samples
from diffrl.algorithms.policy_gradient import GroupAdvantageAlgorithm
from diffrl.config import AlgorithmConfig, Check, at_least, positive
from diffrl.engine import parallel
from diffrl.sampling.schedules import WindowMasks


def flow_errors(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[B]``: the per-sample flow-matching error ``mean_dims (v − v*)²`` in fp32."""
    d = (v.float() - target.float()).square()
    return d.mean(dim=tuple(range(1, d.ndim)))


def group_weights(errors: torch.Tensor, ref_errors: torch.Tensor, advantages: torch.Tensor, group_id: torch.Tensor, *, beta: float,
                  group_size: int, num_groups: int | None = None, reduce=None) -> torch.Tensor:
    """``[B]``: each sample's group weight ``σ(Σ_{i∈g} Â_i·β·(e_i − e_i^ref)/G)``. ``reduce`` sums the per-group
    sums across data-parallel ranks (in place; None: one rank)."""
    terms = advantages.float() * beta * (errors.float() - ref_errors.float()) / group_size
    n = int(num_groups if num_groups is not None else int(group_id.max()) + 1)
    sums = torch.zeros(n, dtype=terms.dtype, device=terms.device).index_add_(0, group_id.to(terms.device).long(), terms)
    if reduce is not None:
        reduce(sums)
    return torch.sigmoid(sums)[group_id.to(terms.device).long()]


def dgpo_loss(v_theta: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, *, kl_beta: float = 0.0,
              v_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """``mean_i w_i·Â_i·e_i + β_KL·mean_i mean_dims (v_θ − v_ref)²`` (weights and advantages carry no gradient)."""
    errors = flow_errors(v_theta, target)
    a, w = advantages.to(errors.device).float().detach(), weights.to(errors.device).float().detach()
    policy = (w * a * errors).mean()
    metrics = {"policy_loss": policy.item(), "flow_error": errors.mean().item(), "group_weight_mean": w.mean().item()}
    loss = policy
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("dgpo: kl_beta > 0 needs the reference velocity v_ref")
        kl = (v_theta.float() - v_ref.float().detach()).square().mean()
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    return loss, metrics


@dataclass
class DGPOConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"dgpo_beta": positive(), "dgpo_num_timesteps": at_least(1)}

    name: str = "dgpo"
    trainer: str = "dgpo"
    dgpo_beta: float = 100.0
    """β of the group preference (the reference code's beta_dpo): the sigmoid's sharpness over a group's summed implicit rewards"""
    dgpo_num_timesteps: int = 2
    """noise levels of the sampler's schedule trained per sample"""


class DGPOObjective(MicroBatchObjective):
    """DGPO on the clean samples ``latents[:, -1]`` with ``batch["advantages"]`` (already clipped) and
    ``batch["group_id"]``: ``prepare_batch`` adds ``dgpo_weights [B, L]``, ``micro_losses`` the loss per level. Its spec:
    pieces per micro-batch after a gradient-free pass over the whole batch, the base reference (the group weights
    compare with it)."""

    def __init__(self, *, beta: float, num_timesteps: int, group_size: int, kl_beta: float):
        super().__init__(ObjectiveSpec(name="dgpo", granularity=Granularity.MICRO_BATCH, reference=BASE, prepares_batch=True))
        self.beta, self.num_timesteps, self.group_size, self.kl_beta = beta, num_timesteps, group_size, kl_beta

    def prepare_batch(self, engine, batch: TensorDict, seed: int) -> TensorDict:
        errors, ref_errors = [], []
        for micro in engine._micro_batches(batch):
            micro = micro.to(engine.adapter.device)
            e, r = [], []
            for piece in renoised_clean_samples(engine, micro, seed, self.num_timesteps, "dgpo"):
                guidance = engine.sampler.guidance_scale
                e.append(flow_errors(engine.adapter.predict(piece.x_t, piece.sigma, piece.cond, guidance), piece.target))
                with engine.reference_policy(self.spec.reference) as ref:
                    r.append(flow_errors(ref.predict(piece.x_t, piece.sigma, piece.cond, guidance), piece.target))
            errors.append(torch.stack(e, 1).cpu())
            ref_errors.append(torch.stack(r, 1).cpu())
        errors, ref_errors = torch.cat(errors), torch.cat(ref_errors)
        group_id = batch["group_id"].long().cpu()
        num_groups = int(group_id.max()) + 1
        if parallel.is_distributed():  # group ids are global: the largest one on any rank sizes the sums
            n = torch.tensor([num_groups])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            num_groups = int(n)
        reduce = (lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM)) if parallel.is_distributed() else None
        advantages = batch["advantages"].float().cpu()
        weights = torch.stack([
            group_weights(errors[:, k], ref_errors[:, k], advantages, group_id, beta=self.beta, group_size=self.group_size, num_groups=num_groups, reduce=reduce)
            for k in range(errors.shape[1])
        ], 1)
        batch = batch.clone(recurse=False)
        batch["dgpo_weights"] = weights
        return batch

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        guidance, advantages = engine.sampler.guidance_scale, micro["advantages"].to(engine.adapter.device)
        weights = micro["dgpo_weights"]
        for k, piece in enumerate(renoised_clean_samples(engine, micro, seed, self.num_timesteps, "dgpo")):
            v_ref = None
            if self.kl_beta > 0:
                with torch.no_grad(), engine.reference_policy(self.spec.reference) as ref:
                    v_ref = ref.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            v_theta = engine.adapter.predict(piece.x_t, piece.sigma, piece.cond, guidance)
            loss, metrics = dgpo_loss(v_theta, piece.target, advantages, weights[:, k], kl_beta=self.kl_beta, v_ref=v_ref)
            yield loss, piece.weight, metrics


@register_algorithm("dgpo")
class DGPO(GroupAdvantageAlgorithm):
    Config = DGPOConfig

    def objective(self) -> DGPOObjective:
        a = self.config
        return DGPOObjective(beta=a.dgpo_beta, num_timesteps=a.dgpo_num_timesteps, group_size=self.run.group_size, kl_beta=a.kl_beta)

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        return sample_only_plan(self.run.sampler, masks, "current")

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        # the gradient pass per sample and level; gradient-free: the policy and the reference for the group weights (+ KL)
        return self.run.batch.rows * self.config.dgpo_num_timesteps, 2 + int(self.config.kl_beta > 0)

    def rollout_advantages(self, traj: TensorDict, scores: dict) -> torch.Tensor:
        c = self.config.adv_clip_max  # clipped again after summing per-reward advantages (reward_aggregation=sum_advantages)
        advantages = super().rollout_advantages(traj, scores)
        return advantages.clamp(-c, c) if c else advantages
