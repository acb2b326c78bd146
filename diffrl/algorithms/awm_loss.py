"""Advantage Weighted Matching (AWM): the pretraining flow-matching loss on policy samples, weighted per
sample by its advantage.

Paper: Xue, Ge, Zhang, Li, Ma, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models", arXiv:2509.25050 (2025); code https://github.com/scxue/advantage_weighted_matching
(``scripts/train_sd3_awm.py``). The paper shows that DDPO / Flow-GRPO's per-step likelihood is an implicit
denoising score matching with *noisy* targets (x_{t−Δt} instead of x0), which adds variance; AWM uses the
clean-target flow-matching loss of pretraining as the log-likelihood surrogate and claims up to 24× faster
training than Flow-GRPO (arXiv v1 abstract; 34× in the ICML 2026 version) on GenEval, OCR and PickScore with
SD3.5-Medium and FLUX, without loss of image quality.

With a policy sample x0 (the rollout's final latent, any sampler), a fresh ε ~ N(0, I) and a training noise
level σ ∈ [0, 1] drawn independently of the sampler's trajectory, x_σ = (1 − σ)·x0 + σ·ε, target
v* = ε − x0:

    e_i  = mean_dims (v_θ(x_σ) − v*)²                         per-sample flow-matching error
    ℓ_i  = w(e_i, σ_i)                                        per-timestep weighting (below)
    Â_i  = A_i                 or clip(A_i, ±c)/c·m with adv_clip_max = c, advantage_max = m (the reference code: c = 5, m = 1)
    L    = mean_i Â_i·ℓ_i + β·mean_i mean_dims (v_θ − v_ref)² + β_ema·mean_i mean_dims (v_θ − v_ema)²

Positive-advantage samples are pulled toward their flow-matching target, negative ones pushed away. The
reference code writes the policy term as PPO on ``log p = −ℓ``: ``max(−Â·r, −Â·clip(r, 1 ± ε))`` with
``r = exp(ℓ_old − ℓ)``, ``ε = 1`` and one update per rollout (on-policy, ``r ≡ 1``), whose gradient is
exactly that of ``mean_i Â_i·ℓ_i`` (its *value* is ``−mean Â`` instead); the ratio is therefore left out.

Weightings ``w`` (the reference code's ``weighting``: ``Uniform``, ``t``, ``t**2``, ``huber``, ``ghuber``,
its ``t`` being our σ):

* ``"uniform"``: ``ℓ = e``.
* ``"sigma"``: ``ℓ = σ·e``;  ``"sigma2"``: ``ℓ = σ²·e``.
* ``"huber"``: ``ℓ = (√(e + δ) − √δ)·σ``, ``δ = 1e−10``.
* ``"ghuber"`` (the released configs, p = 0.25): ``ℓ = ((e + δ)^p − δ^p)·σ/p`` — a robust, concave
  transform of the error (``∂ℓ/∂e = σ·(e + δ)^(p−1)``).

``v_ref`` is the frozen reference model's velocity on the same input (LoRA disabled; β = 0.003 for
GenEval/OCR, 1e−4 for PickScore in the released configs; its "Uniform" KL, not divided by a step variance).
``v_ema`` is the optional second anchor of the reference code, an EMA of the trained weights ("KL-EMA, mimic
TRPO", ``ema_beta = 1``). The advantages are computed outside (group-relative, the reference code uses
per-prompt mean and the batch-global std, ``(r − mean_prompt)/(std_all + 1e−4)``).
"""

from __future__ import annotations

import torch

AWM_WEIGHTINGS = ("uniform", "sigma", "sigma2", "huber", "ghuber")
_HUBER_DELTA = 1e-10


def _mean_over_dims(x: torch.Tensor) -> torch.Tensor:
    """``[B, …] -> [B]``: mean over the non-batch dims."""
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def _compute(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 (bf16/fp16/fp32 inputs), or kept in fp64 (the parity tests run the loss in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def _anchor(v_theta: torch.Tensor, v_other: torch.Tensor | None, name: str) -> torch.Tensor:
    """``mean_i mean_dims (v_θ − v_other)²`` with ``v_other`` detached (fp32)."""
    if v_other is None:
        raise ValueError(f"awm: a positive weight for the {name} term needs {name} (its velocity on the same input)")
    if v_other.shape != v_theta.shape:
        raise ValueError(f"awm: {name} {tuple(v_other.shape)} must match v_theta {tuple(v_theta.shape)}")
    return _mean_over_dims((v_theta - _compute(v_other).detach()) ** 2).mean()


def awm_loss(
    v_theta: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    *,
    sigma: torch.Tensor | float,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
    adv_clip_max: float | None = None,
    advantage_max: float = 1.0,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    ema_beta: float = 0.0,
    v_ema: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AWM's advantage-weighted flow-matching loss (module docstring for the formula and sources).

    Args:
        v_theta: ``[B, …]`` the trained model's velocity at ``x_σ = (1 − σ)·x0 + σ·ε`` (with grad).
        target: ``[B, …]`` ``v* = ε − x0`` (no grad needed).
        advantages: ``[B]`` per-sample advantages (detached here).
        sigma: ``[B]`` (or a float) noise level of each row, in ``[0, 1]`` (1 = noise).
        weighting: one of ``AWM_WEIGHTINGS``.
        ghuber_power: ``p`` of ``"ghuber"`` (> 0).
        adv_clip_max: if set (> 0), advantages become ``clip(A, ±c)/c·advantage_max`` ∈ ``[−advantage_max, advantage_max]``.
        advantage_max: the reference code's ``advantage_max`` (1 in its configs); used with ``adv_clip_max``.
        kl_beta, v_ref: weight and velocity of the reference anchor (``v_ref`` required when ``kl_beta > 0``).
        ema_beta, v_ema: weight and velocity of the EMA anchor (``v_ema`` required when ``ema_beta > 0``).
    Returns:
        ``(loss, metrics)``: ``policy_loss`` (``mean Â·ℓ``), ``awm_err_mean`` (mean ``e``), ``awm_weighted``
        (mean ``ℓ``), ``err_pos``/``err_neg`` (mean ``e`` over ``Â > 0`` / ``Â < 0``, NaN if none), ``adv_mean``,
        ``adv_abs_mean`` (of ``Â``), ``kl``, ``ema_kl`` (0.0 when off).
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"awm: unknown weighting {weighting!r}; choose one of {AWM_WEIGHTINGS}")
    if weighting == "ghuber" and ghuber_power <= 0:
        raise ValueError(f"awm: ghuber_power must be > 0, got {ghuber_power}")
    if advantage_max <= 0:
        raise ValueError(f"awm: advantage_max must be > 0, got {advantage_max}")
    if adv_clip_max is not None and adv_clip_max <= 0:
        raise ValueError(f"awm: adv_clip_max must be > 0 or None, got {adv_clip_max}")
    if target.shape != v_theta.shape:
        raise ValueError(f"awm: target {tuple(target.shape)} must match v_theta {tuple(v_theta.shape)}")
    batch = v_theta.shape[:1]
    adv = _compute(torch.as_tensor(advantages)).detach().to(v_theta.device)
    if adv.shape != batch:
        raise ValueError(f"awm: advantages must be [B] = {tuple(batch)}, got {tuple(adv.shape)}")
    dtype = torch.float64 if v_theta.dtype == torch.float64 else torch.float32
    s = torch.as_tensor(sigma, device=v_theta.device).to(dtype).detach()
    s = s.expand(batch) if s.ndim == 0 else s.reshape(-1)
    if s.shape != batch:
        raise ValueError(f"awm: sigma must be a float or [B] = {tuple(batch)}, got {tuple(s.shape)}")
    if bool(((s < 0) | (s > 1)).any()):
        raise ValueError(f"awm: sigma must lie in [0, 1], got {s.tolist()}")
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max
        if advantage_max != 1.0:
            adv = adv * advantage_max

    v_theta = _compute(v_theta)
    adv = adv.to(v_theta.dtype)
    err = _mean_over_dims((v_theta - _compute(target).detach()) ** 2)
    if weighting == "uniform":
        weighted = err
    elif weighting == "sigma":
        weighted = s * err
    elif weighting == "sigma2":
        weighted = s**2 * err
    elif weighting == "huber":
        weighted = (torch.sqrt(err + _HUBER_DELTA) - _HUBER_DELTA**0.5) * s
    else:
        p = ghuber_power
        weighted = ((err + _HUBER_DELTA) ** p - _HUBER_DELTA**p) * s / p

    policy_loss = (adv * weighted).mean()
    loss = policy_loss
    kl_value = ema_value = 0.0
    if kl_beta > 0:
        kl = _anchor(v_theta, v_ref, "v_ref")
        loss = loss + kl_beta * kl
        kl_value = kl.item()
    if ema_beta > 0:
        ema_kl = _anchor(v_theta, v_ema, "v_ema")
        loss = loss + ema_beta * ema_kl
        ema_value = ema_kl.item()
    with torch.no_grad():
        pos, neg = adv > 0, adv < 0
        metrics = {
            "policy_loss": policy_loss.item(),
            "awm_err_mean": err.mean().item(),
            "awm_weighted": weighted.mean().item(),
            "err_pos": err[pos].mean().item() if bool(pos.any()) else float("nan"),
            "err_neg": err[neg].mean().item() if bool(neg.any()) else float("nan"),
            "adv_mean": adv.mean().item(),
            "adv_abs_mean": adv.abs().mean().item(),
            "kl": kl_value,
            "ema_kl": ema_value,
        }
    return loss, metrics
