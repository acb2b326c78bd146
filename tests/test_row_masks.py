"""Per-row stochastic and trained steps in the rollout (``sample_trajectories`` with ``[B, K]`` masks) and the
per-position group layout of a request (``SampleRequest.group_trained`` → ``trained_rows`` / ``stochastic_rows``):
each row samples exactly what it samples alone with its own ``[K]`` masks, whatever rows share its batch or
micro-batch, and a group that shares its initial noise stays identical up to each row's first stochastic step."""

from __future__ import annotations

import pytest
import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.request import SampleRequest, positions_in_groups, run_request, sample_batch
from diffrl.sampling.rollout import sample_trajectories

K = 4


def _settings(**kw) -> SamplerConfig:
    return SamplerConfig(num_steps=K, noise_level=0.8, **kw)


def _row_masks() -> tuple[torch.Tensor, torch.Tensor]:
    """Row r is stochastic (and trained) at step r % K only: the branching layout of TempFlow-GRPO; row 5 also takes a
    stochastic untrained step after its trained one."""
    trained = torch.zeros(6, K, dtype=torch.bool)
    for r in range(6):
        trained[r, r % K] = True
    stochastic = trained.clone()
    stochastic[5, 3] = True
    return trained, stochastic


@pytest.mark.parametrize("ode_solver", ["ode", "dpm2"])
def test_each_row_samples_as_it_does_alone(tiny_adapter, ode_solver):
    """One batch with per-row masks (micro-batches of 4 cutting the rows 4 + 2) equals each row sampled alone with its
    own ``[K]`` masks: latents, log-probs (0 at its ODE steps), means and the per-row ``sde_mask``."""
    trained, stochastic = _row_masks()
    prompts = ["a red seven", "a blue two"] * 3
    seeds = list(range(40, 46))
    settings = _settings(ode_solver=ode_solver)
    together = sample_trajectories(tiny_adapter, prompts, settings=settings, seeds=seeds, sde_mask=trained, stochastic_mask=stochastic,
                                   init_seeds=[7] * 6, micro_batch_size=4, record_means=True)
    assert torch.equal(together["sde_mask"], trained)
    for r in range(6):
        alone = sample_trajectories(tiny_adapter, prompts[r : r + 1], settings=settings, seeds=seeds[r : r + 1], sde_mask=trained[r],
                                    stochastic_mask=stochastic[r], init_seeds=[7], record_means=True)
        torch.testing.assert_close(together["latents"][r], alone["latents"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(together["log_probs"][r], alone["log_probs"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together["means"][r], alone["means"][0], rtol=1e-5, atol=1e-6)
        assert bool((together["log_probs"][r][~stochastic[r]] == 0).all()) and bool((together["log_probs"][r][stochastic[r]] != 0).all())


def test_shared_initial_noise_rows_identical_until_their_stochastic_step(tiny_adapter):
    """Rows of one prompt with one initial noise: equal latents up to (and including) the input of each row's first
    stochastic step; two rows branching at the same step with different seeds differ from there on."""
    trained = torch.zeros(4, K, dtype=torch.bool)
    trained[0, 1] = trained[1, 1] = trained[2, 2] = trained[3, 2] = True
    td = sample_trajectories(tiny_adapter, ["a red seven"] * 4, settings=_settings(), seeds=[1, 2, 3, 4], sde_mask=trained, init_seeds=[9] * 4)
    lat = td["latents"]
    for a in range(4):
        for b in range(4):
            first = min(int(trained[a].nonzero()[0]), int(trained[b].nonzero()[0]))
            assert torch.equal(lat[a, : first + 1], lat[b, : first + 1])  # the shared ODE prefix
            if a != b:
                assert not torch.allclose(lat[a, first + 1 :], lat[b, first + 1 :])


def test_request_expands_a_group_layout_to_rows(tiny_adapter):
    """``group_trained [G, K]`` becomes ``trained_rows [B, K]`` by each row's position in its group (rows of a group in
    any order); a chunk of the request (async reward chunks, data-parallel workers) carries its own rows' masks, and the
    worker samples them."""
    layout = torch.tensor([[True, False, False, False], [False, False, True, False], [False, True, False, False]])
    group_id = torch.tensor([0, 0, 0, 1, 1, 1])
    request = SampleRequest(trained=layout.any(0), stochastic=layout.any(0), group_trained=layout)
    batch = sample_batch(["a red seven"] * 3 + ["a blue two"] * 3, list(range(6)), request, group_id=group_id, init_seeds=[5, 5, 5, 6, 6, 6])
    assert torch.equal(batch["trained_rows"], layout.repeat(2, 1)) and torch.equal(batch["stochastic_rows"], layout.repeat(2, 1))
    second = batch[3:]
    td = run_request(tiny_adapter, _settings(), second)
    assert torch.equal(td["sde_mask"], layout)
    assert torch.equal(positions_in_groups(torch.tensor([2, 0, 2, 0]), 2), torch.tensor([0, 0, 1, 1]))


def test_layout_errors_are_one_line():
    layout = torch.eye(K, dtype=torch.bool)[:2]
    with pytest.raises(ValueError, match="groups of 2 rows got groups of \\[1, 3\\]"):
        sample_batch(["a"] * 4, [0, 1, 2, 3], SampleRequest(group_trained=layout), group_id=torch.tensor([0, 0, 0, 1]))
    with pytest.raises(ValueError, match="does not draw stochastically"):
        SampleRequest(group_trained=layout, group_stochastic=torch.zeros_like(layout))
    with pytest.raises(ValueError, match="needs group_trained"):
        SampleRequest(group_stochastic=layout)


def test_per_row_mask_errors(tiny_adapter):
    trained, _ = _row_masks()
    with pytest.raises(ValueError, match=r"\[4\] or \[6, 4\]"):
        sample_trajectories(tiny_adapter, ["a"] * 6, settings=_settings(), seeds=list(range(6)), sde_mask=trained[:, :3])
    with pytest.raises(ValueError, match="random_per_sample"):
        sample_trajectories(tiny_adapter, ["a"] * 6, settings=_settings(window="random_per_sample"), seeds=list(range(6)), sde_mask=trained)
    with pytest.raises(ValueError, match="not stochastic"):
        sample_trajectories(tiny_adapter, ["a"] * 6, settings=_settings(), seeds=list(range(6)), sde_mask=trained,
                            stochastic_mask=torch.zeros(K, dtype=torch.bool))
