"""Stateless sampler steps under one contract (docs/architecture.md, "SDE step contract").

Every step kind is a pure function

    step(model_output, sample, sigma, sigma_next, *, noise_level, generator=None, prev_sample=None)
        -> StepOutput(prev_sample, mean, std, log_prob)

``sigma``/``sigma_next`` are per-sample ``[B]`` tensors (or scalars), ``sigma_next < sigma``; the
model output is the velocity ``v = ε − x0``. Given ``prev_sample`` the step scores that sample
instead of drawing one (the training path). Math runs in fp32. ``log_prob`` is the Gaussian
log-density of ``prev_sample`` under ``N(mean, std²)`` averaged over the non-batch dims (the
anchors' convention); deterministic kinds return ``std = 0`` and ``log_prob = 0``.

``generator`` is one ``torch.Generator`` for the whole batch or a list with one per sample; the
per-sample form makes a sample's noise independent of the batch it is drawn in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass
class StepOutput:
    """Result of one sampler step.

    Attributes:
        prev_sample: the next (less noisy) sample ``[B, …]``.
        mean: the Gaussian mean of the transition ``[B, …]`` (fp32).
        std: its standard deviation, broadcastable to ``mean`` (fp32; 0 for ODE kinds).
        log_prob: ``[B]`` mean over non-batch dims of the Gaussian log-density of ``prev_sample``.
        x0: the step's clean-sample prediction ``x̂0`` where the kind computes it (dpm2's history), else None.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    x0: torch.Tensor | None = None


def randn_per_sample(shape: Sequence[int], generator: Generators, device, dtype=torch.float32) -> torch.Tensor:
    """Standard normal noise of ``shape``; with a list of generators, row ``b`` comes from ``generator[b]``."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
    rows = torch.stack([torch.randn(tuple(shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator])
    if rows.device.type == "cpu" and torch.device(device).type == "cuda":
        # host generators, device sample: a pinned, asynchronous copy keeps the host from waiting on the GPU
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """Scalar or ``[B]`` → fp32 tensor broadcastable against ``like [B, …]``."""
    if isinstance(value, (int, float)):  # filled on the device: no host-to-device copy (and no sync)
        return torch.full((like.shape[0], *([1] * (like.ndim - 1))), float(value), dtype=torch.float32, device=like.device)
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[B]``: mean over non-batch dims of ``log N(x; mean, std²)`` (fp32)."""
    std = std.expand_as(mean)
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def _require_noise(noise_level: float, step_name: str) -> None:
    if noise_level <= 0:
        raise ValueError(f"{step_name} needs noise_level > 0 (got {noise_level}); use the 'ode' step for deterministic sampling")


def _on_host(value) -> bool:
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


def _require_decreasing(dt: torch.Tensor, step_name: str, sigma=None, sigma_next=None) -> None:
    """Raise unless ``dt = sigma_next − sigma < 0`` everywhere. When the sigmas are Python numbers or CPU
    tensors, the same fp32 difference is checked on the host, so a device sampling loop does not sync."""
    if sigma is not None and _on_host(sigma) and _on_host(sigma_next):
        dt = torch.as_tensor(sigma_next, dtype=torch.float32) - torch.as_tensor(sigma, dtype=torch.float32)
    if bool((dt >= 0).any()):
        raise ValueError(f"{step_name} needs sigma_next < sigma for every sample")


def _finish(mean, std, sample_dtype, generator, prev_sample) -> StepOutput:
    if prev_sample is None:
        noise = randn_per_sample(mean.shape, generator, mean.device)
        prev_sample = (mean + std * noise).to(sample_dtype)
    log_prob = gaussian_log_prob(prev_sample.detach().float(), mean, std)
    return StepOutput(prev_sample=prev_sample, mean=mean, std=std.expand_as(mean), log_prob=log_prob)


def _deterministic(mean: torch.Tensor, sample: torch.Tensor, prev_sample: torch.Tensor | None, x0: torch.Tensor | None = None) -> StepOutput:
    """A step without noise: the mean is the sample (a given ``prev_sample`` is passed through), ``std = 0``,
    ``log_prob = 0``."""
    out = mean.to(sample.dtype) if prev_sample is None else prev_sample
    zeros = torch.zeros(mean.shape[0], device=mean.device)
    return StepOutput(prev_sample=out, mean=mean, std=torch.zeros_like(mean), log_prob=zeros, x0=x0)


def flow_sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Flow-GRPO's SDE step (Liu et al. 2025, "Flow-GRPO", eq. 9), marginal-preserving for the flow ODE.

    With ``dt = σ_next − σ < 0`` and ``σ_t = a·√(σ / (1 − σ))`` (``a = noise_level``)::

        mean = x·(1 + σ_t²·dt / (2σ)) + v·dt·(1 + σ_t²·(1 − σ) / (2σ))
        std  = σ_t·√(−dt)

    At ``σ = 1`` the ratio ``σ/(1 − σ)`` is infinite; as in Flow-GRPO the denominator then uses the
    next sigma of the schedule (``1 − σ_next``).
    """
    _require_noise(noise_level, "flow_sde_step")
    v = model_output.float()
    x = sample.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s
    _require_decreasing(dt, "flow_sde_step", sigma, sigma_next)
    denom = torch.where(s >= 1.0, 1.0 - s_next, 1.0 - s)
    std_t = noise_level * torch.sqrt(s / denom)
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * torch.sqrt(-dt)
    return _finish(mean, std, sample.dtype, generator, prev_sample)


def dance_sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """DanceGRPO's SDE step (Xue et al. 2025, "DanceGRPO"): constant diffusion ``η = noise_level``.

    The reverse-time SDE ``dx = [v − (η²/2)·∇log p_σ(x)] dσ + η dW`` discretised with Euler–Maruyama,
    the score estimated from the velocity (``x̂0 = x − σ·v``, ``∇log p ≈ −(x − (1 − σ)·x̂0)/σ²``)::

        mean = x + dσ·v − (η²/2)·score·dσ,     std = η·√|dσ|,     dσ = σ_next − σ < 0
    """
    _require_noise(noise_level, "dance_sde_step")
    v = model_output.float()
    x = sample.float()
    s = _per_sample(sigma, x)
    dt = _per_sample(sigma_next, x) - s
    _require_decreasing(dt, "dance_sde_step", sigma, sigma_next)
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    mean = x + dt * v - 0.5 * noise_level**2 * score * dt
    std = noise_level * torch.sqrt(-dt)
    return _finish(mean, std, sample.dtype, generator, prev_sample)


def cps_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Coefficient-preserving sampling (Wang & Yu 2025, "Coefficients-Preserving Sampling for RL
    with Flow Matching"): re-noise the predicted sample so the next state keeps the exact coefficients
    of a point on the flow path, ``(1 − σ_next)·x0 + σ_next·ε``::

        x̂0 = x − σ·v,   ε̂ = x + (1 − σ)·v,   std = σ_next·sin(a·π/2)
        mean = (1 − σ_next)·x̂0 + √(σ_next² − std²)·ε̂,   prev = mean + std·z

    The noise it injects is O(σ), not O(√dt): with posterior-mean predictions (x̂0 = E[x0|x]) it
    shrinks the variance of the samples, so its marginals are not the flow's; what it preserves is the
    coefficient identity above for the exact (x0, ε) pair.

    ``log_prob`` is **unnormalised**, as in the CPS reference: ``−mean_dims (prev − mean)²`` (no
    division by the variance, no normalising constant). Ratios of it are what the loss uses; it is not a
    density. At ``σ_next = 0`` the step is deterministic (``std = 0``; a drawn sample scores 0).
    """
    v = model_output.float()
    x = sample.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    _require_decreasing(s_next - s, "cps_step", sigma, sigma_next)
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v
    std = s_next * math.sin(noise_level * math.pi / 2)
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0.0)) * eps_hat
    if prev_sample is None:
        prev_sample = (mean + std * randn_per_sample(mean.shape, generator, mean.device)).to(sample.dtype)
    sq = (prev_sample.detach().float() - mean) ** 2
    log_prob = -sq.mean(dim=tuple(range(1, sq.ndim)))
    return StepOutput(prev_sample=prev_sample, mean=mean, std=std.expand_as(mean), log_prob=log_prob)


def ode_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float = 0.0,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
) -> StepOutput:
    """Deterministic Euler step of the flow ODE: ``x_next = x + (σ_next − σ)·v``; ``std = 0``, ``log_prob = 0``.

    ``noise_level``, ``generator`` and ``prev_sample`` are accepted for the shared contract; a given
    ``prev_sample`` is returned as the sample (a deterministic step has no density to score).
    """
    x = sample.float()
    dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    return _deterministic(x + dt * model_output.float(), sample, prev_sample)


def ddim_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float = 1.0,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
    prediction_type: str = "epsilon",
    clip_sample: float | None = None,
) -> StepOutput:
    """DDIM (Song et al. 2021, "Denoising Diffusion Implicit Models", eq. 12) with ``η = noise_level``;
    the transition DDPO (Black et al. 2024) scores.

    A sample is ``x = α·x0 + σ·ε``. For epsilon-prediction models (``prediction_type="epsilon"``) the
    schedule is variance preserving and ``sigma = √(1 − ᾱ)``, ``α = √ᾱ = √(1 − σ²)`` (the model's DDPM
    ᾱ schedule, expressed as a noise level in [0, 1]); for flow models (``"flow"``, velocity output)
    ``α = 1 − σ``. With the predictions ``x̂0``, ``ε̂``::

        c    = η·σ_next·√(1 − α²·σ_next² / (α_next²·σ²))      (= η·√β̃_t in the VP case)
        mean = α_next·x̂0 + √(σ_next² − c²)·ε̂,      prev = mean + c·z

    ``clip_sample = c`` clamps ``x̂0`` to ``[−c, c]`` before the update (pixel-space DDPM models), keeping
    ``ε̂`` as predicted (diffusers' DDIMScheduler default). ``η = 0`` is deterministic (``std = 0``,
    ``log_prob = 0``), as is a step to ``σ_next = 0`` (``c = 0``);
    ``η = 1`` gives the DDPM posterior
    variance ``β̃_t = (1 − ᾱ_prev)/(1 − ᾱ_t)·(1 − ᾱ_t/ᾱ_prev)``.
    """
    if noise_level < 0:
        raise ValueError(f"ddim_step needs noise_level (η) ≥ 0, got {noise_level}")
    x = sample.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    _require_decreasing(s_next - s, "ddim_step", sigma, sigma_next)
    out = model_output.float()
    if prediction_type == "epsilon":
        alpha, alpha_next = torch.sqrt((1 - s**2).clamp_min(0.0)), torch.sqrt((1 - s_next**2).clamp_min(0.0))
        eps_hat = out
        x0_hat = (x - s * eps_hat) / alpha
    elif prediction_type == "flow":
        alpha, alpha_next = 1 - s, 1 - s_next
        x0_hat = x - s * out
        eps_hat = x + (1 - s) * out
    else:
        raise ValueError(f"ddim_step: unknown prediction_type {prediction_type!r}; use 'epsilon' or 'flow'")
    if clip_sample is not None:
        x0_hat = x0_hat.clamp(-clip_sample, clip_sample)
    ratio = (alpha * s_next) ** 2 / ((alpha_next * s) ** 2)
    var = noise_level**2 * s_next**2 * (1 - ratio).clamp_min(0.0)
    std = torch.sqrt(var)
    mean = alpha_next * x0_hat + torch.sqrt((s_next**2 - var).clamp_min(0.0)) * eps_hat
    if noise_level == 0:
        return _deterministic(mean, sample, prev_sample, x0_hat)
    if prev_sample is None:
        prev_sample = (mean + std * randn_per_sample(mean.shape, generator, mean.device)).to(sample.dtype)
    # rows stepping to σ_next = 0 have no variance left: they are deterministic and score 0
    noisy = std.flatten(1)[:, 0] > 0
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    log_prob = torch.where(noisy, gaussian_log_prob(prev_sample.detach().float(), mean, safe_std), torch.zeros_like(noisy, dtype=torch.float32))
    return StepOutput(prev_sample=prev_sample, mean=mean, std=std.expand_as(mean), log_prob=log_prob, x0=x0_hat)


def dpm2_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float = 0.0,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
    history: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> StepOutput:
    """Second-order multistep solver of the flow ODE: DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++",
    Algorithm 2) in data-prediction form for ``x = α·x0 + σ·ε`` with ``α = 1 − σ``.

    With ``λ = log(α/σ)``, ``h = λ_next − λ``, the data prediction ``x̂0 = x − σ·v`` and the previous
    step's ``(x̂0_prev, σ_prev)`` in ``history`` (``r = h_prev / h``)::

        D      = (1 + 1/(2r))·x̂0 − 1/(2r)·x̂0_prev
        x_next = (σ_next/σ)·x − α_next·(e^{−h} − 1)·D

    Without history (the first step), and at ``σ_next = 0`` (the last step, where ``h = ∞``), it is the
    first-order update, which for flows equals the Euler step exactly. Deterministic: ``std = 0``,
    ``log_prob = 0``; ``StepOutput.x0`` carries ``x̂0`` as the next step's history.
    """
    x = sample.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    _require_decreasing(s_next - s, "dpm2_step", sigma, sigma_next)
    x0_hat = x - s * model_output.float()
    a, a_next = 1 - s, 1 - s_next
    # first-order (DDIM) coefficient of x̂0: α_next·(1 − e^{−h}) = α_next − σ_next·α/σ
    c0 = a_next - s_next * a / s
    data = x0_hat
    if history is not None and bool((s_next > 0).all()) and bool((a > 0).all()):
        x0_prev, s_prev = history
        s_prev = _per_sample(s_prev, x)
        lam = lambda a_, s_: torch.log(a_) - torch.log(s_)
        h = lam(a_next, s_next) - lam(a, s)
        h_prev = lam(a, s) - lam((1 - s_prev).clamp_min(1e-12), s_prev)
        r = h_prev / h
        data = (1 + 1 / (2 * r)) * x0_hat - (1 / (2 * r)) * x0_prev.float()
    return _deterministic((s_next / s) * x + c0 * data, sample, prev_sample, x0_hat)


STEP_KINDS: dict[str, Callable[..., StepOutput]] = {
    "flow_sde": flow_sde_step,
    "dance_sde": dance_sde_step,
    "cps": cps_step,
    "ode": ode_step,
    "dpm2": dpm2_step,
    "ddim": ddim_step,
}
FLOW_ONLY_KINDS = frozenset({"flow_sde", "dance_sde", "cps", "ode", "dpm2"})
ODE_SOLVERS = ("ode", "dpm2")


def is_deterministic(kind: str, noise_level: float) -> bool:
    """True when step ``kind`` at ``noise_level`` draws no noise (no log-prob to train on)."""
    get_step(kind)
    return kind in ("ode", "dpm2") or (kind == "ddim" and noise_level == 0)


def get_step(kind: str) -> Callable[..., StepOutput]:
    """The step function registered as ``kind``; a clear error lists the known kinds."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown sampler step kind {kind!r}; known kinds: {sorted(STEP_KINDS)}")
    return STEP_KINDS[kind]


def run_step(
    kind: str,
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    prediction_type: str = "flow",
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
    history: tuple[torch.Tensor, torch.Tensor] | None = None,
    clip_sample: float | None = None,
) -> StepOutput:
    """Call step ``kind`` with the extras it takes (``prediction_type`` and ``clip_sample`` for ddim,
    ``history`` for dpm2).

    Raises:
        ValueError: a flow-only kind on an epsilon-prediction model (use ``ddim``).
    """
    fn = get_step(kind)
    if kind in FLOW_ONLY_KINDS and prediction_type != "flow":
        raise ValueError(
            f"step kind {kind!r} needs a flow-matching (velocity) model, this model predicts {prediction_type!r}; "
            "use sampler.kind=ddim"
        )
    extra = {}
    if kind == "ddim":
        extra.update(prediction_type=prediction_type, clip_sample=clip_sample)
    elif kind == "dpm2":
        extra["history"] = history
    return fn(model_output, sample, sigma, sigma_next, noise_level=noise_level, generator=generator, prev_sample=prev_sample, **extra)
