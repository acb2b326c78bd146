"""AWM (diffrl.algorithms.awm): its advantage-weighted flow-matching loss against hand computations, its
gradient direction, its zero-advantage invariance and the closed form of its anchor terms; its config keys
through the registry; and a short run of the digits_awm recipe raising gold accuracy. (Gradient-accumulation
invariance of its objective: tests/test_algorithms.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fidelity_gain, short_recipe_run

from diffrl.algorithms.awm_loss import AWM_WEIGHTINGS, awm_loss
from diffrl.recipes import ConfigError, compose
from diffrl.tools.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

# Two samples, two dims each.
#   sample 0: v = (1, 2), v* = (0, 0) -> e0 = (1 + 4)/2 = 2.5
#   sample 1: v = (0, 0), v* = (1, 1) -> e1 = (1 + 1)/2 = 1.0
V = [[1.0, 2.0], [0.0, 0.0]]
T = [[0.0, 0.0], [1.0, 1.0]]
E = (2.5, 1.0)
SIGMA = [0.5, 0.25]
ADV = [1.0, -2.0]
D4 = 1e-10**0.25  # δ^p of ghuber with p = 0.25


def _call(adv=ADV, **kw):
    v = torch.tensor(V, requires_grad=True)
    loss, metrics = awm_loss(v, torch.tensor(T), torch.tensor(adv), sigma=torch.tensor(SIGMA), **kw)
    return v, loss, metrics


@pytest.mark.parametrize(
    "weighting, expected",
    [
        ("uniform", (1 * 2.5 - 2 * 1.0) / 2),  # 0.25
        ("sigma", (0.5 * 2.5 - 2 * 0.25 * 1.0) / 2),  # 0.375
        ("sigma2", (0.25 * 2.5 - 2 * 0.0625 * 1.0) / 2),  # 0.25
        ("huber", ((math.sqrt(2.5) - 1e-5) * 0.5 - 2 * (math.sqrt(1.0) - 1e-5) * 0.25) / 2),
        ("ghuber", ((2.5**0.25 - D4) * 0.5 / 0.25 - 2 * (1.0 - D4) * 0.25 / 0.25) / 2),
    ],
)
def test_hand_computation(weighting, expected):
    _, loss, m = _call(weighting=weighting)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["policy_loss"] == pytest.approx(expected, rel=1e-5)
    assert m["awm_err_mean"] == pytest.approx((2.5 + 1.0) / 2)
    assert m["err_pos"] == pytest.approx(2.5) and m["err_neg"] == pytest.approx(1.0)
    assert m["adv_mean"] == pytest.approx(-0.5) and m["adv_abs_mean"] == pytest.approx(1.5)
    assert m["kl"] == 0.0 and m["ema_kl"] == 0.0
    assert all(isinstance(x, float) for x in m.values())


def test_uniform_gradient_closed_form():
    # ∂L/∂v_i = A_i/B · 2(v_i − v*_i)/D  with B = D = 2.
    v, loss, _ = _call()
    loss.backward()
    expected = torch.tensor([[1 / 2 * (2 * 1) / 2, 1 / 2 * (2 * 2) / 2], [-2 / 2 * (2 * -1) / 2, -2 / 2 * (2 * -1) / 2]])
    torch.testing.assert_close(v.grad, expected)


def test_advantage_clipping():
    # c = 5: A = (10, −2.5) -> clip (5, −2.5) / 5 = (1, −0.5); L = (2.5 − 0.5·1)/2 = 1.0
    _, loss, m = _call(adv=[10.0, -2.5], adv_clip_max=5.0)
    assert loss.item() == pytest.approx(1.0)
    assert m["adv_mean"] == pytest.approx(0.25)


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_gradient_direction(weighting):
    """A gradient step moves a positive-advantage sample toward its target and a negative one away."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 3, 5, generator=g)
    v0 = target + torch.randn(4, 3, 5, generator=g)
    adv = torch.tensor([1.0, 0.5, -1.0, -0.5])
    v = v0.clone().requires_grad_(True)
    loss, _ = awm_loss(v, target, adv, sigma=torch.tensor([0.9, 0.6, 0.4, 0.2]), weighting=weighting)
    loss.backward()
    stepped = v0 - 1e-2 * v.grad
    before = ((v0 - target) ** 2).mean(dim=(1, 2))
    after = ((stepped - target) ** 2).mean(dim=(1, 2))
    assert bool((after[:2] < before[:2]).all()), (before, after)
    assert bool((after[2:] > before[2:]).all()), (before, after)
    # the gradient of each row is along ±(v − v*): positive rows along +(v − v*), negative along −(v − v*)
    cos = torch.nn.functional.cosine_similarity(v.grad.flatten(1), (v0 - target).flatten(1), dim=1)
    torch.testing.assert_close(cos, torch.tensor([1.0, 1.0, -1.0, -1.0]))


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
def test_zero_advantages_give_zero_loss_and_grad(weighting):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    loss, m = awm_loss(v, torch.randn(3, 2, 4, generator=g), torch.zeros(3), sigma=0.7, weighting=weighting)
    loss.backward()
    assert loss.item() == 0.0 and m["policy_loss"] == 0.0
    assert torch.equal(v.grad, torch.zeros_like(v))
    assert math.isnan(m["err_pos"]) and math.isnan(m["err_neg"])


def test_kl_and_ema_terms_closed_form():
    g = torch.Generator().manual_seed(2)
    x0, eps = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    target = eps - x0
    v0 = torch.randn(3, 4, 2, generator=g)
    v_ref, v_ema = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    adv = torch.tensor([0.3, -1.2, 0.9])
    beta, ema_beta = 0.003, 1.0
    v = v0.clone().requires_grad_(True)
    loss, m = awm_loss(v, target, adv, sigma=0.5, kl_beta=beta, v_ref=v_ref, ema_beta=ema_beta, v_ema=v_ema)
    loss.backward()
    kl = ((v0 - v_ref) ** 2).mean()
    ema_kl = ((v0 - v_ema) ** 2).mean()
    policy = (adv * ((v0 - target) ** 2).mean(dim=(1, 2))).mean()
    assert m["kl"] == pytest.approx(kl.item(), rel=1e-6)
    assert m["ema_kl"] == pytest.approx(ema_kl.item(), rel=1e-6)
    assert loss.item() == pytest.approx((policy + beta * kl + ema_beta * ema_kl).item(), rel=1e-6)
    n = v0.numel()  # mean over B and dims: ∂/∂v of β·mean (v − v_ref)² is 2β(v − v_ref)/N
    expected = (
        adv.view(-1, 1, 1) * 2 * (v0 - target) / n
        + 2 * beta * (v0 - v_ref) / n
        + 2 * ema_beta * (v0 - v_ema) / n
    )
    torch.testing.assert_close(v.grad, expected)


def test_kl_alone_pulls_toward_reference_with_zero_advantages():
    v_ref = torch.zeros(2, 3)
    v = torch.ones(2, 3, requires_grad=True)
    loss, m = awm_loss(v, torch.randn(2, 3), torch.zeros(2), sigma=0.3, kl_beta=0.5, v_ref=v_ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.0) and m["kl"] == pytest.approx(1.0)
    torch.testing.assert_close(v.grad, torch.full((2, 3), 2 * 0.5 / 6))


def test_fp32_math_from_bf16_inputs_and_exact_target():
    x0 = torch.randn(2, 4, dtype=torch.bfloat16)
    eps = torch.randn(2, 4, dtype=torch.bfloat16)
    target = eps - x0
    loss, m = awm_loss(target.clone(), target, torch.tensor([1.0, -1.0]), sigma=torch.tensor([0.2, 0.8]))
    assert loss.dtype == torch.float32 and loss.item() == 0.0 and m["awm_err_mean"] == 0.0


def test_bad_input():
    v, t, a = torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="weighting"):
        awm_loss(v, t, a, sigma=0.5, weighting="bogus")
    with pytest.raises(ValueError, match="v_ref"):
        awm_loss(v, t, a, sigma=0.5, kl_beta=0.1)
    with pytest.raises(ValueError, match="v_ema"):
        awm_loss(v, t, a, sigma=0.5, ema_beta=0.1)
    with pytest.raises(ValueError, match="sigma"):
        awm_loss(v, t, a, sigma=torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="sigma"):
        awm_loss(v, t, a, sigma=torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match="advantages"):
        awm_loss(v, t, torch.zeros(3), sigma=0.5)
    with pytest.raises(ValueError, match="target"):
        awm_loss(v, torch.zeros(2, 4), a, sigma=0.5)
    with pytest.raises(ValueError, match="adv_clip_max"):
        awm_loss(v, t, a, sigma=0.5, adv_clip_max=0.0)


def test_awm_keys_come_from_its_own_config():
    cfg = compose(["experiment=digits_awm", "algorithm.awm_num_timesteps=2"])
    assert cfg.algorithm.trainer == "awm" and cfg.algorithm.awm_weighting == "ghuber" and cfg.algorithm.awm_num_timesteps == 2
    with pytest.raises(ConfigError, match="awm_num_timestep"):
        compose(["experiment=digits_awm", "algorithm.awm_num_timestep=2"])


def test_bad_awm_values_stop_before_any_work(tmp_path, capsys):
    assert main(["train", "experiment=digits_awm", "algorithm.awm_weighting=cubic", f"trainer.output_dir={tmp_path / 'r'}"]) == 2
    assert "algorithm.awm_weighting" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.recipe(seconds=115)
def test_digits_awm_raises_fidelity_in_a_short_run(tmp_path):
    """60 steps of the recipe (of its 150): the fidelity headline on the 60 prompts × 2 held-out seeds rises by ≥ 5 points
    (60 × 1 seed, 2026-12-06: +13.3 fidelity, +25 gold; the whole recipe: +55.8 gold and +47.1 fidelity points, RESULTS.md)."""
    out = tmp_path / "awm"
    summary = short_recipe_run(out, "digits_awm", 60)
    assert fidelity_gain(summary) >= 0.05, summary
    assert summary["reward_after"] > summary["reward_before"]


@pytest.mark.recipe(seconds=64)
def test_a_run_that_hacks_the_reward_fails_the_learning_test(tmp_path):
    """Without the KL to the reference at lr 1e-3 (the recipe until 2026-12-05) the run hacks the reward: raw gold rises as
    much as the shipped recipe's (60 × 1 seed, 2026-12-06: +25 points in 60 steps, which the old gold-only test passed)
    while the samples leave the real digits and the fidelity headline falls, so the test above fails it. 40 steps show
    it (60 × 2 seeds, 2026-12-06: gold 0.325 → 0.617, fidelity 0.233 → 0.067; 34 s, the 60 steps took 77 s)."""
    out = tmp_path / "awm_hack"
    summary = short_recipe_run(out, "digits_awm", 40, "algorithm.kl_beta=0", "algorithm.lr=1e-3")
    assert summary["gold_accuracy_after"] - summary["gold_accuracy_before"] >= 0.10, summary  # what a gold-only test would pass
    assert summary["fidelity"]["last_gain"] < 0.05, summary
