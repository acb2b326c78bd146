"""Diffusion RL losses: pure functions of tensors, selected by name from a registry.

Each loss returns ``(loss, metrics)``: ``loss`` a scalar fp32 tensor to back-propagate (float64 when the per-step
losses get float64 inputs: the parity tests), ``metrics`` a dict of floats (already detached). Per-step policy-gradient losses (``flow_grpo``/``ddpo``, ``grpo_guard``) take
the outputs of one denoising step of a micro-batch; ``make_step_loss`` binds them to the engine as a ``StepLoss``
(a step objective declaring its ``ObjectiveSpec``).
``dpo`` and ``nft`` take whole-sample quantities (per-pair errors, velocity predictions on forward-noised
clean samples) and are called by their own training paths.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffrl.algorithms.advantages import STD_MODES, group_advantages
from diffrl.algorithms.base import BASE, Granularity, ObjectiveSpec, OffPolicy, StepObjective

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


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 kept as it is (the parity tests run the per-step losses in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _mean_over_dims(x: torch.Tensor) -> torch.Tensor:
    """``[B, …] -> [B]``: mean over the non-batch dims."""
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def _per_sample_std(std: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]``: the step std of each sample (the std kinds of ``diffrl/sde.py`` are constant per sample)."""
    return _mean_over_dims(_at_least_fp32(std).expand_as(like)).detach()


def _check_dt(dt: torch.Tensor | None, needed_by: str) -> torch.Tensor:
    if dt is None:
        raise ValueError(f"{needed_by} needs dt ([B] tensor, sigma − sigma_next > 0)")
    dt = _at_least_fp32(torch.as_tensor(dt))
    if bool((dt <= 0).any()):
        raise ValueError(f"{needed_by}: dt must be sigma − sigma_next > 0 for every sample, got {dt.tolist()}")
    return dt


def gaussian_kl_same_std(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[B]``: KL(N(mean, std²) ‖ N(ref_mean, std²)) per dim, averaged over non-batch dims.

    For equal stds the KL is ``(mean − ref_mean)² / (2·std²)`` (Flow-GRPO's KL term).
    """
    kl = (mean - ref_mean) ** 2 / (2 * std.expand_as(mean) ** 2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def step_kl(mean, ref_mean, std, *, dt=None, kl_dt_scale: bool = False, needed_by: str = "kl") -> torch.Tensor:
    """``[B]``: the KL penalty of one SDE step between the policy and the reference transitions.

    With the step std ``std = σ_t·√Δt`` (``Δt = sigma − sigma_next``):

    * ``kl_dt_scale=False``: the exact Gaussian KL, ``mean_dims (mean − ref_mean)² / (2·σ_t²·Δt)``.
    * ``kl_dt_scale=True`` ("with the dt factor"): that KL multiplied by ``Δt``, i.e.
      ``mean_dims (mean − ref_mean)² / (2·σ_t²)`` — what the Flow-GRPO reference code computes (it divides
      by the square of its ``std_dev_t = σ_t``, which excludes ``√Δt``). Needs ``dt``. For kinds whose std is
      not ``σ_t·√Δt`` (cps) it is still "KL × Δt".
    """
    if mean is None or ref_mean is None or std is None:
        raise ValueError(f"{needed_by} with kl_beta > 0 needs mean, ref_mean and std")
    kl = gaussian_kl_same_std(_at_least_fp32(mean), _at_least_fp32(ref_mean), _at_least_fp32(std))
    if kl_dt_scale:
        kl = kl * _check_dt(dt, f"{needed_by} with kl_dt_scale=True").to(kl.device)
    return kl


def _clipped_surrogate(log_ratio, advantages, clip_range, weight=None):
    """PPO's ``max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε))`` per sample, times ``weight``, averaged."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    if weight is not None:
        per_sample = per_sample * weight
    return per_sample.mean(), ratio


def truncated_is_weight(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """``[B]``: truncated importance weights of off-policy rollouts (rollout correction), no gradient.

        w_i = min(exp(log π_prox,i − log μ_i), C)

    ``μ`` is the behaviour policy (the weights the rollout replica sampled with, ``k`` updates old) and
    ``π_prox`` the actor's weights when the update starts (decoupled PPO, Hilton et al. 2022, "Batch
    size-invariance for policy optimization"; truncated IS as in Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training", verl's TIS). The PPO ratio is then taken against
    ``π_prox``, and each sample's surrogate is multiplied by ``w_i``. Log-probs follow the per-step
    convention of ``diffrl.sampling.sde`` (Gaussian log-density averaged over the non-batch dims).

    Args:
        proximal_log_prob, behaviour_log_prob: ``[B]``.
        cap: ``C ≥ 1`` (``algorithm.rollout_is_cap``).
    """
    if not cap >= 1:
        raise ValueError(f"rollout_is_cap must be ≥ 1, got {cap}")
    log_w = (proximal_log_prob.float() - behaviour_log_prob.float()).detach()
    return torch.exp(torch.clamp(log_w, max=math.log(cap)))


def _with_step_kl(policy_loss, kl_beta, mean, ref_mean, std, dt, kl_dt_scale, needed_by):
    """``(policy_loss + β·mean KL, {"policy_loss", "kl"})`` with the step KL of :func:`step_kl` when β > 0."""
    if kl_beta <= 0:
        return policy_loss, {"policy_loss": policy_loss.item(), "kl": 0.0}
    kl = step_kl(mean, ref_mean, std, dt=dt, kl_dt_scale=kl_dt_scale, needed_by=needed_by).mean()
    return policy_loss + kl_beta * kl, {"policy_loss": policy_loss.item(), "kl": kl.item()}


def _ratio_metrics(ratio, log_ratio, clip_range) -> dict[str, float]:
    with torch.no_grad():
        return {
            "approx_kl": (0.5 * log_ratio**2).mean().item(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean().item(),
            "ratio_mean": ratio.mean().item(),
            "ratio_std": ratio.std(unbiased=False).item() if ratio.numel() > 1 else 0.0,
        }


@register_loss("ddpo")
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
    dt: torch.Tensor | None = None,
    kl_dt_scale: bool = False,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO's per-step objective (Liu et al. 2025, eq. 8), PPO clipping (Schulman et al. 2017).

        ratio = exp(log_prob − old_log_prob)
        L = mean_i max(−A_i·ratio_i, −A_i·clip(ratio_i, 1 − ε, 1 + ε)) + β·mean_i KL_i

    with ``KL_i = mean_dims (mean − ref_mean)² / (2·std²)`` between the policy's and the reference's
    Gaussian transitions (same std ``σ_t·√Δt``). The reference is the actor with its LoRA disabled.
    ``kl_dt_scale=True`` multiplies ``KL_i`` by ``Δt`` ("with the dt factor"), giving the Flow-GRPO
    reference code's ``(mean − ref_mean)² / (2·σ_t²)`` (see ``step_kl``). Registered also as ``"ddpo"``:
    DDPO's clipped importance-sampling objective (Black et al. 2023) is the same formula.

    Args:
        log_prob: ``[B]`` current policy log-probs of the recorded ``prev_sample`` (with grad).
        old_log_prob: ``[B]`` rollout log-probs.
        advantages: ``[B]``.
        clip_range: ε.
        kl_beta: β; with β > 0, ``mean``, ``ref_mean`` and ``std`` (``[B, …]``) are required.
        dt: ``[B]`` ``sigma − sigma_next`` (> 0); required with ``kl_dt_scale`` and ``kl_beta > 0``.
        kl_dt_scale: multiply the KL by ``Δt``.
        is_weight: ``[B]`` per-sample weights of the surrogate (off-policy rollouts: :func:`truncated_is_weight`,
            with ``old_log_prob`` then the proximal policy's); None: 1.
    Returns:
        ``(loss, metrics)``: metrics ``policy_loss``, ``kl``, ``approx_kl`` (½·mean (Δlog p)²),
        ``clipfrac`` (fraction with ``|ratio − 1| > ε``), ``ratio_mean``, ``ratio_std``.
    """
    advantages = _at_least_fp32(advantages)
    log_ratio = _at_least_fp32(log_prob) - _at_least_fp32(old_log_prob)
    policy_loss, ratio = _clipped_surrogate(log_ratio, advantages, clip_range, is_weight)
    loss, metrics = _with_step_kl(policy_loss, kl_beta, mean, ref_mean, std, dt, kl_dt_scale, "flow_grpo")
    metrics.update(_ratio_metrics(ratio, log_ratio, clip_range))
    return loss, metrics


@register_loss("grpo_guard")
def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    dt: torch.Tensor | None = None,
    ratio_norm: bool = True,
    grad_reweight: bool = True,
    kl_beta: float = 0.0,
    ref_mean: torch.Tensor | None = None,
    kl_dt_scale: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching
    via Regulated Clipping", eqs. 8 and 12): Flow-GRPO's clipped objective on a normalised ratio, reweighted
    per denoising step.

    **RatioNorm.** With the step std ``s = σ_t·√Δt`` and ``Δμ = mean − old_mean`` (current vs rollout
    transition means), a sample ``x = old_mean + s·ε`` has
    ``log r = log_prob − old_log_prob = mean_dims(ε·Δμ)/s − ‖Δμ‖²/(2s²)`` (``‖·‖²`` = mean over dims):
    its mean is shifted below 0 by ``‖Δμ‖²/(2s²)`` and its spread scales as ``1/s``, so the PPO clip
    mostly misses positive-advantage samples and differs from step to step. The normalised log-ratio is

        log r̂ = s·(log r + ‖Δμ‖²/(2s²))  ( = mean_dims(ε·Δμ) exactly: centred, same scale at every step )

    (the ``‖Δμ‖²`` term keeps its gradient, as in the paper's form). **Gradient reweighting.** Since
    ``∂mean/∂v ∝ Δt``, the per-sample surrogate is multiplied by ``δ = 1/Δt`` (the paper's Flow-GRPO form,
    ``β`` constant) so every step contributes a comparable gradient:

        L = mean_i δ_i·max(−A_i·r̂_i, −A_i·clip(r̂_i, 1 − ε, 1 + ε)) + β_KL·mean_i KL_i

    RatioNorm assumes a normalised Gaussian log-prob with a θ-independent std (flow_sde, dance_sde; not cps).
    ``δ`` is not normalised: with K uniform steps it is the constant K.

    Args:
        log_prob, old_log_prob, advantages: ``[B]`` as in ``flow_grpo_loss``.
        clip_range: ε.
        mean: ``[B, …]`` current transition mean (with grad).
        old_mean: ``[B, …]`` the rollout's transition mean (no grad).
        std: the step std, broadcastable to ``mean`` (constant per sample).
        dt: ``[B]`` ``sigma − sigma_next`` (> 0); required with ``grad_reweight`` or ``kl_dt_scale``.
        ratio_norm, grad_reweight: switch the two corrections (each off = Flow-GRPO's version).
        kl_beta, ref_mean, kl_dt_scale: optional KL to the reference, as in ``flow_grpo_loss`` (not reweighted).
    Returns:
        ``(loss, metrics)``: ``policy_loss``, ``kl``, ``approx_kl``, ``clipfrac``, ``ratio_mean``, ``ratio_std``
        (of the normalised ratio), ``raw_ratio_mean`` (``exp(log r)``), ``step_weight`` (mean δ).
    """
    if mean is None or old_mean is None or std is None:
        raise ValueError("grpo_guard needs mean, old_mean and std (the current and rollout step means, the step std)")
    advantages = _at_least_fp32(advantages)
    raw_log_ratio = _at_least_fp32(log_prob) - _at_least_fp32(old_log_prob)
    log_ratio = raw_log_ratio
    if ratio_norm:
        s = _per_sample_std(std, mean)
        drift = _mean_over_dims((_at_least_fp32(mean) - _at_least_fp32(old_mean).detach()) ** 2)
        log_ratio = s * raw_log_ratio + drift / (2 * s)
    weight = 1.0 / _check_dt(dt, "grpo_guard with grad_reweight=True").to(log_ratio.device) if grad_reweight else None
    policy_loss, ratio = _clipped_surrogate(log_ratio, advantages, clip_range, weight)
    loss, metrics = _with_step_kl(policy_loss, kl_beta, mean, ref_mean, std, dt, kl_dt_scale, "grpo_guard")
    metrics.update(_ratio_metrics(ratio, log_ratio, clip_range))
    metrics["raw_ratio_mean"] = torch.exp(raw_log_ratio.detach()).mean().item()
    metrics["step_weight"] = weight.mean().item() if weight is not None else 1.0
    return loss, metrics


@register_loss("dpo")
def dpo_loss(
    model_err_w: torch.Tensor,
    model_err_l: torch.Tensor,
    ref_err_w: torch.Tensor,
    ref_err_l: torch.Tensor,
    *,
    dpo_beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Diffusion-DPO (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization",
    eq. 14) with the reference implementation's convention for β:

        inside = −(β/2)·[(err_θ(w) − err_ref(w)) − (err_θ(l) − err_ref(l))]
        L = −mean_i log σ(inside_i)

    ``err`` is the mean squared error of the prediction target (ε, or the velocity for flow models) over
    the non-batch dims; winner ``w`` and loser ``l`` of a pair share the noise and timestep. The paper writes
    the coefficient as ``β·T·ω(λ_t)``; with ``ω`` constant, our ``dpo_beta`` is ``2·β·T·ω`` (the reference
    code's ``beta_dpo``, e.g. 5000 for SD1.5). ``inside_i`` is the implicit reward margin
    ``r(w) − r(l)`` with ``r(x) = −(β/2)·(err_θ(x) − err_ref(x))``. Reference errors carry no gradient.

    Args:
        model_err_w, model_err_l: ``[B]`` per-pair errors of the trained model (with grad).
        ref_err_w, ref_err_l: ``[B]`` the reference model's errors on the same inputs.
        dpo_beta: β > 0.
    Returns:
        ``(loss, metrics)``: ``loss``, ``implicit_accuracy`` (fraction with ``inside > 0``), ``reward_margin``
        (mean ``inside``), ``reward_w``, ``reward_l``, ``model_err_w``, ``model_err_l``, ``ref_err_w``,
        ``ref_err_l`` (batch means).
    """
    if dpo_beta <= 0:
        raise ValueError(f"dpo_beta must be > 0, got {dpo_beta}")
    errs = {"model_err_w": model_err_w, "model_err_l": model_err_l, "ref_err_w": ref_err_w, "ref_err_l": ref_err_l}
    for name, e in errs.items():
        if e.ndim != 1 or e.shape != model_err_w.shape:
            raise ValueError(f"dpo: {name} must be a [B] tensor like model_err_w {tuple(model_err_w.shape)}, got {tuple(e.shape)}")
    reward_w = -0.5 * dpo_beta * (model_err_w.float() - ref_err_w.float().detach())
    reward_l = -0.5 * dpo_beta * (model_err_l.float() - ref_err_l.float().detach())
    inside = reward_w - reward_l
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "implicit_accuracy": (inside > 0).float().mean().item(),
            "reward_margin": inside.mean().item(),
            "reward_w": reward_w.mean().item(),
            "reward_l": reward_l.mean().item(),
            **{name: e.float().mean().item() for name, e in errs.items()},
        }
    return loss, metrics


@register_loss("nft")
def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_target: torch.Tensor,
    r: torch.Tensor,
    *,
    nft_beta: float,
    adaptive_weight: bool,
    sigma: torch.Tensor | None = None,
    adaptive_weight_min: float = 1e-5,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    policy_scale: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT's negative-aware flow-matching loss (Zheng et al. 2025, "DiffusionNFT: Online Diffusion
    Reinforcement with Forward Process", eq. 7), on forward-noised clean samples ``x_σ = (1 − σ)·x0 + σ·ε``.

        v⁺ = (1 − β)·v_old + β·v_θ            (implicit positive policy)
        v⁻ = (1 + β)·v_old − β·v_θ            (implicit negative policy)
        L = s·(1/β)·mean_i [r_i·e(v⁺_i) + (1 − r_i)·e(v⁻_i)] + β_KL·mean_i mean_dims (v_θ − v_ref)²

    with the policy term's scale ``s = policy_scale`` (1; the reference code's is its ``adv_clip_max``, 5, so its KL is 5×
    weaker relative to the policy term at the same ``β_KL``) and the target ``v* = ε − x0``. ``adaptive_weight=False``: ``e(v) = mean_dims (v − v*)²``; the minimiser
    of each sample's term over ``v_θ`` is ``v_old + (2r − 1)·(v* − v_old)/β`` (``r = ½`` keeps ``v_old``).
    ``adaptive_weight=True`` (the reference implementation): the error is taken on the x0 prediction
    ``x̂0 = x_σ − σ·v``, where ``x̂0 − x0 = σ·(v* − v)``, and divided by a detached per-sample weight:
    ``e(v) = mean_dims (σ·(v − v*))² / w``, ``w = max(mean_dims |σ·(v − v*)|, adaptive_weight_min)``, one
    ``w`` for ``v⁺`` and one for ``v⁻``. The ``1/β`` factor (as in the reference code) keeps the gradient
    scale independent of β and does not move the minimiser; the reference code also multiplies the policy
    term by its ``adv_clip_max`` (``policy_scale``). Math in fp32 (fp64 inputs stay fp64: the parity tests).

    Args:
        v_theta: ``[B, …]`` current velocity prediction (with grad).
        v_old: ``[B, …]`` the sampling (old) policy's prediction on the same input (detached here).
        v_target: ``[B, …]`` ``v* = ε − x0``.
        r: ``[B]`` optimality probability in ``[0, 1]`` (``nft_reward_to_r``).
        nft_beta: β > 0.
        adaptive_weight: use the x0-space adaptively weighted error; needs ``sigma`` (``[B]``).
        kl_beta: weight of the velocity KL to the reference ``v_ref`` (``[B, …]``, required when > 0).
        policy_scale: ``s`` > 0, the policy term's scale.
    Returns:
        ``(loss, metrics)``: ``policy_loss`` (unscaled), ``positive_loss``, ``negative_loss`` (means of ``e(v⁺)``,
        ``e(v⁻)``), ``kl``, ``r_mean``, ``old_deviate`` (mean ``(v_θ − v_old)²``).
    """
    if nft_beta <= 0:
        raise ValueError(f"nft_beta must be > 0, got {nft_beta}")
    if policy_scale <= 0:
        raise ValueError(f"nft policy_scale must be > 0, got {policy_scale}")
    if v_old.shape != v_theta.shape or v_target.shape != v_theta.shape:
        shapes = f"v_theta {tuple(v_theta.shape)}, v_old {tuple(v_old.shape)}, v_target {tuple(v_target.shape)}"
        raise ValueError(f"nft: {shapes} must match")
    r = _at_least_fp32(r)
    if r.shape != v_theta.shape[:1]:
        raise ValueError(f"nft: r must be [B] = {tuple(v_theta.shape[:1])}, got {tuple(r.shape)}")
    if bool(((r < 0) | (r > 1)).any()):
        raise ValueError("nft: r must lie in [0, 1] (map rewards with nft_reward_to_r)")
    v_theta, v_old, v_target = _at_least_fp32(v_theta), _at_least_fp32(v_old).detach(), _at_least_fp32(v_target)
    v_pos = (1 - nft_beta) * v_old + nft_beta * v_theta
    v_neg = (1 + nft_beta) * v_old - nft_beta * v_theta
    if adaptive_weight:
        if sigma is None:
            raise ValueError("nft with adaptive_weight=True needs sigma ([B] noise level of x_σ)")
        s = torch.as_tensor(sigma, device=v_theta.device).to(v_theta.dtype).reshape(-1, *([1] * (v_theta.ndim - 1)))

        def error(v):
            diff = s * (v - v_target)
            with torch.no_grad():
                w = _mean_over_dims(diff.abs()).clamp_min(adaptive_weight_min)
            return _mean_over_dims(diff**2) / w
    else:

        def error(v):
            return _mean_over_dims((v - v_target) ** 2)

    positive, negative = error(v_pos), error(v_neg)
    policy_loss = (r * positive + (1 - r) * negative).mean() / nft_beta
    loss = policy_scale * policy_loss
    kl_value = 0.0
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("nft with kl_beta > 0 needs v_ref (the reference model's velocity)")
        kl = _mean_over_dims((v_theta - _at_least_fp32(v_ref).detach()) ** 2).mean()
        loss = loss + kl_beta * kl
        kl_value = kl.item()
    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.item(),
            "positive_loss": positive.mean().item(),
            "negative_loss": negative.mean().item(),
            "kl": kl_value,
            "r_mean": r.mean().item(),
            "old_deviate": ((v_theta - v_old) ** 2).mean().item(),
        }
    return loss, metrics


def nft_reward_to_r(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    *,
    adv_clip_max: float = 5.0,
    std_mode: str = "global",
    eps: float = 1e-4,
) -> torch.Tensor:
    """DiffusionNFT's optimality probability from rewards (Zheng et al. 2025, sec. 4 / reference code):

        A = group_advantages(rewards, group_id, std_mode, eps)
        r = ½ + ½·clip(A / adv_clip_max, −1, 1)          ∈ [0, 1]

    Args:
        rewards: ``[B]``.
        group_id: ``[B]`` prompt group of each sample.
        adv_clip_max: advantages are clipped to ``±adv_clip_max`` before mapping (> 0).
        std_mode, eps: as in ``group_advantages``.
    Returns:
        ``[B]`` fp32 ``r``.
    """
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}; choose one of {STD_MODES}")
    adv = group_advantages(rewards, group_id, std_mode=std_mode, eps=eps, clip_max=adv_clip_max)
    return 0.5 + 0.5 * (adv / adv_clip_max).clamp(-1.0, 1.0)


STEP_LOSSES = ("flow_grpo", "ddpo", "grpo_guard")


class StepLoss(StepObjective):
    """A per-step policy-gradient loss of the registry (``flow_grpo``, ``ddpo``, ``grpo_guard``) as the engine's step
    objective (:func:`make_step_loss`). Its spec: the base reference when ``kl_beta > 0``; off-policy rollouts corrected
    by truncated importance weights (not ``grpo_guard``, whose RatioNorm needs the proximal step means); rollouts that
    record the step means for ``grpo_guard``."""

    def __init__(self, name: str, hyper: dict, rollout_is_cap: float):
        loss = get_loss(name)
        if name not in STEP_LOSSES:
            raise ValueError(f"loss {name!r} is not a per-step policy-gradient loss; make_step_loss supports {STEP_LOSSES}")
        guard = name == "grpo_guard"
        super().__init__(ObjectiveSpec(
            name=name, granularity=Granularity.STEP, reference=BASE if hyper.get("kl_beta", 0.0) > 0 else None,
            off_policy=OffPolicy.NONE if guard else OffPolicy.TRUNCATED_IS, record_means=guard,
        ))
        self.name, self.loss, self.hyper, self.rollout_is_cap = name, loss, hyper, rollout_is_cap

    @property
    def needs_reference(self) -> bool:
        return self.spec.reference is not None

    @property
    def loss_name(self) -> str:
        return self.spec.name

    def __call__(self, step: dict, batch, k: int):
        name, loss, hyper, rollout_is_cap = self.name, self.loss, self.hyper, self.rollout_is_cap
        keys = set(batch.keys())
        extra = {}
        if "sigmas" in keys:
            extra["dt"] = batch["sigmas"][:, k] - batch["sigmas"][:, k + 1]
        if "prox_log_probs" in keys or "proximal_is_current" in keys:
            if name == "grpo_guard":
                raise ValueError("grpo_guard cannot train off-policy rollouts (its RatioNorm needs the proximal step means); use distributed.max_staleness=0")
            prox = batch["prox_log_probs"][:, k] if "prox_log_probs" in keys else step["log_prob"].detach()
            behaviour = batch["log_probs"][:, k]
            weight = truncated_is_weight(prox, behaviour, rollout_is_cap).to(step["log_prob"].device)
            value, metrics = loss(step["log_prob"], prox, batch["advantages"], mean=step["mean"], ref_mean=step.get("ref_mean"),
                                  std=step["std"], is_weight=weight, **extra, **hyper)
            metrics.update(rollout_is_weight_mean=weight.mean().item(),
                           rollout_is_truncated=(weight >= rollout_is_cap * (1 - 1e-6)).float().mean().item())
            return value, metrics
        if name == "grpo_guard":
            if "means" not in keys:
                raise ValueError(
                    "grpo_guard needs the rollout step means batch['means'] [B, K, …]: record StepOutput.mean during rollout"
                )
            extra["old_mean"] = batch["means"][:, k]
        return loss(
            step["log_prob"], batch["log_probs"][:, k], batch["advantages"],
            mean=step["mean"], ref_mean=step.get("ref_mean"), std=step["std"], **extra, **hyper,
        )


def make_step_loss(name: str, **hyper) -> StepLoss:
    """Bind a per-step policy-gradient loss of the registry to the engine's per-step interface (a :class:`StepLoss`).

    The returned ``fn(step, batch, k)`` reads the rollout log-probs ``batch["log_probs"][:, k]``,
    ``batch["advantages"]`` and, when the batch has them, ``dt = sigmas[:, k] − sigmas[:, k+1]``; for
    ``grpo_guard`` also the rollout step means ``batch["means"][:, k]`` (``[B, K, …]``, the ``mean`` of each
    rollout step). Its spec names the base reference when ``kl_beta > 0`` (``fn.needs_reference``).

    Off-policy rollouts (``distributed.max_staleness > 0``): when the batch holds ``prox_log_probs [B, K]`` (the
    actor's log-probs of the stale trajectories at the start of the update), the ratio is taken against them
    and each sample is weighted by ``truncated_is_weight(prox, behaviour, rollout_is_cap)``. When it holds
    ``proximal_is_current [B]`` instead (an update of one optimizer step: every forward runs at the weights the
    update starts from), the proximal log-probs are the step's own, detached (no second forward); metrics
    ``rollout_is_weight_mean`` and ``rollout_is_truncated`` (fraction at the cap). ``fn.spec.off_policy`` says
    whether the loss supports it (not ``grpo_guard``, whose RatioNorm needs the proximal step means).
    """
    rollout_is_cap = float(hyper.pop("rollout_is_cap", 2.0))
    return StepLoss(name, hyper, rollout_is_cap)
