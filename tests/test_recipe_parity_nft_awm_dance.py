"""Loss parity of three published recipes with their peers' training code (issue 50): DiffusionNFT
(``sd35m_multi_reward_nft``), AWM (``sd35m_geneval_awm``) and DanceGRPO (``flux_hpsv2_dance_grpo``).

Each recipe is composed as published (``+shrink=tiny`` only changes sizes), its algorithm and objective are built as
the trainer builds them, and one fixed float64 batch goes through the engine's own per-micro-batch loop
(``DiffusionEngine._pieces``, weighted as ``train_batch`` weighs them) on a tiny float64 velocity model, and through a
reference written here from the peer's published formula (file:line cited at each reference; peers at NVlabs/DiffusionNFT
@24af555, scxue/advantage_weighted_matching @be51372, XueZeyue/DanceGRPO @15cc71d). Loss and gradients must agree to
1e-10 relative where our code path computes in float64 (the NFT and AWM objectives); the reward → advantage step is
checked at float32 precision (``diffrl.algorithms.advantages`` computes in float32), and DanceGRPO's update at float32
precision (the SDE step, ``diffrl.sampling.sde``, and the step loss compute in float32 by contract). The random draws
(noise, noise levels, trained steps) are ours; their distributions are checked against the peers' separately.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from tensordict import TensorDict

from diffrl.algorithms import build_algorithm
from diffrl.algorithms.awm import stratified_levels
from diffrl.algorithms.losses import nft_reward_to_r
from diffrl.algorithms.objectives import objective_noise, schedule_levels
from diffrl.engine.engine import DiffusionEngine
from diffrl.recipes import compose, to_config
from diffrl.run_rewards import build_trained_rewards
from diffrl.run_setup import run_context
from diffrl.sampling.rollout import _trained_rows
from diffrl.sampling.schedules import build_window, per_sample_trained
from diffrl.sampling.seeding import Stream, generator
from rewards.base import score

pytestmark = pytest.mark.usefixtures("single_thread")

F64 = torch.float64
SHAPE = (2, 2, 2)  # latent [C, H, W]
COND = 3


def recipe(name: str, *extra: str):
    cfg = to_config(compose([f"experiment={name}", "+shrink=tiny", *extra]))
    return cfg, build_algorithm(cfg.algorithm, run_context(cfg))


class Velocity(torch.nn.Module):
    """A tiny float64 velocity model: ``v = tanh(x W) + σ·a + c P`` on flattened latents."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        dim = math.prod(SHAPE)
        self.w = torch.nn.Parameter(0.4 * torch.randn(dim, dim, generator=g, dtype=F64))
        self.a = torch.nn.Parameter(torch.randn(dim, generator=g, dtype=F64))
        self.p = torch.nn.Parameter(0.4 * torch.randn(COND, dim, generator=g, dtype=F64))

    def forward(self, x, sigma, cond):
        flat = x.reshape(x.shape[0], -1).to(F64)
        sigma = torch.as_tensor(sigma, dtype=F64).reshape(-1).expand(x.shape[0])
        return (torch.tanh(flat @ self.w) + sigma[:, None] * self.a + cond["emb"].to(F64) @ self.p).reshape(x.shape)


class Adapter:
    prediction_type = "flow"
    device = torch.device("cpu")

    def __init__(self, net):
        self.net, self.calls = net, 0

    def predict(self, x, sigma, cond, guidance_scale):
        self.calls += 1
        return self.net(x, sigma, cond)


class Engine:
    """What ``DiffusionEngine._pieces`` and the objectives use of an engine, around float64 models; the engine's own
    methods do the work."""

    _pieces = DiffusionEngine._pieces
    _per_row_step_pieces = DiffusionEngine._per_row_step_pieces
    _step_outputs = DiffusionEngine._step_outputs
    reference_policy = DiffusionEngine.reference_policy
    _score_step = DiffusionEngine._score_step
    _trained_steps = DiffusionEngine._trained_steps

    def __init__(self, sampler, current, old, ref):
        self.sampler, self.adapter, self._old, self._ref = sampler, Adapter(current), Adapter(old), Adapter(ref)

    @contextlib.contextmanager
    def old_policy(self):
        yield self._old

    @contextlib.contextmanager
    def reference(self):
        yield self._ref


def engine_loss(engine, loss_fn, batch: TensorDict, seed: int, micro_batch_size: int | None):
    """``DiffusionEngine.train_batch``'s loss: each piece weighted by its micro-batch's share and its own weight."""
    size = micro_batch_size or batch.shape[0]
    total = torch.zeros((), dtype=F64)
    for start in range(0, batch.shape[0], size):
        micro = batch[start : start + size]
        share = micro.shape[0] / batch.shape[0]
        for loss, weight, _ in engine._pieces(loss_fn, micro, seed):
            total = total + loss * share * weight
    return total


def grads(net, loss) -> torch.Tensor:
    net.zero_grad()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def assert_rel(ours, ref, tol):
    ours, ref = torch.as_tensor(ours, dtype=F64), torch.as_tensor(ref, dtype=F64)
    err = float((ours - ref).detach().abs().max() / ref.detach().abs().max().clamp_min(1e-300))
    assert err <= tol, (err, tol)


def shifted_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """SD3 / FLUX's shifted schedule ``shift·s / (1 + (shift − 1)·s)`` over ``linspace(1, 0, K + 1)``."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=F64)
    return shift * s / (1 + (shift - 1) * s)


def clean_batch(num_steps: int, group_size: int, prompts: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    B = group_size * prompts
    return TensorDict({
        "latents": torch.randn(B, num_steps + 1, *SHAPE, generator=g, dtype=F64),
        "sigmas": shifted_sigmas(num_steps).expand(B, -1).clone(),
        "cond": TensorDict({"emb": torch.randn(B, COND, generator=g, dtype=F64)}, batch_size=[B]),
        "group_id": torch.arange(prompts).repeat_interleave(group_size),
        "seeds": torch.arange(1000, 1000 + B),
    }, batch_size=[B])


def peer_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """PerPromptStatTracker(global_std=True): per-prompt mean, population std of all rewards + 1e-4 (DiffusionNFT
    flow_grpo/stat_tracking.py:L26-31; AWM advantage_weighted_matching/flow_grpo/stat_tracking.py:L26-31)."""
    r = rewards.to(F64)
    std = r.std(unbiased=False) + 1e-4
    out = torch.empty_like(r)
    for g in group_id.unique():
        m = group_id == g
        out[m] = (r[m] - r[m].mean()) / std
    return out


# ------------------------------------------------------------------------------------------------------------------
# DiffusionNFT
# ------------------------------------------------------------------------------------------------------------------


def nft_peer_loss(theta, old, ref, batch, t_levels, noise, r, *, beta, adv_clip_max, kl_beta, micro):
    """scripts/train_nft_sd3.py:L853-983: per micro-batch and trained timestep j, x_t = (1 − t)·x0 + t·ε (L864-870),
    v⁺ = β·v + (1 − β)·v_old, v⁻ = (1 + β)·v_old − β·v (L934-937), x0-space errors divided by the detached
    mean |x̂0 − x0| clipped at 1e-5 (L939-957), policy = mean(adv_clip_max·(r·e⁺ + (1 − r)·e⁻)/β) (L959-960),
    loss = policy + kl_beta·mean (v − v_ref)² (L966-970), divided by accumulation steps × timesteps (L801, L983)."""
    B, T = t_levels.shape
    dims = tuple(range(1, 1 + len(SHAPE)))
    n_micro = B // micro
    total = torch.zeros((), dtype=F64)
    for start in range(0, B, micro):
        rows = slice(start, start + micro)
        x0, cond, rr = batch["latents"][rows, -1], batch["cond"][rows], r[rows]
        for j in range(T):
            t = t_levels[rows, j]
            te = t.view(-1, 1, 1, 1)
            xt = (1 - te) * x0 + te * noise[j][rows]
            with torch.no_grad():
                old_pred, ref_pred = old(xt, t, cond), ref(xt, t, cond)
            fwd = theta(xt, t, cond)
            pos = beta * fwd + (1 - beta) * old_pred
            neg = (1.0 + beta) * old_pred - beta * fwd
            x0_pos, x0_neg = xt - te * pos, xt - te * neg
            with torch.no_grad():
                w_pos = (x0_pos - x0).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
                w_neg = (x0_neg - x0).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            positive = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
            negative = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)
            policy = ((rr * positive / beta + (1.0 - rr) * negative / beta) * adv_clip_max).mean()
            kl = ((fwd - ref_pred) ** 2).mean(dim=dims).mean()
            total = total + (policy + kl_beta * kl) / (n_micro * T)
    return total


def test_nft_multi_reward_recipe_matches_diffusionnft():
    cfg, algorithm = recipe("sd35m_multi_reward_nft")
    a = algorithm.config
    assert (a.nft_policy_scale, a.adv_clip_max, a.nft_beta, a.kl_beta, a.nft_num_timesteps) == (5.0, 5.0, 0.1, 1e-4, 24)
    assert cfg.reward.options["pickscore"]["divisor"] == 26.0 and list(cfg.reward.weights) == [1.0, 1.0, 1.0]
    K, G, P = cfg.sampler.num_steps, cfg.trainer.group_size, cfg.trainer.prompts_per_step
    batch = clean_batch(K, G, P)
    B = batch.shape[0]

    # rewards → r: PickScore / 26 (flow_grpo/pickscore_scorer.py:L50), summed with weights 1 (flow_grpo/rewards.py:L295-302),
    # advantages clipped at 5 and mapped to r = clip(A/5)/2 + 1/2 (train_nft_sd3.py:L910-929)
    rewards = build_trained_rewards(cfg.reward)
    images = torch.randint(0, 256, (B, 3, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    prompts = [f"prompt {int(g)}" for g in batch["group_id"]]
    scores = score(rewards, images, prompts)
    raw = rewards["pickscore"][0].__class__(**{**cfg.reward.options["pickscore"], "divisor": 1.0})(images, prompts)["pickscore"]
    assert torch.equal(scores["reward/pickscore"], raw / 26)
    peer_avg = raw.double() / 26 + scores["reward/hpsv2"].double() + scores["reward/clip_score"].double()
    assert_rel(scores["rewards"], peer_avg, 1e-6)
    r = nft_reward_to_r(scores["rewards"], batch["group_id"], adv_clip_max=a.adv_clip_max, std_mode=a.adv_std_mode, eps=a.adv_eps)
    r_peer = (peer_advantages(peer_avg, batch["group_id"]).clamp(-5, 5) / 5 / 2.0 + 0.5).clamp(0, 1)
    assert_rel(r, r_peer, 1e-5)  # float32 advantages
    batch["nft_r"] = r.to(F64)

    theta, old, ref = Velocity(0), Velocity(1), Velocity(2)
    engine = Engine(cfg.sampler, theta, old, ref)
    seed, micro = 7, 3
    ours = engine_loss(engine, algorithm.objective(), batch, seed, micro)
    g_ours = grads(theta, ours)

    # the same noise levels and noise: each sample its own random 24 of the 25 levels (train_nft_sd3.py:L569, L810-816)
    levels = schedule_levels(batch["sigmas"][0], batch["seeds"], seed, a.nft_num_timesteps)  # [T, B]
    for i in range(B):
        assert len(set(levels[:, i].tolist())) == 24 and set(levels[:, i].tolist()) <= set(batch["sigmas"][0, :-1].tolist())
    noise = [objective_noise(batch["seeds"], seed, j, SHAPE, "cpu") for j in range(levels.shape[0])]
    reference = nft_peer_loss(theta, old, ref, batch, levels.T.contiguous(), noise, batch["nft_r"], beta=a.nft_beta,
                              adv_clip_max=a.adv_clip_max, kl_beta=a.kl_beta, micro=micro)
    g_ref = grads(theta, reference)
    assert_rel(ours, reference, 1e-10)
    assert_rel(g_ours, g_ref, 1e-10)
    # at nft_policy_scale 1 (today's default elsewhere) the KL weighs 5x more against the policy term: not the peer's
    algorithm.config.nft_policy_scale = 1.0
    unscaled = engine_loss(engine, algorithm.objective(), batch, seed, micro)
    assert float((unscaled - reference).detach().abs()) > 1e-3 * float(reference.detach().abs())


# ------------------------------------------------------------------------------------------------------------------
# AWM
# ------------------------------------------------------------------------------------------------------------------


def awm_peer_indices(num_steps: int, fraction: float, n: int, u: torch.Tensor) -> torch.Tensor:
    """scripts/train_sd3_awm.py:L1197-1205 (time_type "discrete_wo_init"): boundaries linspace(1, int(K·fraction), n + 1)
    truncated, one index lower + int(u·(upper − lower)) per stratum, shared by the micro-batch (repeat_interleave)."""
    boundaries = torch.linspace(1, int(num_steps * fraction), steps=n + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return lower + (u * (upper - lower)).long()


def awm_peer_loss(theta, ref, ema, batch, t_per_micro, noise, advantages, *, micro, p, beta, ema_beta, adv_clip_max, advantage_max):
    """scripts/train_sd3_awm.py:L1231-1352 (on-policy: old log-probs are the detached current ones, L1282-1284):
    log p = −((mean (v − (ε − x0))² + 1e-10)^p − 1e-10^p)·t/p (L234-249), A = clip(A, ±5)/5·advantage_max (L1293-1299),
    ratio = exp(log p − old), policy = mean max(−A·ratio, −A·clip(ratio, 0, 2)) over T × B (L1305-1327), KL and EMA-KL
    "Uniform" velocity MSEs (L1330-1350); accelerate averages the micro-batches (gradient_accumulation_steps)."""
    B = batch.shape[0]
    dims = tuple(range(1, 1 + len(SHAPE)))
    n_micro = B // micro
    A_all = advantages.to(F64).clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max
    total = offset = torch.zeros((), dtype=F64)
    for m, start in enumerate(range(0, B, micro)):
        rows = slice(start, start + micro)
        x0, cond, A = batch["latents"][rows, -1], batch["cond"][rows], A_all[rows]
        t = t_per_micro[m]  # [T]
        log_probs, outs, refs, emas = [], [], [], []
        for j in range(len(t)):
            tj = t[j].expand(x0.shape[0])
            xt = (1 - tj.view(-1, 1, 1, 1)) * x0 + tj.view(-1, 1, 1, 1) * noise[j][rows]
            out = theta(xt, tj, cond)
            with torch.no_grad():
                refs.append(ref(xt, tj, cond))
                emas.append(ema(xt, tj, cond))
            lp = -((out - (noise[j][rows] - x0)) ** 2).mean(dim=dims)
            lp = -(torch.pow(-lp + 1e-10, p) - torch.pow(torch.tensor(1e-10, dtype=F64), p)) * tj / p
            log_probs.append(lp)
            outs.append(out)
        log_probs = torch.stack(log_probs).view(-1)
        ratio = torch.exp(log_probs - log_probs.detach())
        A_rep = A.unsqueeze(0).repeat(len(t), 1).view(-1)
        policy = torch.mean(torch.maximum(-A_rep * ratio, -A_rep * torch.clamp(ratio, 1.0 - 1, 1.0 + 1)))
        outs = torch.stack(outs)
        kl = ((outs - torch.stack(refs)) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
        ema_kl = ((outs - torch.stack(emas)) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
        total = total + (policy + beta * kl + ema_beta * ema_kl) / n_micro
        # the surrogate's value is −mean Â (ratio 1); diffrl's loss has the value mean Â·ℓ with ℓ = −log p, same gradient
        offset = offset + ((A_rep * -log_probs).mean() + A_rep.mean()).detach() / n_micro
    return total, offset


def test_awm_stratified_levels_follow_the_reference_draw():
    """One index per stratum of [1, int(14·0.9) = 12): {1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, each uniform inside its
    stratum, shared by the micro-batch; never step 0 (σ = 1) nor steps 12, 13."""
    sigmas = shifted_sigmas(14)
    strata = [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    counts = torch.zeros(14)
    for s in range(400):
        gen = generator(s, Stream.NFT_TIMESTEPS, 0)
        u = torch.rand(6, generator=generator(s, Stream.NFT_TIMESTEPS, 0))
        levels = stratified_levels(sigmas, 6, 0.9, gen)
        index = awm_peer_indices(14, 0.9, 6, u)
        assert torch.equal(levels, sigmas[index])
        for k, stratum in zip(index.tolist(), strata):
            assert k in stratum
        counts[index] += 1
    for a_, b_ in ((2, 3), (4, 5), (6, 7), (8, 9), (10, 11)):
        assert abs(counts[a_] - counts[b_]) < 0.25 * 400  # uniform inside a stratum (400 draws: ±3.5 sd ≈ ±70)
    assert counts[0] == counts[12] == counts[13] == 0 and counts[1] == 400


def test_awm_geneval_recipe_matches_advantage_weighted_matching():
    cfg, algorithm = recipe("sd35m_geneval_awm", "algorithm.micro_batch_size=3")
    a = algorithm.config
    assert (a.adv_clip_max, a.awm_advantage_max, a.kl_beta, a.awm_ema_beta, a.awm_timestep_sampling, a.awm_timestep_fraction) == (
        5.0, 1.0, 0.001, 1.0, "stratified", 0.9)
    assert algorithm.needs_old_policy
    K, G, P = cfg.sampler.num_steps, cfg.trainer.group_size, cfg.trainer.prompts_per_step
    batch = clean_batch(K, G, P, seed=3)
    B = batch.shape[0]

    # advantages: per-prompt mean, global std + 1e-4 (stat_tracking.py:L26-31, dgx_awm.py:L72), geneval weight 1; the clip at
    # ±5 and the scaling happen in the loss (train_sd3_awm.py:L1293-1299)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 0.25], dtype=F64)
    advantages = algorithm.advantages({"rewards": rewards, "reward/geneval": rewards}, batch["group_id"], [None] * B)
    assert_rel(advantages, peer_advantages(rewards, batch["group_id"]).clamp(-5, 5), 1e-10)
    batch["advantages"] = advantages

    theta, ema, ref = Velocity(0), Velocity(4), Velocity(2)
    engine = Engine(cfg.sampler, theta, ema, ref)
    seed, micro = 11, int(cfg.algorithm.micro_batch_size)
    objective = algorithm.objective()
    ours = engine_loss(engine, objective, batch, seed, micro)
    g_ours = grads(theta, ours)

    t_per_micro = []
    for start in range(0, B, micro):
        u = torch.rand(a.awm_num_timesteps, generator=generator(seed, Stream.NFT_TIMESTEPS, int(batch["seeds"][start])))
        t_per_micro.append(batch["sigmas"][0][awm_peer_indices(K, a.awm_timestep_fraction, a.awm_num_timesteps, u)])
    noise = [objective_noise(batch["seeds"], seed, j, SHAPE, "cpu") for j in range(a.awm_num_timesteps)]
    reference, offset = awm_peer_loss(theta, ref, ema, batch, t_per_micro, noise, batch["advantages"], micro=micro, p=a.awm_ghuber_power,
                                      beta=a.kl_beta, ema_beta=a.awm_ema_beta, adv_clip_max=a.adv_clip_max, advantage_max=a.awm_advantage_max)
    g_ref = grads(theta, reference)
    assert_rel(g_ours, g_ref, 1e-10)
    assert_rel(ours, reference + offset, 1e-10)  # the values differ by the PPO surrogate's constant (awm_loss's docstring)


# ------------------------------------------------------------------------------------------------------------------
# DanceGRPO
# ------------------------------------------------------------------------------------------------------------------


def test_dance_grpo_trains_its_own_9_of_the_first_15_steps_per_sample():
    """fastvideo/train_grpo_flux.py:L506-519 drop the last of the 16 steps; L551-572 train, per sample, the first
    int(15·0.6) = 9 of its own randperm of the 15."""
    cfg, _ = recipe("flux_hpsv2_dance_grpo")
    window = build_window(cfg.sampler, cfg.trainer.seed)
    masks = window.masks(0)
    assert masks.stochastic.all() and masks.trained.tolist() == [True] * 15 + [False] and masks.per_sample == 9
    seeds = list(range(5000, 7000))
    rows = _trained_rows(cfg.sampler, masks.trained, seeds)
    assert rows.shape == (2000, 16) and bool((rows.sum(1) == 9).all()) and not bool(rows[:, 15].any())
    assert torch.equal(rows[:7], _trained_rows(cfg.sampler, masks.trained, seeds[:7]))  # a sample's steps do not depend on its batch
    freq = rows[:, :15].double().mean(0)
    assert bool(((freq - 0.6).abs() < 0.05).all())  # each of the 15 steps trained with probability 9/15
    # independent across samples: consecutive rows agree on a step as often as independent draws do (0.6² + 0.4² = 0.52)
    agree = (rows[1:, :15] == rows[:-1, :15]).double().mean()
    assert abs(float(agree) - 0.52) < 0.02
    expected = 5005 * (1 - (1 - 1 / 5005) ** 2000)  # distinct subsets among 2000 uniform draws of the C(15, 9) = 5005: ≈ 1649
    assert abs(len({tuple(r.tolist()) for r in rows}) - expected) < 60


def dance_peer_log_prob(v, x, x_next, sigma, sigma_next, eta):
    """fastvideo/train_grpo_flux.py:L131-168 (flux_step, sde_solver=True): mean = x + dσ·v − ½η²·score·dσ with
    score = −(x − x̂0·(1 − σ))/σ², x̂0 = x − σ·v; std = η·√Δt; log-prob averaged over the non-batch dims."""
    s, dsigma = sigma.view(-1, 1, 1, 1), (sigma_next - sigma).view(-1, 1, 1, 1)
    mean = x + dsigma * v
    x0 = x - s * v
    score_estimate = -(x - x0 * (1 - s)) / s**2
    mean = mean + (-0.5 * eta**2 * score_estimate) * dsigma
    std = eta * torch.sqrt(-dsigma)
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(torch.as_tensor(2 * math.pi, dtype=F64)))
    return lp.mean(dim=(1, 2, 3))


def test_dance_grpo_flux_recipe_matches_dancegrpo():
    cfg, algorithm = recipe("flux_hpsv2_dance_grpo")
    a, s = algorithm.config, cfg.sampler
    assert (s.kind, s.noise_level, s.num_steps, s.window, a.clip_range, a.adv_clip_max, a.kl_beta) == ("dance_sde", 0.3, 16, "random_per_sample", 1e-4, 5.0, 0.0)
    K, G, P = s.num_steps, cfg.trainer.group_size, cfg.trainer.prompts_per_step
    batch = clean_batch(K, G, P, seed=5)
    B, eta = batch.shape[0], s.noise_level
    old, theta = Velocity(3), Velocity(0)
    g = torch.Generator().manual_seed(9)
    sig = batch["sigmas"]
    with torch.no_grad():  # a trajectory of the old policy, and its log-probs nudged inside / outside the clip range
        lat = [torch.randn(B, *SHAPE, generator=g, dtype=F64)]
        for k in range(K):
            v = old(lat[-1], sig[:, k], batch["cond"])
            s_, ds = sig[:, k].view(-1, 1, 1, 1), (sig[:, k + 1] - sig[:, k]).view(-1, 1, 1, 1)
            mean = lat[-1] + ds * v - 0.5 * eta**2 * (-(lat[-1] - (lat[-1] - s_ * v) * (1 - s_)) / s_**2) * ds
            lat.append(mean + eta * torch.sqrt(-ds) * torch.randn(B, *SHAPE, generator=g, dtype=F64))
        batch["latents"] = torch.stack(lat, 1)
        current = torch.stack([dance_peer_log_prob(theta(lat[k], sig[:, k], batch["cond"]), lat[k], lat[k + 1], sig[:, k], sig[:, k + 1], eta)
                               for k in range(K)], 1)
        nudge = torch.where(torch.rand(B, K, generator=g) < 0.5, 5e-5, 3e-4) * torch.where(torch.rand(B, K, generator=g) < 0.5, 1.0, -1.0)
    batch["log_probs"] = (current + nudge.to(F64)).float()  # the rollout records float32 log-probs
    batch["sde_mask"] = per_sample_trained(build_window(cfg.sampler, cfg.trainer.seed).masks(0).trained, 9, batch["seeds"].tolist())

    # advantages: per prompt, (r − mean)/(std + 1e-8) with torch's unbiased std (train_grpo_flux.py:L533-545), clipped at 5
    rewards = torch.tensor([0.30, 0.25, 0.27, 0.31, 0.22, 0.26], dtype=F64)
    assert a.adv_std_ddof == 1.0
    ours_adv = algorithm.advantages({"rewards": rewards, "reward/hpsv2": rewards}, batch["group_id"], [None] * B)
    peer_adv = torch.empty(B, dtype=F64)
    for grp in batch["group_id"].unique():
        m = batch["group_id"] == grp
        peer_adv[m] = (rewards[m] - rewards[m].mean()) / (rewards[m].std() + 1e-8)
    assert_rel(ours_adv, peer_adv.clamp(-5, 5), 1e-10)
    batch["advantages"] = ours_adv

    engine = Engine(s, theta, None, None)
    mini = batch[: int(cfg.algorithm.mini_batch_size)]  # one optimizer step's mini-batch (the recipe's 3 per RL step: 2 of the 6 rows)
    assert not torch.equal(mini["sde_mask"][0], mini["sde_mask"][1])  # rows that train different steps
    ours = engine_loss(engine, algorithm.objective(), mini, 0, None)
    g_ours = grads(theta, ours)
    assert engine.adapter.calls == 9  # one forward of all rows per trained step: the same on every FSDP rank

    # train_grpo_flux.py:L571-613: per sample (micro-batch 1) and each of its trained steps, ratio = exp(new − old),
    # max(−A·ratio, −A·clip(ratio, 1 ± 1e-4)) with A clipped at 5, divided by accumulation steps × 9; the ranks average
    reference = torch.zeros((), dtype=F64)
    for i in range(mini.shape[0]):
        A = mini["advantages"][i].clamp(-a.adv_clip_max, a.adv_clip_max)
        steps = mini["sde_mask"][i].nonzero().squeeze(1).tolist()
        for k in steps:
            x, x_next = mini["latents"][i : i + 1, k], mini["latents"][i : i + 1, k + 1]
            new = dance_peer_log_prob(theta(x, mini["sigmas"][i : i + 1, k], mini["cond"][i : i + 1]), x, x_next,
                                      mini["sigmas"][i : i + 1, k], mini["sigmas"][i : i + 1, k + 1], eta)
            ratio = torch.exp(new - mini["log_probs"][i : i + 1, k].to(F64))
            loss = torch.mean(torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1.0 - a.clip_range, 1.0 + a.clip_range)))
            reference = reference + loss / (mini.shape[0] * len(steps))
    g_ref = grads(theta, reference)
    assert float(g_ref.abs().max()) > 0  # some ratios inside the clip range: a real gradient
    assert_rel(ours, reference, 1e-5)  # float32 SDE step and step loss (diffrl.sampling.sde's contract)
    assert_rel(g_ours, g_ref, 1e-5)
