"""GARDO: ranks, the uncertainty gate, nearest-neighbour diversity and the advantages against hand computation; the loss
on a hand-computed batch (Flow-GRPO's surrogate plus the gated-mean KL); the KL taken against the old adapter and the
update independent of the micro-batch size; the adaptive gate share and reference resets; its own keys and one-line
errors; a short run of the digits_gardo recipe raising gold accuracy."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import fidelity_gain, make_engine, short_recipe_run
from tensordict import TensorDict
from test_algorithms import _trajectories, assert_micro_batch_invariant

from diffrl.algorithms import ALGORITHMS, build_algorithm
from diffrl.algorithms.base import OLD, RunContext
from diffrl.algorithms.gardo import (GARDOConfig, GARDOStepLoss, diversity_advantages, gardo_loss, gate, nearest_cosine_distance, ranks,
                                     uncertainty)
from diffrl.algorithms.losses import flow_grpo_loss, make_step_loss
from diffrl.config import SamplerConfig
from diffrl.recipes import ConfigError, compose
from diffrl.tools.cli import main
from diffrl.run_setup import run_context
from pipelines.digits import DigitsAdapter
from tests.conftest import randomise_lora


def test_ranks_uncertainty_and_gate_by_hand():
    assert ranks(torch.tensor([0.2, 0.9, 0.5, 0.9])).tolist() == [4.0, 1.0, 3.0, 2.0]  # ties: first position ranks higher
    reward = torch.tensor([0.9, 0.8, 0.1, 0.5, 0.3])  # ranks 1 2 5 3 4
    aux = [torch.tensor([0.1, 0.9, 0.8, 0.5, 0.6]), torch.tensor([0.2, 0.7, 0.9, 0.6, 0.1])]  # ranks 5 1 2 4 3 and 4 2 1 3 5
    u = uncertainty(reward, aux)
    assert u.tolist() == [3.5, -0.5, -3.5, 0.5, 0.0]  # mean aux rank − reward rank
    # kept u ≥ 0: [3.5, 0.5, 0.0]; the 1 − 0.5 quantile is 0.5: only u > 0.5 is gated
    assert gate(u, 0.5).tolist() == [True, False, False, False, False]
    assert gate(u, 0.9).tolist() == [True, False, False, True, False]  # quantile 0.1 of [0, 0.5, 3.5] = 0.1
    assert not gate(torch.tensor([-1.0, -2.0]), 0.2).any()


def test_nearest_cosine_distance_and_diversity_advantages_by_hand():
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 4.0], [-3.0, -4.0]])
    g = torch.tensor([0, 0, 0, 1, 2])
    d = nearest_cosine_distance(f, g)
    c = 1 - 2**-0.5  # cos 45°
    torch.testing.assert_close(d, torch.tensor([c, c, c, 0.0, 0.0]))
    # a group of 4: rewards 1, 3, 5, 7 (mean 4) with distances 0.1, 0.2, 0.3, 0.6 (mean 0.3)
    r, dist, gid = torch.tensor([1.0, 3.0, 5.0, 7.0]), torch.tensor([0.1, 0.2, 0.3, 0.6]), torch.zeros(4, dtype=torch.long)
    a = diversity_advantages(r, dist, gid, clip_max=10.0)
    torch.testing.assert_close(a, torch.tensor([-3.0, -1.0, 1.0 * 0.3 / 0.3, 3.0 * 0.6 / 0.3]))
    assert diversity_advantages(r, dist, gid, clip_max=2.5)[3] == 2.5
    # identical samples (mean distance 0): no scaling
    torch.testing.assert_close(diversity_advantages(r, torch.zeros(4), gid, clip_max=5.0), r - 4)


def test_loss_on_a_hand_computed_batch():
    log_prob = torch.tensor([0.0, 0.1, -0.1, 0.0], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5])
    mean = torch.tensor([[0.0, 0.0], [0.2, 0.0], [0.0, 0.0], [0.1, 0.1]])
    ref = torch.zeros(4, 2)
    std = torch.tensor(0.1)
    w = torch.tensor([0.0, 2.0, 0.0, 2.0])  # rows 1 and 3 gated (2 of 4: weight B / G = 2)
    loss, m = gardo_loss(log_prob, old, adv, w, clip_range=0.2, kl_beta=0.5, mean=mean, ref_mean=ref, std=std)
    # KL_i = mean_dims Δμ² / (2·0.01): row 1 (0.04 + 0)/2/0.02 = 1.0, row 3 (0.01 + 0.01)/2/0.02 = 0.5
    kl = (2 * 1.0 + 2 * 0.5) / 4  # the mean over the gated rows, 0.75
    policy, _ = flow_grpo_loss(log_prob, old, adv, clip_range=0.2)
    assert m["kl"] == pytest.approx(kl) and m["gated_frac"] == 0.5
    assert loss.item() == pytest.approx(policy.item() + 0.5 * kl)
    # nothing gated: Flow-GRPO's loss exactly, KL 0
    loss0, m0 = gardo_loss(log_prob, old, adv, torch.zeros(4), clip_range=0.2, kl_beta=0.5, mean=mean, ref_mean=ref, std=std)
    assert loss0.item() == policy.item() and m0["kl"] == 0.0


def test_kl_against_the_old_adapter_and_micro_batch_invariance(tiny_adapter):
    """The reference of GARDO's KL is the old adapter (old ≠ current ≠ base in the engine of the helper); 8 micro-batches
    of 1 give the gradient of one batch of 8 with half the rows gated."""
    assert GARDOStepLoss(clip_range=0.2, kl_beta=0.1, kl_dt_scale=False).spec.reference == OLD
    batch = _trajectories(tiny_adapter)
    batch["gate_weight"] = torch.tensor([2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 2.0])
    out_whole, out_split = assert_micro_batch_invariant(GARDOStepLoss(clip_range=0.2, kl_beta=0.5, kl_dt_scale=False), batch)
    assert out_whole["metrics"]["kl"] > 0
    assert out_split["metrics"]["kl"] == pytest.approx(out_whole["metrics"]["kl"], rel=1e-5)


class _Workers:
    """A worker group that records the update and reference resets; its update reports the given KL."""

    world_size = dp_size = 1

    def __init__(self, kl: float):
        self.kl, self.resets, self.batches = kl, 0, []

    def update_actor(self, data):
        self.batches.append(data)
        out = TensorDict({}, batch_size=[])
        out.set_non_tensor("metrics", {"kl": [self.kl], "lr": [1e-3]})
        return out

    def ema_update_adapter(self, source="default", target="old", decay=0.0):
        assert (source, target, decay) == ("default", "old", 0.0)
        self.resets += 1


def _algorithm(**over):
    run = RunContext(seed=0, prompts_per_step=2, group_size=4, sampler=SamplerConfig(num_steps=3), reward_weights={"digits": 1.0, "aux": 0.0})
    return build_algorithm(GARDOConfig(gate_rewards=["aux"], kl_beta=0.01, **over), run)


def _step(algorithm, workers, step, main, aux):
    traj = TensorDict({"latents": torch.randn(8, 4, 3, 2, 2, generator=torch.Generator().manual_seed(step)), "group_id": torch.arange(8) // 4,
                       "metrics": torch.zeros(8)}, batch_size=[8])
    traj.set_non_tensor("prompts", ["a"] * 4 + ["b"] * 4)
    return algorithm.update(workers, traj, {"rewards": main, "reward/digits": main, "reward/aux": aux}, step)


def test_gate_share_adapts_and_the_reference_resets():
    main_r = torch.linspace(0, 1, 8)
    algorithm = _algorithm(gate_fraction=0.1, reset_every=3, kl_reset_threshold=1e-3)
    quiet = _Workers(kl=1e-4)
    # the aux reward agrees with the reward: u = 0 everywhere, nothing above the quantile is gated
    r = _step(algorithm, quiet, 0, main_r, main_r)
    assert r.record["gated_rows"] == 0 and r.record["gate_p"] == 0.1 and quiet.resets == 0
    # the aux reward disagrees: mean kept u rises above every earlier mean → p × 1.1; the gated rows weigh B / G
    r = _step(algorithm, quiet, 1, main_r, main_r.flip(0))
    assert r.record["gate_u_mean"] > 0 and algorithm.p == pytest.approx(0.11)
    w = quiet.batches[-1]["gate_weight"]
    assert int((w > 0).sum()) >= 1 and float(w.sum()) == pytest.approx(8.0)
    # the third step since the start resets the reference (reset_every = 3), then the count starts again
    _step(algorithm, quiet, 2, main_r, main_r)
    assert quiet.resets == 1 and algorithm.since_reset == 0
    # a KL above the threshold resets at once
    _step(algorithm, _Workers(kl=1e-2), 3, main_r, main_r)
    assert algorithm.since_reset == 0
    state = algorithm.state_dict()
    again = _algorithm(gate_fraction=0.1)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == state


def test_registered_with_its_own_keys_and_one_line_errors(tmp_path, capsys):
    assert "gardo" in ALGORITHMS and ALGORITHMS["gardo"].needs_old_policy
    cfg = compose(["experiment=digits_gardo"])
    algorithm = build_algorithm(cfg.algorithm, run_context(cfg))
    assert type(algorithm).__name__ == "GARDO" and algorithm.config.gate_rewards == ["digits_stroke"]
    with pytest.raises(ConfigError, match="belongs to another algorithm"):
        compose(["experiment=digits_gardo", "algorithm.kl_mask_threshold=1e-6"])
    for bad, key in (("algorithm.gate_rewards=[digits_gold]", "gate_rewards"), ("algorithm.gate_fraction=0.5", "gate_fraction"),
                     ("trainer.group_size=1", "group_size")):
        assert main(["train", "experiment=digits_gardo", bad, f"trainer.output_dir={tmp_path / key}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and key in err[0], err


@pytest.mark.recipe(seconds=145)
def test_digits_gardo_raises_fidelity_in_a_short_run(tmp_path):
    out = tmp_path / "gardo"
    summary = short_recipe_run(out, "digits_gardo", 40)
    assert fidelity_gain(summary) > 0, summary  # 60 × 1 seed, 2026-12-06: +6.7 fidelity points, gold +13.3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gated = [r["gated_rows"] for r in rows if "gated_rows" in r]
    assert gated and max(gated) > 0, gated


def test_the_reference_is_the_old_adapter_not_the_base(tiny_adapter):
    """Old = current (just copied): GARDO's KL is 0, while Flow-GRPO's KL to the base (LoRA off) is not."""
    batch = _trajectories(tiny_adapter)
    batch["gate_weight"] = torch.full((8,), 1.0)
    kls = {}
    for name, objective in (("gardo", GARDOStepLoss(clip_range=0.2, kl_beta=0.5, kl_dt_scale=False)),
                            ("flow_grpo", make_step_loss("flow_grpo", clip_range=0.2, kl_beta=0.5))):
        engine = make_engine(DigitsAdapter(path=None, seed=0), SamplerConfig(num_steps=3, noise_level=0.8), lora_rank=4)
        engine.initialize()
        randomise_lora(engine.module, seed=3)
        engine.copy_to_old()
        kls[name] = engine.train_batch(batch, objective, seed=1)["metrics"]["kl"]
    assert kls["gardo"] == 0.0 and kls["flow_grpo"] > 1e-6, kls
