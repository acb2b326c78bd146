"""TempFlow-GRPO (He et al. 2025, "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models", arXiv:2508.04324),
as the authors' released training code does it (``scripts/train_sd3_pr.py`` and
``flow_grpo/diffusers_patch/sd3_{pipeline,sde}_with_logprob_perstep.py`` of their TempFlow-GRPO repository, read in the
copy vendored at github.com/Ayakaee/sii-fall, commit 08ddfc1, ``TempFlow-GRPO/``; line numbers below are of that copy).

**Trajectory branching: a reward per (branch, step).** Flow-GRPO rewards a whole SDE trajectory once, so every step
shares one advantage. TempFlow-GRPO follows one ODE trajectory per prompt and, at each branch step ``k``, branches it
into ``b`` SDE samples, each continued to the end by the ODE and scored: the reward of a branch is the effect of that
one stochastic step (``sd3_pipeline_with_logprob_perstep.py:296-405``: per step ``i`` of ``timesteps[:-1]`` an ODE step
that the trajectory keeps and ``exploration_k = 6`` SDE samples, ``sd3_sde_with_logprob_perstep.py:64-76``, each
finished by ODE steps and decoded). Here a row is one (prompt, branch step ``k``, branch): the rows of a prompt group
share the initial noise (``sampler.same_initial_noise``), take ODE steps before ``k``, the SDE step at ``k`` (each
branch its own noise) and ODE steps after; only ``k`` is trained. A group of ``G = |branch steps| × branches`` rows is
laid out branch step major (row ``i·b + j``: branch ``j`` at the ``i``-th branch step), given to the rollout as a
per-position layout (``SampleRequest.group_trained``). The authors branch at every step but the last (``timesteps[:-1]``,
and ``timestep_fraction = 0.99`` trains ``int(10·0.99) = 9`` of 10 steps, ``train_sd3_pr.py:366,932``): the default
``branch_steps`` (empty).

**Advantages within (prompt, branch step).** The authors' per-prompt tracker gets the rewards as a matrix
``[rows, steps]`` and normalises each step's column over the rows of one prompt (``train_sd3_pr.py:813``,
``stat_tracking.py:23-33``): mean over the prompt's branches at that step, std over the prompt's branches
(``global_std=False``) or over every row at that step (``global_std=True``, their GenEval config), plus ``1e-4``; clipped
to ``±adv_clip_max = 5`` at train time (``train_sd3_pr.py:948-952``). Here ``algorithm.adv_std_mode`` = ``group`` or
``global`` (per branch step across prompts, the authors' global std) or ``none``:

    A_{p,k,j} = clip((r_{p,k,j} − mean_j r_{p,k,·}) / (std + ε), −c, c)

**Noise-aware weighting.** Each (row, step) surrogate is scaled by the step's transition std, ``−2.25·std_dev_t·A·ratio``
(``train_sd3_pr.py:954-959``), where ``std_dev_t = a·√(σ/(1 − σ))·√Δt`` is the std the SDE step returns
(``sd3_sde_with_logprob.py:47,81``, ``a = 0.7``). Their 2.25 is the reciprocal of that std's mean over their 9 trained
steps on the SD3.5 10-step schedule (shift 3): 1/0.444 = 2.252, so the weights average 1. Here the normaliser is
computed, not hard-coded: ``w_k = s_k / mean_{k' ∈ branch steps} s_{k'}`` with ``s_k`` the sampler's step std on the
run's schedule (any schedule, noise level or step count keeps mean weight 1 over the branch steps):

    L = mean_rows w_k·max(−A·r, −A·clip(r, 1 − ε, 1 + ε)) + β·mean_rows KL_k

The KL to the reference (the actor with its LoRA disabled) is the exact Gaussian KL ``‖μ − μ_ref‖²/(2 s_k²)`` and is
not weighted (``train_sd3_pr.py:962-964``; ``kl_dt_scale=False``). The authors' values (``config/base.py:70,91,93``,
``config/dgx.py`` ``*_pr``): lr 3e-4, PPO clip 1e-4, β 0.004 (GenEval) / 0.001 (PickScore), 6 branches, noise level
0.7 (SD3.5) / 0.9 (FLUX), 2 optimizer steps per sampling round (``gradient_accumulation_steps =
num_batches_per_epoch // 2``), EMA of the LoRA (here ``eval.ema``).

Left out: their drop of rows whose advantages are zero at every step (``train_sd3_pr.py:849-868``; here such rows train
with advantage 0); their rollout computes each prompt's ODE prefix once and branches it, here each row recomputes its
prefix (the same numbers, more forwards). Off-policy rollouts (stale replicas, FP8) are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from tensordict import TensorDict

from diffrl.algorithms.advantages import check_group_size
from diffrl.algorithms.base import BASE, Algorithm, Granularity, ObjectiveSpec, RolloutPlan, StepObjective, StepResult, register_algorithm
from diffrl.algorithms.losses import flow_grpo_loss
from diffrl.config import AlgorithmConfig, Check, at_least, positive
from diffrl.sampling.schedules import WindowMasks
from diffrl.sampling.sde import run_step

WEIGHTED_KINDS = ("flow_sde", "dance_sde")
"""step kinds whose std is a function of the schedule alone (the weights are computed from it)"""


def branch_steps_of(branch_steps: list[int], num_steps: int) -> list[int]:
    """The branch steps: ``branch_steps`` sorted, or every step but the last when empty (the authors' ``timesteps[:-1]``).

    Raises:
        ValueError: a step outside ``[0, num_steps)`` or a repeated step.
    """
    steps = sorted(int(k) for k in branch_steps) if branch_steps else list(range(num_steps - 1))
    if not steps or steps[0] < 0 or steps[-1] >= num_steps or len(set(steps)) != len(steps):
        raise ValueError(f"algorithm.branch_steps must be distinct steps in [0, {num_steps}) (sampler.num_steps), got {list(branch_steps)}")
    return steps


def branch_layout(num_steps: int, steps: list[int], branches: int) -> torch.Tensor:
    """``[G, K]`` bool, ``G = len(steps)·branches``: row ``i·branches + j`` (branch ``j`` at ``steps[i]``) is stochastic
    and trained at ``steps[i]`` only."""
    layout = torch.zeros(len(steps) * branches, num_steps, dtype=torch.bool)
    for i, k in enumerate(steps):
        layout[i * branches : (i + 1) * branches, k] = True
    return layout


def step_stds(sigmas: torch.Tensor, kind: str, noise_level: float) -> torch.Tensor:
    """``[K]`` the transition std ``s_k`` of step kind ``kind`` on the schedule ``sigmas [K+1]`` (flow_sde:
    ``a·√(σ/(1 − σ))·√(σ − σ_next)``, at ``σ = 1`` with ``1 − σ_next``; dance_sde: ``a·√(σ − σ_next)``)."""
    if kind not in WEIGHTED_KINDS:
        raise ValueError(f"tempflow_grpo weights steps by the std of a flow SDE kind ({', '.join(WEIGHTED_KINDS)}), got sampler.kind={kind!r}")
    zero = torch.zeros(1, 1)
    return torch.stack([
        run_step(kind, zero, zero, float(sigmas[k]), float(sigmas[k + 1]), noise_level=noise_level, prev_sample=zero).std.reshape(-1)[0]
        for k in range(sigmas.shape[0] - 1)
    ]).float()


def noise_weights(stds: torch.Tensor, trained: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """``[B]`` the weight of each row's one trained step: ``w = s_k / mean_{k' ∈ steps} s_{k'}`` (the authors'
    ``2.25·std_dev_t`` with the normaliser computed).

    Args:
        stds: ``[K]`` step stds (:func:`step_stds`); trained: ``[B, K]`` bool, one trained step per row; steps: the
            branch steps (the normaliser's mean is over them).
    """
    if not bool((trained.sum(1) == 1).all()):
        raise ValueError(f"tempflow_grpo trains one branch step per row, got rows training {sorted(set(trained.sum(1).tolist()))} steps")
    return stds[trained.float().argmax(1)] / stds[steps].mean()


def branch_advantages(rewards: torch.Tensor, group_id: torch.Tensor, branch_step: torch.Tensor, *, std_mode: str = "global",
                      eps: float = 1e-4, clip_max: float = 5.0) -> torch.Tensor:
    """``[B]`` advantages normalised within (prompt group, branch step) (module docstring).

    Args:
        rewards, group_id, branch_step: ``[B]``; std_mode: ``group`` (the std of the (prompt, step) group), ``global``
            (the std of every row at that branch step, the authors' ``global_std``) or ``none`` (1, no ε).
    """
    r = rewards.double()
    key = group_id.long() * (int(branch_step.max()) + 1) + branch_step.long()
    _, inverse = torch.unique(key, return_inverse=True)
    n = int(inverse.max()) + 1
    counts = torch.zeros(n, dtype=r.dtype).index_add_(0, inverse, torch.ones_like(r))
    centred = r - (torch.zeros(n, dtype=r.dtype).index_add_(0, inverse, r) / counts)[inverse]
    if std_mode == "group":
        std = (torch.zeros(n, dtype=r.dtype).index_add_(0, inverse, centred**2) / counts).sqrt()[inverse]
    elif std_mode == "global":
        std = torch.empty_like(r)
        for k in branch_step.unique():
            rows = branch_step == k
            std[rows] = r[rows].std(unbiased=False)
    elif std_mode == "none":
        std, eps = torch.ones_like(r), 0.0
    else:
        raise ValueError(f"unknown advantage std_mode {std_mode!r}; choose group, global or none")
    return (centred / (std + eps)).clamp(-clip_max, clip_max).float()


class TempFlowStepLoss(StepObjective):
    """The engine's per-step loss ``fn(step, batch, k)``: Flow-GRPO's clipped surrogate with each row weighted by
    ``batch["noise_weights"] [B]`` (the KL not weighted); reads ``batch["log_probs"][:, k]``, ``batch["advantages"]``.
    Its spec: the base reference when ``kl_beta > 0``; no off-policy correction (the branch advantages and weights are
    of on-policy rows)."""

    def __init__(self, *, clip_range: float, kl_beta: float, kl_dt_scale: bool):
        super().__init__(ObjectiveSpec(name="tempflow_grpo", granularity=Granularity.STEP, reference=BASE if kl_beta > 0 else None))
        self.clip_range, self.kl_beta, self.kl_dt_scale = clip_range, kl_beta, kl_dt_scale

    def __call__(self, step: dict, batch: TensorDict, k: int):
        keys = set(batch.keys())
        if "noise_weights" not in keys:
            raise ValueError("tempflow_grpo needs batch['noise_weights'] [B] (TempFlowGRPO.update sets them)")
        weight = batch["noise_weights"].float().to(step["log_prob"].device)
        dt = batch["sigmas"][:, k] - batch["sigmas"][:, k + 1] if "sigmas" in keys else None
        loss, metrics = flow_grpo_loss(
            step["log_prob"], batch["log_probs"][:, k], batch["advantages"], clip_range=self.clip_range, kl_beta=self.kl_beta,
            mean=step["mean"], ref_mean=step.get("ref_mean"), std=step["std"], dt=dt, kl_dt_scale=self.kl_dt_scale, is_weight=weight,
        )
        metrics["noise_weight_mean"] = weight.mean().item()
        return loss, metrics


@dataclass
class TempFlowGRPOConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"clip_range": positive(), "branches": at_least(2)}

    name: str = "tempflow_grpo"
    trainer: str = "tempflow_grpo"
    branches: int = 6
    """SDE branches per branch step (the authors' exploration_k); trainer.group_size = len(branch steps) × branches"""
    branch_steps: list[int] = field(default_factory=list)
    """steps where each prompt's ODE trajectory branches (0-based); empty: every step but the last (the authors')"""
    noise_weighting: bool = True
    """scale each step's surrogate by its transition std / the mean std over the branch steps (false: weight 1)"""
    clip_range: float = 1e-4
    """PPO ratio clip ε (the authors' 1e-4)"""
    lr: float = 3e-4
    """learning rate (the authors' 3e-4)"""

    kl_dt_scale: bool = False
    """the KL with the dt factor ((μ−μ_ref)²/(2σ_t²)) instead of the exact Gaussian KL (the authors': exact)"""


@dataclass(frozen=True)
class BranchingPlan(RolloutPlan):
    """A :class:`RolloutPlan` whose rows differ within a prompt group: ``layout [G, K]`` (:func:`branch_layout`) goes to
    the request as ``SampleRequest.group_trained`` (stochastic where trained)."""

    layout: torch.Tensor | None = None

    def request(self, *args, **kwargs):
        return dataclasses.replace(super().request(*args, **kwargs), group_trained=self.layout, group_stochastic=self.layout)


@register_algorithm("tempflow_grpo")
class TempFlowGRPO(Algorithm):
    Config = TempFlowGRPOConfig
    tiny_overrides = ("algorithm.branch_steps=[0]", "algorithm.branches=2")  # a group of 1 branch step × 2 branches

    def __init__(self, config: TempFlowGRPOConfig, run):
        super().__init__(config, run)
        self.steps = branch_steps_of(list(config.branch_steps), run.sampler.num_steps)
        self.layout = branch_layout(run.sampler.num_steps, self.steps, config.branches)

    def objective(self) -> TempFlowStepLoss:
        a = self.config
        return TempFlowStepLoss(clip_range=a.clip_range, kl_beta=a.kl_beta, kl_dt_scale=a.kl_dt_scale)

    def validate(self, num_workers: int) -> None:
        s, a, G = self.run.sampler, self.config, self.layout.shape[0]
        check_group_size(self.run.group_size, f"algorithm={a.name}")
        if self.run.group_size != G:
            raise ValueError(f"algorithm={a.name}: trainer.group_size={self.run.group_size} must be len(branch steps) × algorithm.branches = "
                             f"{len(self.steps)} × {a.branches} = {G}")
        if not s.same_initial_noise:
            raise ValueError(f"algorithm={a.name} branches one ODE trajectory per prompt: set sampler.same_initial_noise=true")
        if s.window != "all":
            raise ValueError(f"algorithm={a.name} lays out its own branch steps (algorithm.branch_steps): use sampler.window=all, got {s.window!r}")
        if a.reward_aggregation != "sum_rewards":
            raise ValueError(f"algorithm={a.name} normalises the summed reward per branch step: use algorithm.reward_aggregation=sum_rewards")
        if a.noise_weighting and s.kind not in WEIGHTED_KINDS:
            raise ValueError(f"algorithm={a.name} weights steps by a flow SDE's std: sampler.kind must be one of {WEIGHTED_KINDS}, got "
                             f"{s.kind!r} (or algorithm.noise_weighting=false)")

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        trained = self.layout.any(0)
        return BranchingPlan("current", trained, trained.clone(), layout=self.layout)

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        return self.run.prompts_per_step * self.run.group_size, int(self.config.kl_beta > 0)  # one trained step per row

    def update(self, workers, traj: TensorDict, scores: dict, step: int) -> StepResult:
        a = self.config
        trained = traj["sde_mask"].bool()
        branch_step = trained.float().argmax(1)
        traj["advantages"] = branch_advantages(scores["rewards"], traj["group_id"], branch_step, std_mode=a.adv_std_mode, eps=a.adv_eps,
                                               clip_max=a.adv_clip_max)
        if a.noise_weighting:
            traj["noise_weights"] = noise_weights(step_stds(traj["sigmas"][0], self.run.sampler.kind, self.run.sampler.noise_level), trained, self.steps)
        else:
            traj["noise_weights"] = torch.ones(traj.shape[0])
        del traj["metrics"]
        record = {"advantage_abs_mean": traj["advantages"].abs().mean().item(), "noise_weight_max": traj["noise_weights"].max().item()}
        return StepResult(self.train_epochs(workers, traj, traj.shape[0], step), record)
