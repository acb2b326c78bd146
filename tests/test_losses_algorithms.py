"""Tests for the GRPO-Guard, Diffusion-DPO and DiffusionNFT losses against hand computations and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.losses import LOSSES, dpo_loss, flow_grpo_loss, grpo_guard_loss, nft_loss, nft_reward_to_r
from diffrl.sampling.sde import gaussian_log_prob

pytestmark = pytest.mark.usefixtures("single_thread")


def test_registry_names():
    assert LOSSES["grpo_guard"] is grpo_guard_loss
    assert LOSSES["dpo"] is dpo_loss
    assert LOSSES["nft"] is nft_loss


# --- GRPO-Guard ---------------------------------------------------------------------------------------
# Three samples, two dims, clip 0.12.
#   s (step std)   0.5            0.2           1.0
#   Δμ             [.2, -.4]      [.1, .1]      [0, 0]        -> ‖Δμ‖² (mean over dims) 0.1, 0.01, 0
#   log r          -0.3           0.5           0.1
#   log r̂ = s·log r + ‖Δμ‖²/(2s):  -0.15 + 0.1 = -0.05,  0.1 + 0.025 = 0.125,  0.1
#   r̂              0.951229       1.133148      1.105171      (the second is above 1.12: clipped for A > 0)
#   A              1              2             -1
#   per sample     -0.951229      -2 * 1.12     1.105171
#   δ = 1/dt       4              25            2
GUARD_S = [0.5, 0.2, 1.0]
GUARD_DT = [0.25, 0.04, 0.5]
GUARD_ADV = [1.0, 2.0, -1.0]
GUARD_LOG_R = [-0.3, 0.5, 0.1]
GUARD_LOG_R_HAT = [-0.05, 0.125, 0.1]
GUARD_CLIP = 0.12


def _guard_inputs():
    old_mean = torch.tensor([[0.3, 0.1], [-1.0, 2.0], [0.5, 0.5]])
    mean = (old_mean + torch.tensor([[0.2, -0.4], [0.1, 0.1], [0.0, 0.0]])).requires_grad_(True)
    std = torch.tensor(GUARD_S).view(3, 1).expand(3, 2)
    old_log_prob = torch.tensor([1.0, -2.0, 0.0])
    log_prob = (old_log_prob + torch.tensor(GUARD_LOG_R)).requires_grad_(True)
    return log_prob, old_log_prob, torch.tensor(GUARD_ADV), mean, old_mean, std, torch.tensor(GUARD_DT)


def test_grpo_guard_hand_value():
    log_prob, old, adv, mean, old_mean, std, dt = _guard_inputs()
    loss, m = grpo_guard_loss(log_prob, old, adv, clip_range=GUARD_CLIP, mean=mean, old_mean=old_mean, std=std, dt=dt)
    r = [math.exp(x) for x in GUARD_LOG_R_HAT]
    assert r[1] > 1 + GUARD_CLIP and abs(r[0] - 1) < GUARD_CLIP and abs(r[2] - 1) < GUARD_CLIP
    expected = (4 * -r[0] + 25 * -2 * (1 + GUARD_CLIP) + 2 * r[2]) / 3
    assert expected == pytest.approx(-19.198192, abs=1e-5)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["policy_loss"] == pytest.approx(expected, rel=1e-6)
    assert m["ratio_mean"] == pytest.approx(sum(r) / 3, rel=1e-6)
    assert m["raw_ratio_mean"] == pytest.approx(sum(math.exp(x) for x in GUARD_LOG_R) / 3, rel=1e-6)
    assert m["clipfrac"] == pytest.approx(1 / 3)
    assert m["step_weight"] == pytest.approx((4 + 25 + 2) / 3, rel=1e-6)
    assert m["kl"] == 0.0


def test_grpo_guard_gradients_vanish_on_the_clipped_side():
    log_prob, old, adv, mean, old_mean, std, dt = _guard_inputs()
    loss, _ = grpo_guard_loss(log_prob, old, adv, clip_range=GUARD_CLIP, mean=mean, old_mean=old_mean, std=std, dt=dt)
    loss.backward()
    r = torch.exp(torch.tensor(GUARD_LOG_R_HAT))
    delta = 1 / torch.tensor(GUARD_DT)
    s = torch.tensor(GUARD_S)
    # active samples: d loss / d log r̂ = -δ A r̂ / B; d log r̂ / d log_prob = s; d log r̂ / d mean = Δμ / (s D)
    dlog = -delta * torch.tensor(GUARD_ADV) * r / 3
    active = torch.tensor([1.0, 0.0, 1.0])  # sample 1 sits on the clipped branch
    torch.testing.assert_close(log_prob.grad, dlog * s * active)
    d_mu = (mean - old_mean).detach()
    torch.testing.assert_close(mean.grad, (dlog * active / s / 2).view(3, 1) * d_mu)
    assert mean.grad[1].abs().sum() == 0 and log_prob.grad[1] == 0


def test_ratio_norm_is_eps_dot_dmu():
    """log r̂ = s·(log r + ‖Δμ‖²/(2s²)) equals mean_dims(ε·Δμ) for x = old_mean + s·ε, exactly."""
    g = torch.Generator().manual_seed(0)
    B, D = 5, 6
    old_mean = torch.randn(B, D, generator=g, dtype=torch.float64)
    mean = old_mean + 0.1 * torch.randn(B, D, generator=g, dtype=torch.float64)
    s = torch.tensor([0.05, 0.1, 0.3, 0.7, 1.2], dtype=torch.float64).view(B, 1)
    eps = torch.randn(B, D, generator=g, dtype=torch.float64)
    x = old_mean + s * eps
    log_prob, old_log_prob = gaussian_log_prob(x, mean, s), gaussian_log_prob(x, old_mean, s)
    expected = (eps * (mean - old_mean)).mean(dim=1)
    raw_expected = expected / s.view(-1) - ((mean - old_mean) ** 2).mean(dim=1) / (2 * s.view(-1) ** 2)
    torch.testing.assert_close(log_prob - old_log_prob, raw_expected)
    # A = 1, clip wide enough, no reweighting: the loss is -mean r̂, so r̂ = exp(log r̂) can be read back
    adv = torch.ones(B)
    loss, m = grpo_guard_loss(log_prob, old_log_prob, adv, clip_range=10.0, mean=mean, old_mean=old_mean, std=s, grad_reweight=False)
    assert loss.item() == pytest.approx(-torch.exp(expected).mean().item(), rel=1e-5)
    assert m["step_weight"] == 1.0


def test_ratio_norm_centres_the_log_ratio():
    """Over the rollout noise the raw log-ratio has mean −‖Δμ‖²/(2s²); the normalised one has mean 0."""
    g = torch.Generator().manual_seed(1)
    B, D, s = 4000, 8, 0.1
    old_mean = torch.zeros(B, D)
    mean = torch.full((B, D), 0.05)  # ‖Δμ‖² = 0.0025 -> raw shift -0.125
    x = old_mean + s * torch.randn(B, D, generator=g)
    std = torch.full((B, D), s)
    log_r = gaussian_log_prob(x, mean, std) - gaussian_log_prob(x, old_mean, std)
    assert log_r.mean().item() == pytest.approx(-0.125, abs=0.01)
    log_r_hat = s * log_r + 0.0025 / (2 * s)
    assert log_r_hat.mean().item() == pytest.approx(0.0, abs=5e-4)  # std of the mean: 0.05/sqrt(8)/sqrt(4000)
    _, m = grpo_guard_loss(
        log_r, torch.zeros(B), torch.ones(B), clip_range=0.2, mean=mean, old_mean=old_mean, std=std, grad_reweight=False
    )
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert m["raw_ratio_mean"] < 0.99


def test_grpo_guard_without_corrections_is_flow_grpo():
    log_prob, old, adv, mean, old_mean, std, dt = _guard_inputs()
    kw = dict(mean=mean, old_mean=old_mean, std=std, ratio_norm=False, grad_reweight=False)
    got, _ = grpo_guard_loss(log_prob, old, adv, clip_range=0.2, **kw)
    ref, _ = flow_grpo_loss(log_prob, old, adv, clip_range=0.2)
    assert got.item() == pytest.approx(ref.item(), abs=1e-7)


def test_grpo_guard_kl_and_argument_errors():
    log_prob, old, adv, mean, old_mean, std, dt = _guard_inputs()
    ref_mean = old_mean
    kw = dict(mean=mean, old_mean=old_mean, std=std, dt=dt, kl_beta=0.5, ref_mean=ref_mean)
    loss, m = grpo_guard_loss(log_prob, old, adv, clip_range=GUARD_CLIP, **kw)
    # KL_i = mean_dims Δμ² / (2 s²): 0.1 / 0.5 = 0.2, 0.01 / 0.08 = 0.125, 0
    assert m["kl"] == pytest.approx((0.2 + 0.125) / 3, rel=1e-5)
    assert loss.item() == pytest.approx(m["policy_loss"] + 0.5 * m["kl"], rel=1e-6)
    with pytest.raises(ValueError, match="needs dt"):
        grpo_guard_loss(log_prob, old, adv, clip_range=0.2, mean=mean, old_mean=old_mean, std=std)
    with pytest.raises(ValueError, match="old_mean"):
        grpo_guard_loss(log_prob, old, adv, clip_range=0.2, mean=mean, old_mean=None, std=std, dt=dt)
    with pytest.raises(ValueError, match="ref_mean"):
        grpo_guard_loss(log_prob, old, adv, clip_range=0.2, mean=mean, old_mean=old_mean, std=std, dt=dt, kl_beta=0.1)


# --- Diffusion-DPO ------------------------------------------------------------------------------------
# β = 2, two pairs:
#   pair 0: model w 0.5, l 0.3; ref 0.4, 0.4 -> inside = -(2/2)·((0.5-0.4) - (0.3-0.4)) = -0.2
#   pair 1: model w 0.2, l 0.6; ref 0.4, 0.4 -> inside = -((0.2-0.4) - (0.6-0.4)) = +0.4
#   loss = (log(1 + e^0.2) + log(1 + e^-0.4)) / 2
def _dpo_inputs():
    mw = torch.tensor([0.5, 0.2], requires_grad=True)
    ml = torch.tensor([0.3, 0.6], requires_grad=True)
    return mw, ml, torch.tensor([0.4, 0.4]), torch.tensor([0.4, 0.4])


def test_dpo_hand_value_and_metrics():
    mw, ml, rw, rl = _dpo_inputs()
    loss, m = dpo_loss(mw, ml, rw, rl, dpo_beta=2.0)
    expected = (math.log1p(math.exp(0.2)) + math.log1p(math.exp(-0.4))) / 2
    assert expected == pytest.approx(0.65558, abs=1e-4)  # (0.79814 + 0.51302) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["loss"] == pytest.approx(expected, abs=1e-6)
    assert m["implicit_accuracy"] == 0.5
    assert m["reward_margin"] == pytest.approx(0.1, abs=1e-6)
    # implicit rewards r = -(β/2)(err - ref): w: -0.1, +0.2 ; l: +0.1, -0.2
    assert m["reward_w"] == pytest.approx(0.05, abs=1e-6)
    assert m["reward_l"] == pytest.approx(-0.05, abs=1e-6)
    assert m["model_err_w"] == pytest.approx(0.35) and m["model_err_l"] == pytest.approx(0.45)
    assert m["ref_err_w"] == pytest.approx(0.4) and m["ref_err_l"] == pytest.approx(0.4)


def test_dpo_gradient_sign_and_value():
    mw, ml, rw, rl = _dpo_inputs()
    loss, _ = dpo_loss(mw, ml, rw, rl, dpo_beta=2.0)
    loss.backward()
    inside = torch.tensor([-0.2, 0.4])
    # dL/d inside = -σ(-inside)/B ; d inside / d mw = -β/2, d inside / d ml = +β/2
    torch.testing.assert_close(mw.grad, torch.sigmoid(-inside) * 1.0 / 2)
    torch.testing.assert_close(ml.grad, -torch.sigmoid(-inside) * 1.0 / 2)
    assert bool((mw.grad > 0).all()) and bool((ml.grad < 0).all())
    # lowering the winner's error lowers the loss
    smaller, _ = dpo_loss(mw.detach() - 0.05, ml.detach(), rw, rl, dpo_beta=2.0)
    assert smaller.item() < loss.item()


def test_dpo_accuracy_and_reference_has_no_gradient():
    mw = torch.tensor([0.1, 0.2, 0.9, 0.3])
    ml = torch.tensor([0.5, 0.1, 0.2, 0.3])
    rw = torch.full((4,), 0.3, requires_grad=True)
    rl = torch.full((4,), 0.3, requires_grad=True)
    loss, m = dpo_loss(mw.requires_grad_(True), ml, rw, rl, dpo_beta=10.0)
    # inside ∝ ml - mw: +0.4, -0.1, -0.7, 0 -> one of four strictly positive
    assert m["implicit_accuracy"] == 0.25
    loss.backward()
    assert rw.grad is None and rl.grad is None
    # equal errors everywhere: loss log 2, accuracy 0
    loss, m = dpo_loss(torch.ones(3), torch.ones(3), torch.ones(3), torch.ones(3), dpo_beta=5000.0)
    assert loss.item() == pytest.approx(math.log(2.0)) and m["implicit_accuracy"] == 0.0


def test_dpo_argument_errors():
    mw, ml, rw, rl = _dpo_inputs()
    with pytest.raises(ValueError, match="dpo_beta"):
        dpo_loss(mw, ml, rw, rl, dpo_beta=0.0)
    with pytest.raises(ValueError, match="ref_err_l"):
        dpo_loss(mw, ml, rw, torch.zeros(3), dpo_beta=1.0)


# --- DiffusionNFT -------------------------------------------------------------------------------------
def _nft_data(B=4, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    v_old = torch.randn(B, D, generator=g)
    v_target = torch.randn(B, D, generator=g)
    r = torch.tensor([0.0, 0.25, 0.5, 1.0])[:B]
    return v_old, v_target, r


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_minimiser_closed_form_and_numerical(beta):
    """Unweighted NFT, no KL: per sample the minimiser is v_old + (2r − 1)(v* − v_old)/β."""
    v_old, v_target, r = _nft_data()
    closed = v_old + (2 * r - 1).view(-1, 1) * (v_target - v_old) / beta
    # r = 1/2 keeps the old policy
    torch.testing.assert_close(closed[2], v_old[2])
    # closed form: zero gradient there
    v = closed.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, v_target, r, nft_beta=beta, adaptive_weight=False)
    (grad,) = torch.autograd.grad(loss, v)
    assert grad.abs().max().item() < 1e-6
    # numerical: minimise over a free tensor from a random start
    v = torch.randn(v_old.shape, generator=torch.Generator().manual_seed(7)).requires_grad_(True)
    opt = torch.optim.LBFGS([v], lr=1.0, max_iter=300, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value, _ = nft_loss(v, v_old, v_target, r, nft_beta=beta, adaptive_weight=False)
        value.backward()
        return value

    opt.step(closure)
    torch.testing.assert_close(v.detach(), closed, rtol=1e-4, atol=1e-4)
    # plain gradient descent agrees too: the loss is quadratic with curvature 2β/(B·D) per element
    v = torch.zeros_like(v_old, requires_grad=True)
    step = 0.5 * v_old.numel() / (2 * beta)
    for _ in range(200):
        value, _ = nft_loss(v, v_old, v_target, r, nft_beta=beta, adaptive_weight=False)
        (grad,) = torch.autograd.grad(value, v)
        v = (v - step * grad).detach().requires_grad_(True)
    torch.testing.assert_close(v.detach(), closed, rtol=1e-4, atol=1e-4)


# Two samples, one dim, β = 0.5:
#   sample 0: v_old 0, v_θ 1, v* 2, r 1    -> v+ = 0.5, v- = -0.5; e+ = 2.25, e- = 6.25; term 2.25
#   sample 1: v_old 1, v_θ 1, v* 0, r .25  -> v+ = v- = 1; e+ = e- = 1; term 1
#   loss = (2.25 + 1)/2 / β = 3.25
NFT_V_OLD = [[0.0], [1.0]]
NFT_V_THETA = [[1.0], [1.0]]
NFT_V_TARGET = [[2.0], [0.0]]
NFT_R = [1.0, 0.25]


def test_nft_unweighted_hand_value():
    v = torch.tensor(NFT_V_THETA, requires_grad=True)
    loss, m = nft_loss(v, torch.tensor(NFT_V_OLD), torch.tensor(NFT_V_TARGET), torch.tensor(NFT_R), nft_beta=0.5, adaptive_weight=False)
    assert loss.item() == pytest.approx(3.25, abs=1e-6)
    assert m["positive_loss"] == pytest.approx((2.25 + 1) / 2) and m["negative_loss"] == pytest.approx((6.25 + 1) / 2)
    assert m["r_mean"] == pytest.approx(0.625) and m["kl"] == 0.0
    assert m["old_deviate"] == pytest.approx(0.5)
    loss.backward()
    # d/dv of (1/β)(1/B)[r (v+ - v*)^2 + (1-r)(v- - v*)^2] = (1/B)·2[r(v+ - v*) - (1-r)(v- - v*)]
    # sample 0: (1/2)·2·(0.5 - 2) = -1.5 ; sample 1: (1/2)·2·(0.25·1 - 0.75·1) = -0.5
    torch.testing.assert_close(v.grad, torch.tensor([[-1.5], [-0.5]]))


# Adaptive weighting, same data with σ = 0.5 and 2 (x̂0 − x0 = σ(v* − v)):
#   sample 0: diff+ = 0.5·(0.5 - 2) = -0.75 -> e+ = 0.5625/0.75 = 0.75 ; diff- = -1.25 -> e- = 1.25 ; term 0.75
#   sample 1: diff± = 2·1 = 2 -> e± = 4/2 = 2 ; term 2
#   loss = (0.75 + 2)/2 / 0.5 = 2.75
def test_nft_adaptive_weight_hand_value_and_detached_weight():
    v = torch.tensor(NFT_V_THETA, requires_grad=True)
    sigma = torch.tensor([0.5, 2.0])
    data = torch.tensor(NFT_V_OLD), torch.tensor(NFT_V_TARGET), torch.tensor(NFT_R)
    loss, m = nft_loss(v, *data, nft_beta=0.5, adaptive_weight=True, sigma=sigma)
    assert loss.item() == pytest.approx(2.75, abs=1e-6)
    assert m["positive_loss"] == pytest.approx((0.75 + 2) / 2)
    loss.backward()
    # weight detached: de/dv+ = 2σ·diff/w = 2σ·sign(diff) in one dim (a differentiated weight would halve it)
    # sample 0: (1/β)(1/B)·r·β·2σ·(-1) = -0.5 ; sample 1: (1/B)[0.25·2·2 - 0.75·2·2] = -1
    torch.testing.assert_close(v.grad, torch.tensor([[-0.5], [-1.0]]))


def test_nft_adaptive_weight_floor():
    # v = v* exactly: error 0, the weight floors at adaptive_weight_min and the loss is 0 (no NaN)
    vt = torch.tensor([[0.3, -0.2]])
    loss, _ = nft_loss(vt.clone(), vt.clone(), vt, torch.tensor([0.7]), nft_beta=1.0, adaptive_weight=True, sigma=torch.tensor([0.5]))
    assert loss.item() == 0.0


def test_nft_kl_term():
    v = torch.tensor(NFT_V_THETA)
    v_ref = torch.tensor([[0.0], [3.0]])  # (1-0)^2, (1-3)^2 -> mean 2.5
    data = torch.tensor(NFT_V_OLD), torch.tensor(NFT_V_TARGET), torch.tensor(NFT_R)
    loss, m = nft_loss(v, *data, nft_beta=0.5, adaptive_weight=False, kl_beta=0.1, v_ref=v_ref)
    assert m["kl"] == pytest.approx(2.5)
    assert loss.item() == pytest.approx(3.25 + 0.25, abs=1e-6)


def test_nft_argument_errors():
    v, vo, vt, r = torch.tensor(NFT_V_THETA), torch.tensor(NFT_V_OLD), torch.tensor(NFT_V_TARGET), torch.tensor(NFT_R)
    with pytest.raises(ValueError, match="nft_beta"):
        nft_loss(v, vo, vt, r, nft_beta=0.0, adaptive_weight=False)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(v, vo, vt, torch.tensor([1.5, 0.0]), nft_beta=1.0, adaptive_weight=False)
    with pytest.raises(ValueError, match="sigma"):
        nft_loss(v, vo, vt, r, nft_beta=1.0, adaptive_weight=True)
    with pytest.raises(ValueError, match="v_ref"):
        nft_loss(v, vo, vt, r, nft_beta=1.0, adaptive_weight=False, kl_beta=0.1)
    with pytest.raises(ValueError, match="must match"):
        nft_loss(v, vo[:1], vt, r, nft_beta=1.0, adaptive_weight=False)


def test_nft_reward_to_r_hand_values():
    # std_mode none: group 0 rewards 1, 3 -> A = -1, 1 ; group 1 rewards 10, 10, 16 -> A = -2, -2, 4
    # r = 0.5 + 0.5·clip(A/2, -1, 1) = 0.25, 0.75, 0, 0, 1
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0, 16.0])
    gid = torch.tensor([0, 0, 1, 1, 1])
    r = nft_reward_to_r(rewards, gid, adv_clip_max=2.0, std_mode="none")
    torch.testing.assert_close(r, torch.tensor([0.25, 0.75, 0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="adv_clip_max"):
        nft_reward_to_r(rewards, gid, adv_clip_max=0.0)
    with pytest.raises(ValueError, match="group"):
        nft_reward_to_r(rewards, gid, std_mode="batch")
