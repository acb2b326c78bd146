"""Flow-DPPO: the divergence mask and the loss against hand computation, the first optimizer step equal to
Flow-GRPO's (no divergence yet), the update independent of the micro-batch size with the mask acting, its own
config keys and one-line errors, and a short run of the digits_flow_dppo recipe raising gold accuracy."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fidelity_gain, short_recipe_run
from test_algorithms import PROMPTS, _trajectories, assert_micro_batch_invariant

from diffrl.algorithms import ALGORITHMS, build_algorithm
from diffrl.algorithms.flow_dppo import FlowDPPOStepLoss, divergence_mask, flow_dppo_loss
from diffrl.algorithms.losses import make_step_loss
from diffrl.config import SamplerConfig
from diffrl.recipes import ConfigError, compose
from diffrl.sampling.rollout import sample_trajectories
from diffrl.tools.cli import main
from diffrl.run_setup import run_context


def test_mask_is_asymmetric_and_keeps_corrective_updates():
    """Masked: outside the trust region (D > δ) and moved the way the advantage pulls; kept: inside it, or moving back."""
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.0, 1.0])
    ratio = torch.tensor([1.2, 0.8, 0.8, 1.2, 1.2, 0.8, 1.5, 1.0])
    d = torch.tensor([1e-3, 1e-3, 1e-3, 1e-3, 1e-6, 1e-6, 1e-3, 1e-3])
    mask = divergence_mask(adv, ratio, d, threshold=1e-5)
    # Â>0 r>1 far: masked; Â>0 r<1 far: corrective, kept; Â<0 r<1 far: masked; Â<0 r>1 far: kept; near: kept;
    # Â = 0: no direction, kept; r = 1 exactly: not outward, kept
    assert mask.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_loss_gradient_and_divergence_closed_form():
    """D_i = mean_dims (μ_θ − μ_old)²/(2s²); L = −mean_i m_i·r_i·Â_i + β·KL; ∂L/∂log p_i = −m_i·r_i·Â_i/B."""
    g = torch.Generator().manual_seed(0)
    B = 4
    old_mean = torch.randn(B, 3, 2, generator=g)
    shift = torch.tensor([0.0, 0.05, 0.2, 0.3]).view(B, 1, 1)  # sample 0 did not move, the others increasingly
    mean = (old_mean + shift * torch.randn(B, 3, 2, generator=g)).requires_grad_(True)
    std = torch.tensor(0.1)
    ref_mean = torch.randn(B, 3, 2, generator=g)
    log_prob = torch.tensor([0.0, 0.3, 0.4, -0.5], requires_grad=True)
    old_log_prob = torch.zeros(B)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    loss, m = flow_dppo_loss(log_prob, old_log_prob, adv, mean=mean, old_mean=old_mean, std=std, threshold=0.5, kl_beta=0.02, ref_mean=ref_mean)
    loss.backward()
    d = ((mean.detach() - old_mean) ** 2 / (2 * 0.01)).mean(dim=(1, 2))
    r = torch.exp(log_prob.detach())
    outward = ((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1))
    keep = (~(outward & (d > 0.5))).float()
    assert 0 < keep.sum() < B  # the case mixes masked and kept samples
    kl = ((mean.detach() - ref_mean) ** 2 / (2 * 0.01)).mean()
    assert loss.item() == pytest.approx((-(keep * r * adv).mean() + 0.02 * kl).item(), rel=1e-6)
    torch.testing.assert_close(log_prob.grad, -keep * r * adv / B)
    assert m["divergence_mean"] == pytest.approx(d.mean().item(), rel=1e-6) and m["masked_frac"] == pytest.approx(1 - keep.mean().item())
    # the KL's gradient on the mean only (the mask and the divergence carry none)
    torch.testing.assert_close(mean.grad, 0.02 * (mean.detach() - ref_mean) / 0.01 / mean.numel())


def _with_means(adapter, batch):
    td = sample_trajectories(adapter, [PROMPTS[i % 2] for i in range(8)], settings=SamplerConfig(num_steps=3, noise_level=0.8),
                             seeds=list(range(100, 108)), record_means=True)
    batch = batch.exclude("log_probs")
    batch["log_probs"], batch["means"] = td["log_probs"], td["means"]
    return batch


def test_first_step_equals_flow_grpo(tiny_adapter):
    """On the rollout policy itself (ratio 1, D = 0) nothing is masked and nothing clipped: the loss and its
    gradient are Flow-GRPO's."""
    batch = _with_means(tiny_adapter, _trajectories(tiny_adapter))
    steps = []
    for k in range(3):
        step = {"log_prob": batch["log_probs"][:, k].clone().requires_grad_(True), "mean": batch["means"][:, k].clone(), "std": torch.tensor(0.3)}
        steps.append(step)
    dppo = FlowDPPOStepLoss(threshold=1e-5, kl_beta=0.0, kl_dt_scale=False)
    grpo = make_step_loss("flow_grpo", clip_range=0.2)
    for k, step in enumerate(steps):
        a, ma = dppo(step, batch, k)
        ga = torch.autograd.grad(a, step["log_prob"])[0]
        b, _ = grpo(step, batch, k)
        gb = torch.autograd.grad(b, step["log_prob"])[0]
        assert ma["masked_frac"] == 0.0 and ma["divergence_max"] == 0.0
        assert a.item() == pytest.approx(b.item(), rel=1e-6)
        torch.testing.assert_close(ga, gb)
        assert ga.abs().max() > 0


def test_update_does_not_depend_on_the_micro_batch_size(tiny_adapter):
    """The engine's current policy differs from the rollout's (D > 0 on some sample-steps): 8 micro-batches of 1
    give the gradient of one batch of 8, with the mask acting on part of the batch."""
    batch = _with_means(tiny_adapter, _trajectories(tiny_adapter))
    objective = FlowDPPOStepLoss(threshold=1e-5, kl_beta=0.05, kl_dt_scale=False)
    out_whole, out_split = assert_micro_batch_invariant(objective, batch)
    masked = out_whole["metrics"]["masked_frac"]
    assert 0 < masked < 1, masked
    assert out_split["metrics"]["masked_frac"] == pytest.approx(masked, rel=1e-5)


def test_registered_with_its_own_keys_and_one_line_errors(tmp_path, capsys):
    assert "flow_dppo" in ALGORITHMS
    cfg = compose(["experiment=digits_flow_dppo", "algorithm.kl_mask_threshold=1e-6"])
    algorithm = build_algorithm(cfg.algorithm, run_context(cfg))
    assert type(algorithm).__name__ == "FlowDPPO" and algorithm.objective().threshold == 1e-6
    plan = algorithm.rollout_plan(type("M", (), {"trained": torch.ones(3, dtype=torch.bool), "stochastic": torch.ones(3, dtype=torch.bool)})())
    assert algorithm.spec.record_means and plan.policy == "current"
    with pytest.raises(ConfigError, match="belongs to another algorithm"):
        compose(["experiment=digits_flow_dppo", "algorithm.clip_range=0.1"])  # Flow-GRPO's clip has no place here
    assert main(["train", "experiment=digits_flow_dppo", "algorithm.kl_mask_threshold=0", f"trainer.output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.kl_mask_threshold" in err[0]
    assert main(["train", "experiment=digits_flow_dppo", "trainer.group_size=1", f"trainer.output_dir={tmp_path / 's'}"]) == 2
    assert "group_size" in capsys.readouterr().err
    # FP8 rollouts sample with another policy; the mask would need that policy's step means
    assert main(["train", "experiment=digits_flow_dppo", "model.rollout_precision=fp8", f"trainer.output_dir={tmp_path / 't'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout_precision" in err[0] and "flow_dppo" in err[0]


@pytest.mark.recipe(seconds=62)
def test_digits_flow_dppo_raises_fidelity_in_a_short_run(tmp_path):
    """20 steps of the recipe (of its 100): the fidelity headline on the 60 prompts × 2 held-out seeds rises (60 × 1
    seed, 2026-12-06: +8.3 points, gold +15), and the mask acted (some sample-steps of the later optimizer steps were
    outside the trust region)."""
    out = tmp_path / "dppo"
    summary = short_recipe_run(out, "digits_flow_dppo", 20)
    assert fidelity_gain(summary) > 0, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    masked = [r["masked_frac"] for r in rows if "masked_frac" in r]
    assert masked and max(masked) > 0, masked
