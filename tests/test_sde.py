"""Tests for diffrl.sampling.sde: step formulas against closed forms, marginal preservation, RNG contract."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.sampling.sde import (
    STEP_KINDS,
    flow_sde_step,
    gaussian_log_prob,
    get_step,
    is_deterministic,
    ode_step,
    randn_per_sample,
)

B, C, H, W = 3, 2, 4, 4


pytestmark = pytest.mark.usefixtures("single_thread")


def _inputs(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, C, H, W, generator=g).to(dtype)
    x = torch.randn(B, C, H, W, generator=g).to(dtype)
    return v, x


def _hand_flow_grpo(v, x, sigma, sigma_next, noise_level, sigma_max=None):
    """Flow-GRPO (sd3_sde_with_logprob) computed per sample in float64 from python scalars.

    ``sigma``/``sigma_next`` are lists of length B. At sigma == 1 the denominator uses ``sigma_max``
    (the next sigma of the schedule).
    """
    v = v.double()
    x = x.double()
    means, stds = [], []
    for b in range(x.shape[0]):
        s, sn = float(sigma[b]), float(sigma_next[b])
        dt = sn - s
        denom = 1.0 - (sigma_max if s == 1.0 else s)
        std_t = math.sqrt(s / denom) * noise_level
        m = x[b] * (1 + std_t**2 / (2 * s) * dt) + v[b] * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        means.append(m)
        stds.append(std_t * math.sqrt(-dt))
    return torch.stack(means), torch.tensor(stds, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# flow_sde_step: mean / std / log_prob against hand computation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sigma,sigma_next,noise_level",
    [
        (0.8, 0.75, 0.7),
        (0.5, 0.3, 1.0),
        (0.1, 0.0, 0.3),
    ],
)
def test_flow_sde_mean_std_scalar_sigma(sigma, sigma_next, noise_level):
    v, x = _inputs(1)
    g = torch.Generator().manual_seed(0)
    out = flow_sde_step(v, x, sigma, sigma_next, noise_level=noise_level, generator=g)
    m_ref, s_ref = _hand_flow_grpo(v, x, [sigma] * B, [sigma_next] * B, noise_level)
    torch.testing.assert_close(out.mean.double(), m_ref, rtol=1e-5, atol=1e-6)
    assert out.std.shape == out.mean.shape
    torch.testing.assert_close(out.std.double(), s_ref.view(B, 1, 1, 1).expand_as(m_ref), rtol=1e-5, atol=1e-7)


def test_flow_sde_rejects_zero_noise_level():
    """A zero noise level has no density (log-prob would be NaN): the error points to the ODE step."""
    v, x = _inputs(1)
    with pytest.raises(ValueError, match="noise_level > 0.*ode"):
        flow_sde_step(v, x, 0.95, 0.9, noise_level=0.0)


def test_flow_sde_mean_std_per_sample_sigma():
    v, x = _inputs(2)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.85, 0.3, 0.05])
    out = flow_sde_step(v, x, sigma, sigma_next, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    m_ref, s_ref = _hand_flow_grpo(v, x, sigma.tolist(), sigma_next.tolist(), 0.7)
    torch.testing.assert_close(out.mean.double(), m_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.std[:, 0, 0, 0].double(), s_ref, rtol=1e-5, atol=1e-7)
    # each row must use its own sigma: row b equals the scalar-sigma call on row b
    for b in range(B):
        single = flow_sde_step(v[b : b + 1], x[b : b + 1], float(sigma[b]), float(sigma_next[b]), noise_level=0.7)
        torch.testing.assert_close(out.mean[b : b + 1], single.mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.std[b : b + 1], single.std, rtol=1e-6, atol=1e-7)


def test_flow_sde_std_closed_form_values():
    # sigma=0.5, sigma_next=0.3, a=1: std_t = sqrt(0.5/0.5) = 1, std = sqrt(0.2)
    v, x = _inputs(3)
    out = flow_sde_step(v, x, 0.5, 0.3, noise_level=1.0)
    torch.testing.assert_close(out.std, torch.full_like(out.mean, math.sqrt(0.2)), rtol=1e-6, atol=0)
    # mean = x*(1 + 1/(2*0.5)*(-0.2)) + v*(1 + 0.5/(2*0.5))*(-0.2) = 0.8x - 0.3v
    torch.testing.assert_close(out.mean, 0.8 * x - 0.3 * v, rtol=1e-5, atol=1e-6)


def test_flow_sde_log_prob_matches_torch_normal():
    v, x = _inputs(4)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    sigma_next = torch.tensor([0.8, 0.55, 0.1])
    out = flow_sde_step(v, x, sigma, sigma_next, noise_level=0.8, generator=torch.Generator().manual_seed(5))
    ref = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    assert out.log_prob.shape == (B,)
    torch.testing.assert_close(out.log_prob, ref, rtol=1e-6, atol=1e-6)
    # gaussian_log_prob directly, with std given broadcastable [B,1,1,1]
    std_b = out.std[:, :1, :1, :1]
    torch.testing.assert_close(gaussian_log_prob(out.prev_sample, out.mean, std_b), ref, rtol=1e-6, atol=1e-6)


def test_flow_sde_sampled_noise_is_mean_plus_std_times_randn():
    v, x = _inputs(5)
    out = flow_sde_step(v, x, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(11))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(out.prev_sample, out.mean + out.std * noise, rtol=1e-6, atol=1e-6)


def test_flow_sde_scores_given_prev_sample():
    v, x = _inputs(6)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(42))
    out = flow_sde_step(v, x, 0.7, 0.6, noise_level=0.7, prev_sample=target)
    assert out.prev_sample is target
    m_ref, s_ref = _hand_flow_grpo(v, x, [0.7] * B, [0.6] * B, 0.7)
    ref = torch.distributions.Normal(m_ref, s_ref.view(B, 1, 1, 1).expand_as(m_ref)).log_prob(target.double())
    torch.testing.assert_close(out.log_prob.double(), ref.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-5)
    # scoring the step's own draw gives the same log_prob as the drawing call
    drawn = flow_sde_step(v, x, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    rescored = flow_sde_step(v, x, 0.7, 0.6, noise_level=0.7, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(rescored.log_prob, drawn.log_prob, rtol=0, atol=0)


def test_flow_sde_log_prob_differentiable_wrt_model_output():
    v, x = _inputs(7)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    v = v.clone().requires_grad_(True)
    out = flow_sde_step(v, x, 0.5, 0.3, noise_level=1.0, prev_sample=target)
    out.log_prob.sum().backward()
    # mean = 0.8x - 0.3v, std^2 = 0.2 -> d/dv [-(t-mean)^2/(2*0.2)] = (t-mean)*(-0.3)/0.2, averaged over D
    D = C * H * W
    expected = (target - (0.8 * x - 0.3 * v.detach())) * (-0.3) / 0.2 / D
    torch.testing.assert_close(v.grad, expected, rtol=1e-4, atol=1e-6)


def test_flow_sde_sigma_one_uses_next_sigma_in_denominator():
    v, x = _inputs(8)
    sigma = torch.tensor([1.0, 1.0, 0.5])
    sigma_next = torch.tensor([0.96, 0.9, 0.4])
    out = flow_sde_step(v, x, sigma, sigma_next, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.std).all() and torch.isfinite(out.log_prob).all()
    # row 0: std_t = 0.7*sqrt(1/0.04) = 3.5, std = 3.5*sqrt(0.04) = 0.7
    # row 1: std_t = 0.7*sqrt(1/0.1), std = std_t*sqrt(0.1) = 0.7
    # row 2: std_t = 0.7*sqrt(0.5/0.5) = 0.7, std = 0.7*sqrt(0.1)
    expected_std = torch.tensor([0.7, 0.7, 0.7 * math.sqrt(0.1)])
    torch.testing.assert_close(out.std[:, 0, 0, 0], expected_std, rtol=1e-5, atol=1e-7)
    for b in range(B):
        s, sn = float(sigma[b]), float(sigma_next[b])
        m_ref, _ = _hand_flow_grpo(v[b : b + 1], x[b : b + 1], [s], [sn], 0.7, sigma_max=sn)
        torch.testing.assert_close(out.mean[b : b + 1].double(), m_ref, rtol=1e-5, atol=1e-5)
    # at sigma=1 the (1 - sigma) factor kills the extra v term: mean = x*(1 + std_t^2/2*dt) + v*dt
    std_t2 = 0.7**2 / 0.04
    torch.testing.assert_close(out.mean[0], x[0] * (1 + std_t2 / 2 * -0.04) + v[0] * -0.04, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "sigma,sigma_next",
    [(0.5, 0.5), (0.5, 0.6), (torch.tensor([0.9, 0.5, 0.3]), torch.tensor([0.8, 0.5, 0.2]))],
)
def test_flow_sde_rejects_non_decreasing_sigma(sigma, sigma_next):
    v, x = _inputs(9)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        flow_sde_step(v, x, sigma, sigma_next, noise_level=0.7)


def test_flow_sde_fp32_math_for_bf16_inputs():
    v32, x32 = _inputs(10)
    v, x = v32.bfloat16(), x32.bfloat16()
    out = flow_sde_step(v, x, 0.6, 0.5, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert out.mean.dtype == torch.float32
    assert out.std.dtype == torch.float32
    assert out.log_prob.dtype == torch.float32
    assert out.prev_sample.dtype == torch.bfloat16
    # the mean is computed from the upcast bf16 values in fp32 (not rounded to bf16)
    ref = flow_sde_step(v.float(), x.float(), 0.6, 0.5, noise_level=0.7)
    torch.testing.assert_close(out.mean, ref.mean, rtol=0, atol=0)
    # log_prob scores the bf16 sample that was returned
    lp = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample.float()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, lp, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Marginal preservation on a Gaussian toy problem with the exact velocity field
# --------------------------------------------------------------------------------------------

M, S = 0.5, 0.3


def _exact_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    a = 1.0 - sigma
    var_x = a * a * S * S + sigma * sigma
    e_x0 = M + a * S * S * (x - a * M) / var_x
    e_eps = sigma * (x - a * M) / var_x
    return e_eps - e_x0


@pytest.mark.parametrize("kind,noise_level", [("flow_sde", 0.3), ("flow_sde", 0.7), ("flow_sde", 1.0), ("ode", 0.0)])
def test_marginal_preserved_to_data_distribution(kind, noise_level):
    step = get_step(kind)
    n, n_steps, sigma0 = 20000, 300, 0.9
    g = torch.Generator().manual_seed(1234)
    a = 1.0 - sigma0
    var0 = a * a * S * S + sigma0 * sigma0
    x = a * M + math.sqrt(var0) * torch.randn(n, 1, generator=g)
    sigmas = torch.linspace(sigma0, 0.0, n_steps + 1).tolist()
    for s, sn in zip(sigmas[:-1], sigmas[1:]):
        v = _exact_velocity(x, s)
        x = step(v, x, s, sn, noise_level=noise_level, generator=g).prev_sample
    mean, var = x.mean().item(), x.var(unbiased=False).item()
    assert abs(mean - M) < 0.02, (kind, noise_level, mean)
    assert abs(var - S * S) < 0.05 * S * S, (kind, noise_level, var, S * S)


# --------------------------------------------------------------------------------------------
# ode_step
# --------------------------------------------------------------------------------------------


def test_ode_step_is_exact_euler():
    v, x = _inputs(11)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    sigma_next = torch.tensor([0.8, 0.25, 0.0])
    out = ode_step(v, x, sigma, sigma_next, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    expected = x + (sigma_next - sigma).view(B, 1, 1, 1) * v
    assert torch.equal(out.prev_sample, expected)
    assert torch.equal(out.mean, expected)
    assert torch.equal(out.std, torch.zeros_like(expected))
    assert torch.equal(out.log_prob, torch.zeros(B))
    # scalar sigmas
    out2 = ode_step(v, x, 0.5, 0.4)
    torch.testing.assert_close(out2.prev_sample, x - 0.1 * v, rtol=1e-6, atol=1e-6)


def test_ode_step_keeps_dtype_and_given_prev_sample():
    v, x = _inputs(12)
    out = ode_step(v.bfloat16(), x.bfloat16(), 0.5, 0.4)
    assert out.prev_sample.dtype == torch.bfloat16
    assert out.mean.dtype == torch.float32
    torch.testing.assert_close(out.mean, x.bfloat16().float() - 0.1 * v.bfloat16().float(), rtol=1e-6, atol=1e-6)
    given = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    out2 = ode_step(v, x, 0.5, 0.4, prev_sample=given)
    assert out2.prev_sample is given
    assert torch.equal(out2.log_prob, torch.zeros(B))


# --------------------------------------------------------------------------------------------
# randn_per_sample
# --------------------------------------------------------------------------------------------


def test_randn_per_sample_rows_match_fresh_generators():
    seeds = [7, 123, 99999]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    noise = randn_per_sample((3, 2, 5), gens, device="cpu")
    assert noise.shape == (3, 2, 5) and noise.dtype == torch.float32
    for b, s in enumerate(seeds):
        ref = torch.randn((2, 5), generator=torch.Generator().manual_seed(s))
        assert torch.equal(noise[b], ref)


def test_randn_per_sample_batch_invariance():
    small = randn_per_sample((2, 4), [torch.Generator().manual_seed(s) for s in (5, 6)], device="cpu")
    big = randn_per_sample((4, 4), [torch.Generator().manual_seed(s) for s in (1, 5, 2, 6)], device="cpu")
    assert torch.equal(small[0], big[1])
    assert torch.equal(small[1], big[3])
    assert not torch.equal(big[0], big[1])


def test_randn_per_sample_single_generator_and_wrong_length():
    one = randn_per_sample((2, 3), torch.Generator().manual_seed(4), device="cpu")
    assert torch.equal(one, torch.randn((2, 3), generator=torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        randn_per_sample((3, 4), [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)], device="cpu")


def test_flow_sde_per_sample_generators_batch_invariant():
    v, x = _inputs(13)
    full = flow_sde_step(v, x, 0.6, 0.5, noise_level=0.7, generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    part = flow_sde_step(v[1:], x[1:], 0.6, 0.5, noise_level=0.7, generator=[torch.Generator().manual_seed(s) for s in (2, 3)])
    torch.testing.assert_close(full.prev_sample[1:], part.prev_sample, rtol=0, atol=0)
    torch.testing.assert_close(full.log_prob[1:], part.log_prob, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_get_step_registry():
    assert get_step("flow_sde") is flow_sde_step
    assert get_step("ode") is ode_step
    assert set(STEP_KINDS) == {"flow_sde", "dance_sde", "cps", "ode", "dpm2", "ddim"}
    assert [k for k in sorted(STEP_KINDS) if is_deterministic(k, 0.7)] == ["dpm2", "ode"]
    with pytest.raises(ValueError, match="no_such_kind"):
        get_step("no_such_kind")
