"""DGPO (Direct Group Preference Optimization): the group weights and the loss against hand computation, the
update independent of the micro-batch size and of the split over ranks, its own config keys, and a short run of
the digits_dgpo recipe raising gold accuracy."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fidelity_gain, short_recipe_run
from test_algorithms import _trajectories, assert_micro_batch_invariant

from diffrl.algorithms import ALGORITHMS, build_algorithm
from diffrl.algorithms.dgpo import DGPOObjective, dgpo_loss, flow_errors, group_weights
from diffrl.recipes import ConfigError, compose
from diffrl.tools.cli import main
from diffrl.run_setup import run_context


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_group_weights_hand_computed():
    """Two groups of two (G = 2, β = 10): s_i = Â_i·β·(e_i − e_i^ref)/G, w_g = σ(Σ_g s_i)."""
    errors = torch.tensor([0.30, 0.10, 0.20, 0.50])
    ref = torch.tensor([0.20, 0.20, 0.20, 0.20])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    gid = torch.tensor([0, 0, 1, 1])
    w = group_weights(errors, ref, adv, gid, beta=10.0, group_size=2)
    g0 = 1.0 * 10 * 0.10 / 2 + (-1.0) * 10 * (-0.10) / 2  # 0.5 + 0.5: the model is worse than the reference where it should be better
    g1 = 0.5 * 10 * 0.0 / 2 + (-0.5) * 10 * 0.30 / 2  # -0.75: already prefers the right sample
    expected = torch.tensor([_sigmoid(g0), _sigmoid(g0), _sigmoid(g1), _sigmoid(g1)])
    torch.testing.assert_close(w, expected)
    assert w[0] > 0.5 > w[2]  # the group not yet learned weighs more


def test_ranks_reduce_to_the_single_rank_weights():
    """A batch split over two ranks, each summing its members and adding the other's sums (an all-reduce), gives
    the weights of the whole batch on one rank."""
    g = torch.Generator().manual_seed(0)
    errors, ref, adv = torch.rand(8, generator=g), torch.rand(8, generator=g), torch.randn(8, generator=g)
    gid = torch.tensor([0, 0, 1, 1, 0, 2, 2, 1])
    whole = group_weights(errors, ref, adv, gid, beta=5.0, group_size=3)

    def local_sums(idx):
        return torch.zeros(3).index_add_(0, gid[idx], adv[idx] * 5.0 * (errors[idx] - ref[idx]) / 3)

    a, b = torch.arange(4), torch.arange(4, 8)
    halves = []
    for mine, other in ((a, b), (b, a)):
        halves.append(group_weights(errors[mine], ref[mine], adv[mine], gid[mine], beta=5.0, group_size=3, num_groups=3,
                                    reduce=lambda t, other=other: t.add_(local_sums(other))))
    torch.testing.assert_close(torch.cat(halves), whole)


def test_loss_and_gradient_closed_form():
    """L = mean_i w_i·Â_i·e_i + β_KL·mean (v − v_ref)²; ∂L/∂v = 2·w_i·Â_i·(v − v*)/N + 2β_KL·(v − v_ref)/N."""
    g = torch.Generator().manual_seed(1)
    v0, target, v_ref = (torch.randn(3, 4, 2, generator=g) for _ in range(3))
    adv, w = torch.tensor([0.7, -1.1, 0.4]), torch.tensor([0.2, 0.9, 0.5])
    v = v0.clone().requires_grad_(True)
    loss, m = dgpo_loss(v, target, adv, w, kl_beta=0.01, v_ref=v_ref)
    loss.backward()
    e = ((v0 - target) ** 2).mean(dim=(1, 2))
    kl = ((v0 - v_ref) ** 2).mean()
    assert loss.item() == pytest.approx(((w * adv * e).mean() + 0.01 * kl).item(), rel=1e-6)
    assert m["group_weight_mean"] == pytest.approx(w.mean().item()) and m["kl"] == pytest.approx(kl.item(), rel=1e-6)
    n = v0.numel()
    expected = (w * adv).view(-1, 1, 1) * 2 * (v0 - target) / n + 2 * 0.01 * (v0 - v_ref) / n
    torch.testing.assert_close(v.grad, expected)
    torch.testing.assert_close(flow_errors(v0, target), e)
    with pytest.raises(ValueError, match="v_ref"):
        dgpo_loss(v0, target, adv, w, kl_beta=0.1)


def test_update_does_not_depend_on_the_micro_batch_size(tiny_adapter):
    """8 micro-batches of 1 give the gradient of one batch of 8: the group weights are computed over the whole
    batch before any micro-batch's gradient (fp32 tolerance), and they are not all ½ (the reference differs)."""
    batch = _trajectories(tiny_adapter)
    batch["advantages"] = torch.tensor([1.5, -0.5, 0.25, -2.0, 0.0, 0.75, -1.0, 3.0])
    objective = DGPOObjective(beta=50.0, num_timesteps=2, group_size=4, kl_beta=0.05)
    out_whole, out_split = assert_micro_batch_invariant(objective, batch)
    assert out_whole["metrics"]["group_weight_mean"] == pytest.approx(out_split["metrics"]["group_weight_mean"], rel=1e-5)
    assert abs(out_whole["metrics"]["group_weight_mean"] - 0.5) > 1e-4


def test_registered_with_its_own_keys_and_one_line_errors(tmp_path, capsys):
    assert "dgpo" in ALGORITHMS
    cfg = compose(["experiment=digits_dgpo", "algorithm.dgpo_beta=20"])
    algorithm = build_algorithm(cfg.algorithm, run_context(cfg))
    assert type(algorithm).__name__ == "DGPO" and algorithm.objective().beta == 20.0 and algorithm.objective().group_size == 8
    with pytest.raises(ConfigError, match="belongs to another algorithm .algorithm=nft."):
        compose(["experiment=digits_dgpo", "algorithm.nft_beta=1.0"])  # another algorithm's key
    assert main(["train", "experiment=digits_dgpo", "algorithm.dgpo_beta=-1", f"trainer.output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.dgpo_beta" in err[0]
    assert main(["train", "experiment=digits_dgpo", "trainer.group_size=1", f"trainer.output_dir={tmp_path / 's'}"]) == 2
    assert "group_size" in capsys.readouterr().err


@pytest.mark.recipe(seconds=44)
def test_digits_dgpo_raises_fidelity_in_a_short_run(tmp_path):
    """25 steps of the recipe (of its 150): the fidelity headline on the 60 prompts × 2 held-out seeds rises (60 × 1 seed,
    2026-12-06: +8.3 points, gold +16.7)."""
    out = tmp_path / "dgpo"
    summary = short_recipe_run(out, "digits_dgpo", 25)
    assert fidelity_gain(summary) > 0, summary
    assert summary["reward_after"] > summary["reward_before"]
