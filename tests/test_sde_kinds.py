"""DanceGRPO's SDE and coefficient-preserving sampling (CPS) against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from diffrl.sampling.sde import cps_step, dance_sde_step, get_step
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")


def _gaussian_field(m: float, s: float):
    """Exact velocity E[ε − x0 | x_σ = x] for x0 ~ N(m, s²) on the path x = (1 − σ)x0 + σε."""

    def v(x, sigma):
        a = 1 - sigma
        var = a**2 * s**2 + sigma**2
        x0 = m + a * s**2 * (x - a * m) / var
        eps = sigma * (x - a * m) / var
        return eps - x0

    return v


def test_dance_sde_mean_std_and_log_prob_hand_values():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next, eta = 0.6, 0.45, 0.5
    out = dance_sde_step(v, x, sigma, sigma_next, noise_level=eta, generator=g)
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    dt = sigma_next - sigma
    torch.testing.assert_close(out.mean, x + dt * v - 0.5 * eta**2 * score * dt)
    torch.testing.assert_close(out.std, torch.full_like(x, eta * math.sqrt(-dt)))
    ref = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="noise_level > 0"):
        dance_sde_step(v, x, sigma, sigma_next, noise_level=0.0)


@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_dance_sde_preserves_the_data_marginal(eta):
    m, s, n, steps = 0.5, 0.3, 20000, 300
    field = _gaussian_field(m, s)
    g = torch.Generator().manual_seed(1)
    sigma0 = 0.9
    x = (1 - sigma0) * m + math.sqrt((1 - sigma0) ** 2 * s**2 + sigma0**2) * torch.randn(n, 1, generator=g)
    sigmas = torch.linspace(sigma0, 0.0, steps + 1).tolist()
    for sig, sig_next in zip(sigmas[:-1], sigmas[1:]):
        x = dance_sde_step(field(x, sig), x, sig, sig_next, noise_level=eta, generator=g).prev_sample
    assert abs(x.mean().item() - m) < 0.02
    assert abs(x.var().item() / s**2 - 1) < 0.05


def test_cps_coefficient_identities():
    """With the exact (x0, ε) the next state is (1 − σ_next)·x0 + √(σ_next² − std²)·ε + std·z:
    x0's coefficient is preserved and the noise variance is σ_next²."""
    g = torch.Generator().manual_seed(2)
    x0, eps = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    sigma, sigma_next, a = 0.7, 0.5, 0.6
    x = (1 - sigma) * x0 + sigma * eps
    out = cps_step(eps - x0, x, sigma, sigma_next, noise_level=a, generator=g)
    std = sigma_next * math.sin(a * math.pi / 2)
    torch.testing.assert_close(out.std, torch.full_like(x, std))
    keep = math.sqrt(sigma_next**2 - std**2)
    torch.testing.assert_close(out.mean, (1 - sigma_next) * x0 + keep * eps, rtol=1e-5, atol=1e-5)
    assert keep**2 + std**2 == pytest.approx(sigma_next**2)
    z = (out.prev_sample - out.mean) / std
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05
    # unnormalised log-prob: minus the mean squared deviation, no variance, no constant
    target = out.mean + 0.1
    scored = cps_step(eps - x0, x, sigma, sigma_next, noise_level=a, prev_sample=target)
    torch.testing.assert_close(scored.log_prob, torch.full((4,), -0.01), rtol=1e-4, atol=1e-6)
    # σ_next = 0: deterministic, lands on x̂0
    last = cps_step(eps - x0, x, sigma, 0.0, noise_level=a, generator=g)
    torch.testing.assert_close(last.prev_sample, x0, rtol=1e-5, atol=1e-5)
    assert torch.equal(last.log_prob, torch.zeros(4))


@pytest.mark.parametrize("kind", ["dance_sde", "cps"])
def test_new_kinds_keep_rollout_training_parity(kind):
    from pipelines.digits import DigitsAdapter

    adapter = DigitsAdapter(path=None, seed=0)
    settings = SamplerConfig(num_steps=3, kind=kind, noise_level=0.5)
    engine = make_engine(adapter, settings, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module)
    td = sample_trajectories(adapter, ["a red seven"] * 2 + ["a blue two"] * 2, settings=settings, seeds=[1, 2, 3, 4])
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    assert get_step(kind) in (dance_sde_step, cps_step)
