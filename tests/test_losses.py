"""Tests for diffrl.algorithms.losses: Flow-GRPO's clipped objective, its metrics, the KL term and the registry."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from diffrl.algorithms.losses import LOSSES, flow_grpo_loss, gaussian_kl_same_std, get_loss, make_step_loss

pytestmark = pytest.mark.usefixtures("single_thread")


# Six samples, clip range 0.2. Per sample: ratio, advantage, max(-A r, -A clip(r)), which branch wins.
#   r=1.5 A=+1 : unclipped -1.5, clipped -1.2 -> -1.2 (clipped; no gradient)
#   r=1.5 A=-1 : unclipped  1.5, clipped  1.2 ->  1.5 (unclipped)
#   r=0.5 A=+2 : unclipped -1.0, clipped -1.6 -> -1.0 (unclipped)
#   r=0.5 A=-2 : unclipped  1.0, clipped  1.6 ->  1.6 (clipped; no gradient)
#   r=1.1 A=.5 : inside the range             -> -0.55
#   r=0.9 A=-3 : inside the range             ->  2.7
RATIOS = [1.5, 1.5, 0.5, 0.5, 1.1, 0.9]
ADV = [1.0, -1.0, 2.0, -2.0, 0.5, -3.0]
PER_SAMPLE = [-1.2, 1.5, -1.0, 1.6, -0.55, 2.7]
ACTIVE = [False, True, True, False, True, True]  # unclipped branch carries the gradient
CLIP = 0.2


def _inputs():
    old = torch.tensor([-3.0, -1.0, 0.5, 2.0, -0.2, 1.0])
    log_prob = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return log_prob, old, torch.tensor(ADV)


def test_flow_grpo_policy_loss_hand_value():
    log_prob, old, adv = _inputs()
    loss, metrics = flow_grpo_loss(log_prob, old, adv, clip_range=CLIP)
    expected = sum(PER_SAMPLE) / len(PER_SAMPLE)  # 3.05 / 6
    assert expected == pytest.approx(0.5083333, abs=1e-6)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["kl"] == 0.0


def test_flow_grpo_gradient_zero_on_clipped_branch():
    log_prob, old, adv = _inputs()
    loss, _ = flow_grpo_loss(log_prob, old, adv, clip_range=CLIP)
    loss.backward()
    n = len(RATIOS)
    # d/dlogp (-A r) = -A r ; clipped branch is constant in log_prob
    expected = torch.tensor([(-a * r / n) if act else 0.0 for r, a, act in zip(RATIOS, ADV, ACTIVE)])
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-5, atol=1e-6)
    assert old.grad is None


def test_flow_grpo_metrics_hand_values():
    log_prob, old, adv = _inputs()
    _, m = flow_grpo_loss(log_prob, old, adv, clip_range=CLIP)
    # |r-1| > 0.2 for 1.5, 1.5, 0.5, 0.5 -> 4/6
    assert m["clipfrac"] == pytest.approx(4 / 6, abs=1e-6)
    assert m["approx_kl"] == pytest.approx(0.5 * sum(math.log(r) ** 2 for r in RATIOS) / 6, abs=1e-6)
    # ratio mean (1.5+1.5+.5+.5+1.1+.9)/6 = 1 ; population std sqrt((4*.25 + 2*.01)/6) = sqrt(0.17)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["ratio_std"] == pytest.approx(math.sqrt(0.17), abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())


def test_flow_grpo_single_sample_ratio_std_zero():
    _, m = flow_grpo_loss(torch.tensor([0.3]), torch.tensor([0.0]), torch.tensor([2.0]), clip_range=0.2)
    # ratio e^0.3 = 1.3499 > 1.2 and A > 0 -> clipped: -2 * 1.2
    assert m["policy_loss"] == pytest.approx(-2.4, abs=1e-6)
    assert m["ratio_std"] == 0.0
    assert m["clipfrac"] == 1.0
    assert m["ratio_mean"] == pytest.approx(math.exp(0.3), rel=1e-6)


def test_flow_grpo_on_policy_loss_and_gradient():
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    old = torch.tensor([-1.0, 0.0, 2.5, -4.0])
    log_prob = old.clone().requires_grad_(True)
    loss, m = flow_grpo_loss(log_prob, old, adv, clip_range=0.2)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)  # -(2.5/4) = -0.625
    assert loss.item() == pytest.approx(-0.625, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -adv / adv.numel(), rtol=1e-6, atol=1e-7)
    assert m["clipfrac"] == 0.0
    assert m["approx_kl"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_std"] == pytest.approx(0.0)


def test_flow_grpo_bf16_inputs_computed_in_fp32():
    log_prob, old, adv = _inputs()
    lp16 = log_prob.detach().bfloat16()
    loss, _ = flow_grpo_loss(lp16, old.bfloat16(), adv.bfloat16(), clip_range=CLIP)
    assert loss.dtype == torch.float32
    ref, _ = flow_grpo_loss(lp16.float(), old.bfloat16().float(), adv, clip_range=CLIP)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)


def test_gaussian_kl_same_std_matches_torch_kl():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(4, 3, 5, generator=g)
    ref_mean = torch.randn(4, 3, 5, generator=g)
    for std in (torch.rand(4, 3, 5, generator=g) + 0.1, torch.tensor([0.2, 0.5, 1.0, 2.0]).view(4, 1, 1)):
        got = gaussian_kl_same_std(mean, ref_mean, std)
        std_full = std.expand_as(mean)
        expected = torch.distributions.kl_divergence(
            torch.distributions.Normal(mean, std_full), torch.distributions.Normal(ref_mean, std_full)
        ).mean(dim=(1, 2))
        assert got.shape == (4,)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # closed form on a single value: (1 - 0)^2 / (2 * 0.5^2) = 2
    one = gaussian_kl_same_std(torch.ones(1, 1), torch.zeros(1, 1), torch.full((1, 1), 0.5))
    assert one.item() == pytest.approx(2.0)


def _kl_inputs():
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(6, 2, 3, generator=g)
    ref_mean = mean + 0.1 * torch.randn(6, 2, 3, generator=g)
    std = torch.full((6, 2, 3), 0.3)
    return mean, ref_mean, std


def test_flow_grpo_kl_term_added():
    log_prob, old, adv = _inputs()
    mean, ref_mean, std = _kl_inputs()
    beta = 0.04
    loss, m = flow_grpo_loss(log_prob, old, adv, clip_range=CLIP, kl_beta=beta, mean=mean, ref_mean=ref_mean, std=std)
    kl = ((mean - ref_mean) ** 2 / (2 * 0.3**2)).mean(dim=(1, 2)).mean().item()
    policy = sum(PER_SAMPLE) / 6
    assert m["kl"] == pytest.approx(kl, rel=1e-5)
    assert m["policy_loss"] == pytest.approx(policy, abs=1e-6)
    assert loss.item() == pytest.approx(policy + beta * kl, abs=1e-6)
    # gradient of the KL part w.r.t. mean: beta * (mean - ref) / std^2 / (B * D)
    mean_g = mean.clone().requires_grad_(True)
    loss, _ = flow_grpo_loss(log_prob.detach(), old, adv, clip_range=CLIP, kl_beta=beta, mean=mean_g, ref_mean=ref_mean, std=std)
    loss.backward()
    expected = beta * (mean - ref_mean) / 0.3**2 / mean.numel()
    torch.testing.assert_close(mean_g.grad, expected, rtol=1e-5, atol=1e-7)


def test_flow_grpo_kl_beta_zero_ignores_reference():
    log_prob, old, adv = _inputs()
    mean, ref_mean, std = _kl_inputs()
    loss, m = flow_grpo_loss(log_prob, old, adv, clip_range=CLIP, kl_beta=0.0, mean=mean, ref_mean=ref_mean, std=std)
    assert loss.item() == pytest.approx(sum(PER_SAMPLE) / 6, abs=1e-6)
    assert m["kl"] == 0.0


@pytest.mark.parametrize("missing", ["mean", "ref_mean", "std"])
def test_flow_grpo_kl_requires_mean_ref_std(missing):
    log_prob, old, adv = _inputs()
    mean, ref_mean, std = _kl_inputs()
    kw = {"mean": mean, "ref_mean": ref_mean, "std": std}
    kw[missing] = None
    with pytest.raises(ValueError, match="mean, ref_mean and std"):
        flow_grpo_loss(log_prob, old, adv, clip_range=CLIP, kl_beta=0.1, **kw)


def _batch(T: int = 3):
    old = torch.tensor([-3.0, -1.0, 0.5, 2.0, -0.2, 1.0])
    # column k=1 holds the true old log-probs; other columns are decoys
    log_probs = torch.stack([old + 10.0 * (j - 1) for j in range(T)], dim=1)
    return TensorDict({"log_probs": log_probs, "advantages": torch.tensor(ADV)}, batch_size=[6])


def test_make_step_loss_reads_column_k_and_advantages():
    batch = _batch()
    log_prob, _, _ = _inputs()
    mean, _, std = _kl_inputs()
    fn = make_step_loss("flow_grpo", clip_range=CLIP)
    assert fn.needs_reference is False
    assert fn.loss_name == "flow_grpo"
    loss, m = fn({"log_prob": log_prob, "mean": mean, "std": std}, batch, 1)
    assert loss.item() == pytest.approx(sum(PER_SAMPLE) / 6, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(4 / 6)
    # column 0 holds old - 10, so the log ratio is log r + 10: every ratio lies outside the clip range
    loss0, m0 = fn({"log_prob": log_prob, "mean": mean, "std": std}, batch, 0)
    ratios0 = [r * math.exp(10.0) for r in RATIOS]
    per0 = [max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)) for r, a in zip(ratios0, ADV)]
    assert loss0.item() == pytest.approx(sum(per0) / 6, rel=1e-5)
    assert m0["clipfrac"] == 1.0


def test_make_step_loss_with_kl_needs_reference():
    batch = _batch()
    log_prob, _, _ = _inputs()
    mean, ref_mean, std = _kl_inputs()
    fn = make_step_loss("flow_grpo", clip_range=CLIP, kl_beta=0.5)
    assert fn.needs_reference is True
    loss, m = fn({"log_prob": log_prob, "mean": mean, "ref_mean": ref_mean, "std": std}, batch, 1)
    kl = ((mean - ref_mean) ** 2 / (2 * 0.3**2)).mean().item()
    assert m["kl"] == pytest.approx(kl, rel=1e-5)
    assert loss.item() == pytest.approx(sum(PER_SAMPLE) / 6 + 0.5 * kl, abs=1e-5)
    with pytest.raises(ValueError):
        fn({"log_prob": log_prob, "mean": mean, "std": std}, batch, 1)  # no ref_mean
    assert make_step_loss("flow_grpo", clip_range=CLIP, kl_beta=0.0).needs_reference is False


def test_get_loss_registry():
    assert get_loss("flow_grpo") is flow_grpo_loss
    assert LOSSES["flow_grpo"] is flow_grpo_loss
    with pytest.raises(ValueError, match="not_a_loss"):
        get_loss("not_a_loss")
    with pytest.raises(ValueError, match="not_a_loss"):
        make_step_loss("not_a_loss", clip_range=0.2)


# --- KL with / without the dt factor -------------------------------------------------------------------
# Two samples, one dim: mean 1 and 2 against ref 0, step std 0.5, dt 0.25 and 0.5.
#   exact KL (no dt factor):  (1)^2 / (2 * 0.25) = 2,   (2)^2 / (2 * 0.25) = 8    -> batch mean 5
#   KL * dt ("with dt"):      2 * 0.25 = 0.5,            8 * 0.5 = 4               -> batch mean 2.25
#   (std = sigma_t sqrt(dt): sigma_t = 1 and 0.5/sqrt(.5); KL * dt = (mean - ref)^2 / (2 sigma_t^2) as in Flow-GRPO's code)
def _dt_inputs():
    mean = torch.tensor([[1.0], [2.0]], requires_grad=True)
    ref_mean = torch.zeros(2, 1)
    std = torch.full((2, 1), 0.5)
    dt = torch.tensor([0.25, 0.5])
    adv = torch.tensor([1.0, -3.0])
    old = torch.tensor([0.2, -0.7])
    return mean, ref_mean, std, dt, adv, old


@pytest.mark.parametrize("kl_dt_scale, kl_expected", [(False, 5.0), (True, 2.25)])
def test_flow_grpo_kl_dt_scale_hand_values(kl_dt_scale, kl_expected):
    mean, ref_mean, std, dt, adv, old = _dt_inputs()
    loss, m = flow_grpo_loss(
        old.clone(), old, adv, clip_range=0.2, kl_beta=0.1, mean=mean, ref_mean=ref_mean, std=std, dt=dt, kl_dt_scale=kl_dt_scale
    )
    assert m["kl"] == pytest.approx(kl_expected, abs=1e-6)
    # on-policy: ratio 1, policy loss -mean(A) = 1
    assert loss.item() == pytest.approx(1.0 + 0.1 * kl_expected, abs=1e-6)
    loss.backward()
    # d/dmean of 0.1 * mean_i KL_i: 0.1 * (mean - ref) / std^2 / B, times dt_i with the dt factor
    scale = dt if kl_dt_scale else torch.ones(2)
    expected = 0.1 * torch.tensor([[1.0], [2.0]]) / 0.25 / 2 * scale.view(2, 1)
    torch.testing.assert_close(mean.grad, expected)


def test_flow_grpo_kl_dt_scale_needs_positive_dt():
    mean, ref_mean, std, dt, adv, old = _dt_inputs()
    kw = dict(clip_range=0.2, kl_beta=0.1, mean=mean, ref_mean=ref_mean, std=std, kl_dt_scale=True)
    with pytest.raises(ValueError, match="needs dt"):
        flow_grpo_loss(old, old, adv, **kw)
    with pytest.raises(ValueError, match="sigma − sigma_next > 0"):
        flow_grpo_loss(old, old, adv, dt=torch.tensor([0.25, 0.0]), **kw)
    # without the dt factor dt is not needed; with kl_beta = 0 neither
    flow_grpo_loss(old, old, adv, **{**kw, "kl_dt_scale": False})
    flow_grpo_loss(old, old, adv, clip_range=0.2, kl_dt_scale=True)


def test_ddpo_is_the_flow_grpo_objective():
    assert get_loss("ddpo") is flow_grpo_loss
    fn = make_step_loss("ddpo", clip_range=CLIP)
    assert fn.loss_name == "ddpo"
    log_prob, _, _ = _inputs()
    mean, _, std = _kl_inputs()
    loss, _ = fn({"log_prob": log_prob, "mean": mean, "std": std}, _batch(), 1)
    assert loss.item() == pytest.approx(sum(PER_SAMPLE) / 6, abs=1e-6)


def test_make_step_loss_derives_dt_from_sigmas():
    mean, ref_mean, std, _, adv, old = _dt_inputs()
    sigmas = torch.tensor([[1.0, 0.75, 0.25], [1.0, 0.5, 0.0]])  # step k=1: dt = 0.5 and 0.5
    batch = TensorDict({"log_probs": torch.stack([old, old], 1), "advantages": adv, "sigmas": sigmas}, batch_size=[2])
    fn = make_step_loss("flow_grpo", clip_range=0.2, kl_beta=0.1, kl_dt_scale=True)
    _, m = fn({"log_prob": old.clone(), "mean": mean, "ref_mean": ref_mean, "std": std}, batch, 1)
    assert m["kl"] == pytest.approx((2.0 * 0.5 + 8.0 * 0.5) / 2, abs=1e-6)
    _, m0 = fn({"log_prob": old.clone(), "mean": mean, "ref_mean": ref_mean, "std": std}, batch, 0)
    assert m0["kl"] == pytest.approx((2.0 * 0.25 + 8.0 * 0.5) / 2, abs=1e-6)


def test_make_step_loss_grpo_guard_reads_rollout_means():
    # on-policy: the rollout means equal the current means, so the normalised log-ratio is s * 0 = 0
    mean, _, std, _, adv, old = _dt_inputs()
    sigmas = torch.tensor([[1.0, 0.75, 0.25], [1.0, 0.5, 0.0]])
    means = torch.stack([mean.detach() + 5.0, mean.detach()], dim=1)  # [B, K, 1]; column 0 is a decoy
    batch = TensorDict({"log_probs": torch.stack([old, old], 1), "advantages": adv, "sigmas": sigmas, "means": means}, batch_size=[2])
    fn = make_step_loss("grpo_guard", clip_range=0.2)
    assert fn.needs_reference is False and fn.loss_name == "grpo_guard"
    loss, m = fn({"log_prob": old.clone(), "mean": mean, "std": std}, batch, 1)
    # ratio 1, weights 1/dt = 1/0.5 and 1/0.5 -> mean(-A * 2) = -(1 - 3) = 2
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(2.0, abs=1e-6)
    assert m["step_weight"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="means"):
        fn({"log_prob": old.clone(), "mean": mean, "std": std}, batch.exclude("means"), 1)


@pytest.mark.parametrize("name", ["dpo", "nft"])
def test_make_step_loss_rejects_non_step_losses(name):
    with pytest.raises(ValueError, match="per-step"):
        make_step_loss(name)
