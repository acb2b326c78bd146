"""Diffusion on-policy distillation (OPD), as verl-omni, UniRL and Flow-Factory ship it.

The student samples its own SDE trajectories; a frozen teacher (a second model of the family, ``algorithm.teacher``: a
folder or Hub id, loaded by the family's loader, ``Reference("teacher", …)``) replays every recorded state
``(x_k, σ_k)`` with the same step kind and noise level, and the student's Gaussian transition at that state is pulled
toward the teacher's. Both transitions have the same θ-independent std ``s_k = σ_t·√Δt`` (``σ_t = a·√(σ/(1−σ))`` of
Flow-GRPO's SDE, ``diffrl.sampling.sde.flow_sde_step``), so their KL is exact and dense, one per trained step:

    KL_k = KL(π_θ(·|x_k) ‖ π_T(·|x_k)) per dim = mean_dims (μ_θ − μ_T)² / (2·s_k²)
    L    = c_distill·mean_{i,k} KL_{i,k}  [+ c_reward·L_Flow-GRPO(ratio, Â)]

averaged over the latent dims (the per-dim convention of the step log-probs). ``algorithm.kl_dt_scale=true`` takes
verl-omni's σ instead: it divides by ``std_dev_t² = σ_t²`` (the step std without ``√Δt``), i.e. ``KL_k·Δt``.

**The form shipped, and why.** The loss is the closed-form KL differentiated through the student's mean ``μ_θ`` (a
pathwise gradient: ``∂KL_k/∂μ_θ = (μ_θ − μ_T)/s_k²``), on the states the student itself visited, which are held fixed
(as in the peers; the KL's dependence on the state distribution is not differentiated). The alternative, a policy
gradient ``−r_k·log π_θ(x_{k+1}|x_k)`` with the detached per-step reward ``r_k = −KL_k``, has zero expected gradient:
``r_k`` is a function of the state ``x_k`` alone, so ``E_{x_{k+1}}[r_k·∇ log π_θ(x_{k+1}|x_k)] = r_k·∇∫π_θ = 0`` — it
only adds variance. (A sampled log-ratio ``log π_T(x_{k+1}|x_k) − log π_θ(x_{k+1}|x_k)`` as reward is unbiased but
estimates by one draw what the Gaussian gives in closed form.) ``algorithm.reward_coef > 0`` adds Flow-GRPO's clipped
surrogate on the group advantages of the reward (``losses.flow_grpo_loss``), as verl-omni adds its distillation term
to the Flow-GRPO loss; ``reward_coef = 0`` is pure distillation (the reward is only monitored).

The peers (read 2026-12-06):

* verl-omni (verl-project/verl-omni @ a1139ba): ``verl_omni/trainer/diffusion/diffusion_algos.py:1054-1094``
  (``distill_kl``: ``((prev_sample_mean − teacher_prev_sample_mean)²).mean(dims) / (2·std_dev_t²)``, averaged over
  the batch); ``std_dev_t = sqrt(σ/(1−σ))·noise_level`` (``verl_omni/pipelines/schedulers/flow_match_sde.py:215``)
  while the transition std is ``std_dev_t·sqrt(−dt)`` (``:229``): its "KL" is the exact KL times ``Δt``
  (``kl_dt_scale=true`` here). Added to the main loss with ``distill_loss_coef`` (``verl_omni/workers/utils/losses.py:
  114-120``), beside Flow-GRPO's clipped surrogate and the reference KL. The teacher is a full checkpoint of the same
  family loaded as a third frozen, forward-only engine from the reference's config (``verl_omni/workers/engine_workers.py:
  515-545, 746-765``), whose scheduler config must equal the student's (``:760``); it scores each rollout batch once
  before the update (``verl_omni/trainer/diffusion/ray_diffusion_trainer.py:1032-1044``) with the student's prompt
  embeddings; no LoRA teachers (``docs/algo/diffusion_opd.md``).
* UniRL and Flow-Factory: not read for this module (their OPD is described after verl-omni's in issue 52).

Choices here: the teacher reads the prompts through its own text encoder (``DiffusionEngine.reference_cond``: the
digits teacher's encoder was trained with it); its means are computed beside each trained step's forward (one more
forward per trained step, as the KL reference costs), not stored once per batch; the teacher is the objective's only
reference, so ``algorithm.kl_beta`` must stay 0; off-policy rollouts are refused (no proximal correction).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch
from tensordict import TensorDict

from diffrl.algorithms.advantages import check_group_size
from diffrl.algorithms.base import Granularity, ObjectiveSpec, Reference, StepObjective, StepResult, register_algorithm
from diffrl.algorithms.losses import flow_grpo_loss, step_kl
from diffrl.algorithms.policy_gradient import GroupAdvantageAlgorithm
from diffrl.config import AlgorithmConfig, Check, at_least, positive


def distill_kl(mean: torch.Tensor, teacher_mean: torch.Tensor, std: torch.Tensor, *, dt: torch.Tensor | None = None,
               kl_dt_scale: bool = False) -> torch.Tensor:
    """``[B]``: per-dim KL(N(mean, std²) ‖ N(teacher_mean, std²)) of one step, ``mean_dims (mean − teacher_mean)² / (2·std²)``
    (``kl_dt_scale``: times ``dt``, verl-omni's ``/(2·σ_t²)``). ``mean`` carries the gradient; the teacher's does not."""
    return step_kl(mean, teacher_mean.detach(), std.detach(), dt=dt, kl_dt_scale=kl_dt_scale, needed_by="opd")


def opd_loss(
    mean: torch.Tensor,
    teacher_mean: torch.Tensor,
    std: torch.Tensor,
    *,
    distill_coef: float = 1.0,
    dt: torch.Tensor | None = None,
    kl_dt_scale: bool = False,
    reward_coef: float = 0.0,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    clip_range: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """OPD's per-step loss (module docstring): ``c_distill·mean_i KL_i`` plus, with ``reward_coef > 0``,
    ``c_reward·`` Flow-GRPO's clipped surrogate.

    Args:
        mean: ``[B, …]`` the student's transition mean at the recorded state (with grad).
        teacher_mean: ``[B, …]`` the teacher's at the same state (no grad).
        std: the step std ``σ_t·√Δt``, broadcastable to ``mean``.
        distill_coef: ``c_distill``.
        dt: ``[B]`` ``σ − σ_next`` (needed with ``kl_dt_scale``).
        kl_dt_scale: verl-omni's σ (``KL·Δt``).
        reward_coef: ``c_reward``; > 0 needs ``log_prob`` ``[B]`` (with grad), ``old_log_prob`` ``[B]`` (the rollout's)
            and ``advantages`` ``[B]``.
        clip_range: ε of the surrogate.
    Returns:
        ``(loss, metrics)``: ``distill_kl`` (mean per-dim KL), ``distill_kl_max`` and, with the reward term, Flow-GRPO's
        metrics (``policy_loss``, ``approx_kl``, ``clipfrac``, ``ratio_mean``, ``ratio_std``).
    """
    kl = distill_kl(mean, teacher_mean, std, dt=dt, kl_dt_scale=kl_dt_scale)
    loss = distill_coef * kl.mean()
    metrics = {"distill_kl": kl.mean().item(), "distill_kl_max": kl.max().item()}
    if reward_coef > 0:
        if log_prob is None or old_log_prob is None or advantages is None:
            raise ValueError("opd with reward_coef > 0 needs log_prob, old_log_prob and advantages")
        policy, policy_metrics = flow_grpo_loss(log_prob, old_log_prob, advantages.to(log_prob.device), clip_range=clip_range)
        loss = loss + reward_coef * policy
        metrics.update({k: v for k, v in policy_metrics.items() if k != "kl"})
    return loss, metrics


class OPDStepLoss(StepObjective):
    """The engine's per-step objective: the student's ``mean``/``std`` and the teacher's ``ref_mean`` of step ``k`` (its spec
    names the teacher as reference); with the reward term also ``batch["log_probs"][:, k]`` and ``batch["advantages"]``."""

    def __init__(self, *, teacher: str | None, distill_coef: float, kl_dt_scale: bool, reward_coef: float, clip_range: float):
        # no teacher (a Config at its defaults, e.g. the registry's listings): no reference; validate() refuses to run it
        super().__init__(ObjectiveSpec(name="opd", granularity=Granularity.STEP,
                                       reference=Reference("teacher", source=teacher) if teacher else None))
        self.distill_coef, self.kl_dt_scale, self.reward_coef, self.clip_range = distill_coef, kl_dt_scale, reward_coef, clip_range

    def __call__(self, step: dict, batch: TensorDict, k: int):
        if "ref_mean" not in step:
            raise ValueError("opd needs the teacher's step means: set algorithm.teacher to the teacher model's folder or Hub id")
        keys = set(batch.keys())
        dt = batch["sigmas"][:, k] - batch["sigmas"][:, k + 1] if "sigmas" in keys else None
        extra = {}
        if self.reward_coef > 0:
            extra = {"log_prob": step["log_prob"], "old_log_prob": batch["log_probs"][:, k], "advantages": batch["advantages"]}
        return opd_loss(step["mean"], step["ref_mean"], step["std"], distill_coef=self.distill_coef, dt=dt, kl_dt_scale=self.kl_dt_scale,
                        reward_coef=self.reward_coef, clip_range=self.clip_range, **extra)


@dataclass
class OPDConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"distill_coef": positive(), "reward_coef": at_least(0, integer=False), "clip_range": positive()}

    name: str = "opd"
    trainer: str = "opd"
    teacher: Optional[str] = None
    """the teacher: a model folder or Hub id of the student's family (digits: ${asset:digits_teacher}); required"""
    distill_coef: float = 1.0
    """c_distill, the weight of the per-step KL to the teacher"""
    reward_coef: float = 0.0
    """c_reward: 0 is pure distillation (the reward only monitored); > 0 adds Flow-GRPO's clipped surrogate on the reward's group advantages"""
    clip_range: float = 0.2
    """PPO ratio clip ε of the reward term"""
    kl_dt_scale: bool = False
    """verl-omni's σ: divide by σ_t² (the step std without √Δt), i.e. the exact KL times Δt"""


@register_algorithm("opd")
class OPD(GroupAdvantageAlgorithm):
    """The reward term's advantages are :class:`GroupAdvantageAlgorithm`'s; the update and the checks are OPD's own."""

    Config = OPDConfig

    def objective(self) -> OPDStepLoss:
        a = self.config
        return OPDStepLoss(teacher=a.teacher, distill_coef=a.distill_coef, kl_dt_scale=a.kl_dt_scale, reward_coef=a.reward_coef,
                           clip_range=a.clip_range)

    def validate(self, num_workers: int) -> None:
        a = self.config
        if not a.teacher:
            raise ValueError("algorithm=opd needs a teacher: set algorithm.teacher to a model folder or Hub id of the student's family "
                             "(the digits one: algorithm.teacher=${asset:digits_teacher}, made by scripts/pretrain_digits.py --init)")
        local = Path(str(a.teacher)).expanduser()
        if not local.is_dir() and (str(a.teacher).startswith(("/", ".", "~")) or str(a.teacher).count("/") != 1):
            raise ValueError(f"algorithm.teacher={a.teacher}: no such model folder (and not a Hub id org/name); point it at the teacher's folder")
        if a.kl_beta > 0:
            raise ValueError(f"algorithm=opd: its reference is the teacher, so algorithm.kl_beta={a.kl_beta} has no base model to anchor to; set it to 0")
        if a.reward_coef > 0:
            check_group_size(self.run.group_size, "algorithm=opd with reward_coef > 0", alternative="algorithm.reward_coef=0 (pure distillation)")

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        """One teacher forward beside each trained sample-step."""
        return self.rows_per_step() * trained_steps, 1

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        record = {}
        if self.config.reward_coef > 0:
            traj["advantages"] = self.rollout_advantages(traj, scores)
            record["advantage_abs_mean"] = traj["advantages"].abs().mean().item()
        del traj["metrics"]
        return StepResult(self.train_epochs(workers, traj, traj.shape[0], step), record)
