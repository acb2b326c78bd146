"""DDIM (epsilon and flow parameterisations) and the DPM-Solver++(2M) ODE solver against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.losses import gaussian_kl_same_std
from diffrl.sampling.sde import ddim_step, dpm2_step, flow_sde_step, is_deterministic, ode_step, run_step

pytestmark = pytest.mark.usefixtures("single_thread")

M, S = 0.5, 0.3


def _ddpm_sigmas() -> torch.Tensor:
    """σ_t = √(1 − ᾱ_t) of the DDPM linear-β schedule (β from 1e-4 to 0.02 over 1000 steps), t = 0…999."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    return torch.sqrt(1 - torch.cumprod(1 - betas, 0))


def _vp_eps(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Exact E[ε | x] for x0 ~ N(M, S²) and x = √(1−σ²)·x0 + σ·ε."""
    a = math.sqrt(1 - sigma**2)
    return sigma * (x - a * M) / (a * a * S * S + sigma**2)


def _flow_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    a = 1 - sigma
    var = a * a * S * S + sigma * sigma
    return sigma * (x - a * M) / var - (M + a * S * S * (x - a * M) / var)


def _flow_ode_exact(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """The flow ODE maps x_σ to x_0 monotonically: the standardised value is conserved (1-D Gaussian)."""
    a = 1 - sigma
    return M + S * (x - a * M) / math.sqrt(a * a * S * S + sigma * sigma)


# --------------------------------------------------------------------------------------------
# DDIM
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_reaches_the_data_marginal_on_the_ddpm_schedule(eta):
    sig = _ddpm_sigmas()
    t_start = int((sig <= 0.9).nonzero().max())
    sigmas = sig[: t_start + 1].flip(0).tolist() + [0.0]  # every DDPM step from σ = 0.9 (t = 402) to 0
    g = torch.Generator().manual_seed(7)
    s0 = sigmas[0]
    x = math.sqrt(1 - s0**2) * M + math.sqrt((1 - s0**2) * S * S + s0**2) * torch.randn(20000, 1, generator=g, dtype=torch.float64).float()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        x = ddim_step(_vp_eps(x, s), x, s, s_next, noise_level=eta, generator=g).prev_sample
    assert abs(x.mean().item() - M) < 0.02
    assert abs(x.var(unbiased=False).item() / (S * S) - 1) < 0.05


def test_ddim_eta_zero_is_deterministic_and_eta_one_is_the_ddpm_posterior():
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    abar_t, abar_prev = 0.3, 0.45
    s, s_next = math.sqrt(1 - abar_t), math.sqrt(1 - abar_prev)
    out0 = ddim_step(eps, x, s, s_next, noise_level=0.0, generator=g)
    again = ddim_step(eps, x, s, s_next, noise_level=0.0, generator=torch.Generator().manual_seed(99))
    assert torch.equal(out0.prev_sample, again.prev_sample)
    assert torch.equal(out0.std, torch.zeros_like(x)) and torch.equal(out0.log_prob, torch.zeros(4))
    x0 = (x - math.sqrt(1 - abar_t) * eps) / math.sqrt(abar_t)
    torch.testing.assert_close(out0.prev_sample, math.sqrt(abar_prev) * x0 + math.sqrt(1 - abar_prev) * eps)
    assert is_deterministic("ddim", 0.0) and not is_deterministic("ddim", 1.0)

    out1 = ddim_step(eps, x, s, s_next, noise_level=1.0, generator=g)
    beta_t = 1 - abar_t / abar_prev
    posterior_var = (1 - abar_prev) / (1 - abar_t) * beta_t
    torch.testing.assert_close(out1.std, torch.full_like(x, math.sqrt(posterior_var)))
    # the DDPM posterior mean μ̃(x_t, x̂0) = √ᾱ_prev β_t/(1−ᾱ_t)·x̂0 + √(1−β_t)(1−ᾱ_prev)/(1−ᾱ_t)·x_t
    mu = math.sqrt(abar_prev) * beta_t / (1 - abar_t) * x0 + math.sqrt(1 - beta_t) * (1 - abar_prev) / (1 - abar_t) * x
    torch.testing.assert_close(out1.mean, mu, rtol=1e-5, atol=1e-5)


def test_ddim_log_prob_matches_torch_normal_and_scores_its_own_draw():
    g = torch.Generator().manual_seed(1)
    x, eps = torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 5, generator=g)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    sigma_next = torch.tensor([0.8, 0.5, 0.1])
    out = ddim_step(eps, x, sigma, sigma_next, noise_level=1.0, generator=g)
    ref = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob, ref, rtol=1e-6, atol=1e-6)
    rescored = ddim_step(eps, x, sigma, sigma_next, noise_level=1.0, prev_sample=out.prev_sample)
    assert torch.equal(rescored.log_prob, out.log_prob)


def test_ddim_on_a_flow_model_at_eta_zero_is_the_euler_step():
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    out = ddim_step(v, x, 0.7, 0.55, noise_level=0.0, prediction_type="flow")
    torch.testing.assert_close(out.prev_sample, ode_step(v, x, 0.7, 0.55).prev_sample, rtol=1e-6, atol=1e-6)
    last = ddim_step(v, x, 0.2, 0.0, noise_level=1.0, prediction_type="flow", generator=g)
    torch.testing.assert_close(last.prev_sample, x - 0.2 * v)  # σ_next = 0: lands on x̂0, scores 0
    assert torch.equal(last.log_prob, torch.zeros(3))


def test_ddim_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="η"):
        ddim_step(x, x, 0.5, 0.4, noise_level=-1.0)
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_step(x, x, 0.5, 0.4, noise_level=1.0, prediction_type="sample")
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        ddim_step(x, x, 0.4, 0.5, noise_level=1.0)
    with pytest.raises(ValueError, match="use sampler.kind=ddim"):
        run_step("flow_sde", x, x, 0.5, 0.4, noise_level=0.7, prediction_type="epsilon")


# --------------------------------------------------------------------------------------------
# ODE solvers: Euler convergence, DPM-Solver++(2M) more accurate
# --------------------------------------------------------------------------------------------


def _solve(kind: str, n_steps: int) -> float:
    """Max error at σ = 0 of solving the flow ODE from σ = 0.9 with the exact Gaussian velocity."""
    x = torch.linspace(-2.5, 2.5, 101, dtype=torch.float64).unsqueeze(1)
    exact = _flow_ode_exact(x, 0.9)
    sigmas = torch.linspace(0.9, 0.0, n_steps + 1).tolist()
    history = None
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        out = run_step(kind, _flow_velocity(x, s), x, s, s_next, noise_level=0.0, history=history)
        x = out.prev_sample
        history = (out.x0, s) if out.x0 is not None else None
    return (x - exact).abs().max().item()


def test_euler_converges_at_first_order_and_dpm2_is_more_accurate():
    euler = {n: _solve("ode", n) for n in (5, 10, 20, 40)}
    dpm2 = {n: _solve("dpm2", n) for n in (5, 10, 20, 40)}
    for n in (5, 10, 20):
        assert euler[2 * n] < euler[n]
        assert 1.6 < euler[n] / euler[2 * n] < 2.6  # first order: halving dt halves the error
    assert dpm2[5] < euler[5]
    for n in (10, 20, 40):  # measured: 0.033 vs 0.136, 0.0084 vs 0.071, 0.0065 vs 0.036
        assert dpm2[n] < 0.25 * euler[n]


def test_dpm2_without_history_is_the_euler_step():
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    out = dpm2_step(v, x, torch.tensor([0.8, 0.6]), torch.tensor([0.7, 0.4]))
    torch.testing.assert_close(out.prev_sample, ode_step(v, x, torch.tensor([0.8, 0.6]), torch.tensor([0.7, 0.4])).prev_sample)
    torch.testing.assert_close(out.x0, x - torch.tensor([0.8, 0.6]).view(2, 1, 1) * v)
    assert is_deterministic("dpm2", 0.0) and is_deterministic("ode", 0.7)


# --------------------------------------------------------------------------------------------
# KL between two SDE steps
# --------------------------------------------------------------------------------------------


def test_kl_between_two_flow_sde_steps_closed_form():
    g = torch.Generator().manual_seed(4)
    x, v1, v2 = (torch.randn(3, 2, 4, generator=g) for _ in range(3))
    sigma, sigma_next, a = 0.6, 0.5, 0.7
    p = flow_sde_step(v1, x, sigma, sigma_next, noise_level=a, generator=g)
    q = flow_sde_step(v2, x, sigma, sigma_next, noise_level=a, prev_sample=p.prev_sample)
    kl_torch = torch.distributions.kl_divergence(torch.distributions.Normal(p.mean, p.std), torch.distributions.Normal(q.mean, q.std)).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_kl_same_std(p.mean, q.mean, p.std), kl_torch, rtol=1e-5, atol=1e-7)
    # the means differ only through v: Δmean = dt·(1 + σ_t²(1 − σ)/(2σ))·Δv, std² = σ_t²·(−dt)
    dt = sigma_next - sigma
    std_t2 = a * a * sigma / (1 - sigma)
    coef = dt * (1 + std_t2 * (1 - sigma) / (2 * sigma))
    closed = (coef**2 * (v1 - v2) ** 2 / (2 * std_t2 * -dt)).mean(dim=(1, 2))
    torch.testing.assert_close(kl_torch, closed, rtol=1e-5, atol=1e-7)
