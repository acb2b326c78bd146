"""Loss parity of the Flow-GRPO-family published recipes with their peers' published update (issue 50).

For each recipe, one fixed float64 batch (latents, step means, step stds, behaviour log-probs, reference means,
rewards, prompt groups) goes through

* ours: the recipe composed with ``+shrink=tiny`` (4 prompts x 4 samples, the recipe's algorithm, sampler window
  and values), its algorithm's ``update`` (advantages from the rewards and groups, the dropped samples, the mini-batches)
  with the worker group replaced by a recorder, and each recorded mini-batch's loss as the engine composes it
  (``DiffusionEngine._pieces``: the objective at every trained step, weighted by 1/steps);
* the peer: a reference written here from the peer's published code (file and line cited at each function; written
  for this test, not copied), on the same mini-batch rows;

and asserts the same advantages, the same kept rows, equal losses and equal gradients w.r.t. the predicted step means
(<= 1e-10 relative). Peers: yifan123/flow_grpo @879042c (train_sd3.py, train_sd3_fast.py, train_flux_kontext.py,
train_wan2_1.py, flow_grpo/stat_tracking.py, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
wan_pipeline_with_logprob.py) and verl-project/verl-omni @a1139ba (verl_omni/trainer/diffusion/diffusion_algos.py).
The EMA cadence of ``eval.ema_cadence=optimizer_step`` is checked on a real run at the end.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.algorithms import build_algorithm
from diffrl.engine.engine import DiffusionEngine
from diffrl.recipes import compose
from diffrl.run_setup import run_context
from diffrl.sampling.schedules import build_window
from diffrl.sampling.sde import StepOutput, cps_step, gaussian_log_prob

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS_PER_STEP, GROUP_SIZE = 4, 4
B = PROMPTS_PER_STEP * GROUP_SIZE
SHAPE = (2, 3, 3)  # a latent's non-batch dims
TOL = 1e-10


# -- the fixed batch -----------------------------------------------------------------------------------------------
def _sigmas(num_steps: int) -> torch.Tensor:
    """``[K + 1]`` a shifted flow schedule from 1 to 0 (shift 3, as SD3.5's scheduler)."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return 3 * s / (1 + 2 * s)


def _rewards() -> torch.Tensor:
    """``[B]`` dyadic rewards (exact in any order of summation) of 4 groups of 4: an all-equal group, a group in which two
    rewards equal the group's mean, and two groups with spread."""
    g = torch.Generator().manual_seed(1)
    free = torch.randint(0, 64, (8,), generator=g).double() / 64
    return torch.cat([torch.full((4,), 0.5, dtype=torch.float64), torch.tensor([0.0, 0.5, 1.0, 0.5], dtype=torch.float64), free])


def flow_sde_std_dev_t(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float) -> torch.Tensor:
    """flow_grpo sd3_sde_with_logprob.py:L46-50: ``std_dev_t = a·sqrt(σ/(1 − σ))`` with ``σ = 1`` replaced in the
    denominator by ``sigmas[1]`` (the sigma after 1, i.e. this step's next sigma)."""
    return torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_next, sigma))) * noise_level


def wan_std_dev_t(sigma: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """flow_grpo wan_pipeline_with_logprob.py:L47-51: ``std_dev_t = σ_min + (σ_max − σ_min)·σ`` with ``σ_max = sigmas[1]``,
    ``σ_min = sigmas[-1]`` (no noise level)."""
    return sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma


def make_batch(cfg, seed: int = 0) -> dict:
    """The fixed float64 batch for recipe ``cfg``: everything a trained step of the engine and the peer needs."""
    s = cfg.sampler
    K = int(s.num_steps)
    g = torch.Generator().manual_seed(seed)
    sigmas = _sigmas(K)
    sigma, sigma_next = sigmas[:-1], sigmas[1:]
    dt = sigma - sigma_next  # > 0
    if cfg.experiment.startswith("wan21"):
        std_dev_t = wan_std_dev_t(sigma, sigmas)  # the peer's Wan step; fed to both sides (the recipe's header declares our flow_sde)
        std = std_dev_t * dt.sqrt()
    elif s.kind == "cps":
        std_dev_t = sigma_next * math.sin(float(s.noise_level) * math.pi / 2)  # sd3_sde_with_logprob.py:L71
        std = std_dev_t
    else:
        std_dev_t = flow_sde_std_dev_t(sigma, sigma_next, float(s.noise_level))
        std = std_dev_t * dt.sqrt()
    means = torch.randn(B, K, *SHAPE, generator=g, dtype=torch.float64)
    ref_means = means + 0.05 * torch.randn(B, K, *SHAPE, generator=g, dtype=torch.float64)
    view = (1, K) + (1,) * len(SHAPE)
    noise = torch.randn(B, K, *SHAPE, generator=g, dtype=torch.float64)
    x_next = means + std.clamp_min(1e-3).view(view) * noise  # the recorded next latents
    latents = torch.cat([torch.randn(B, 1, *SHAPE, generator=g, dtype=torch.float64), x_next], dim=1)
    clip = PEERS[cfg.experiment]["clip"]
    # behaviour log-probs: the current ones shifted by up to 2 of the peer's clip ranges: some ratios clipped, some not
    shift = (torch.rand(B, K, generator=g, dtype=torch.float64) * 4 - 2) * clip
    rewards = _rewards()
    if len(cfg.reward.names) == 2:  # Kontext: 0.5·source_similarity + 0.5·geneval, the weighted sum equal to `rewards` exactly
        geneval = torch.randint(0, 64, (B,), generator=g).double() / 64
        per_reward = {"geneval": geneval, "source_similarity": 2 * rewards - geneval}
    else:
        per_reward = {cfg.reward.names[0]: rewards}
    return {"sigmas": sigmas, "std": std, "std_dev_t": std_dev_t, "dt": dt, "means": means, "ref_means": ref_means,
            "x_next": x_next, "latents": latents, "shift": shift, "rewards": rewards, "per_reward": per_reward,
            "group_id": torch.arange(PROMPTS_PER_STEP).repeat_interleave(GROUP_SIZE), "kind": s.kind}


def _step_log_prob(kind: str, x_next, mean, std) -> torch.Tensor:
    """Our step's log-prob of the recorded next latent (diffrl.sampling.sde): flow_sde's ``gaussian_log_prob``; cps's
    unnormalised ``−mean_dims (x_next − mean)²`` (``cps_step``, fp32 only: checked against it in ``test_cps_log_prob_...``)."""
    if kind == "cps":
        return -((x_next - mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return gaussian_log_prob(x_next, mean, std.expand_as(mean))


def _behaviour_log_probs(data: dict) -> torch.Tensor:
    """``[B, K]`` rollout log-probs: the current policy's, shifted (``data["shift"]``)."""
    K = data["means"].shape[1]
    with torch.no_grad():
        cols = [_step_log_prob(data["kind"], data["x_next"][:, k], data["means"][:, k], data["std"][k].reshape(1, 1, 1, 1)) for k in range(K)]
    return torch.stack(cols, dim=1) + data["shift"]


# -- ours: the recipe's algorithm and the engine's loss composition ------------------------------------------------
class RecordingWorkers:
    """A worker group of one rank that records each ``update_actor`` batch (the mini-batches the algorithm laid out)."""

    dp_size = 1
    world_size = 1

    def __init__(self):
        self.batches: list[TensorDict] = []

    def update_actor(self, data: TensorDict) -> TensorDict:
        self.batches.append(data)
        out = TensorDict({}, batch_size=[])
        out.set_non_tensor("metrics", {"lr": [0.0] * len(data.get_non_tensor("update_seeds"))})
        return out


def _engine_stub(cfg, data: dict, means: torch.Tensor):
    """A ``DiffusionEngine`` whose step scoring returns the fixed batch's float64 step (policy means with grad, the
    reference means without); ``_trained_steps`` and ``_pieces`` are the engine's own."""
    engine = object.__new__(DiffusionEngine)
    engine.sampler = cfg.sampler

    def score(adapter, micro, k, cond=None):
        rows = micro["row"]
        source = data["ref_means"] if adapter == "reference" else means
        mean = source[rows, k]
        std = data["std"][k].reshape(1, 1, 1, 1).expand_as(mean)
        return StepOutput(prev_sample=data["x_next"][rows, k], mean=mean, std=std, log_prob=_step_log_prob(data["kind"], data["x_next"][rows, k], mean, std))

    engine._score_step = score
    engine.adapter = "policy"
    engine.reference = lambda: contextlib.nullcontext("reference")
    return engine


def ours(experiment: str, *overrides: str):
    """``(cfg, data, update result, [(rows, loss, grad w.r.t. means)] per optimizer step, advantages [B], trained [K])``."""
    recipe = [f"experiment={experiment}", "+shrink=tiny", f"trainer.prompts_per_step={PROMPTS_PER_STEP}", f"trainer.group_size={GROUP_SIZE}"]
    cfg = compose([*recipe, *overrides])
    data = make_batch(compose(recipe) if overrides else cfg)  # the same batch whatever is overridden
    algorithm = build_algorithm(cfg.algorithm, run_context(cfg))
    loss_fn = algorithm.objective()
    K = int(cfg.sampler.num_steps)
    trained = build_window(cfg.sampler, cfg.trainer.seed).masks(0).trained
    traj = TensorDict({
        "latents": data["latents"], "sigmas": data["sigmas"].expand(B, K + 1).clone(), "log_probs": _behaviour_log_probs(data),
        "sde_mask": trained.expand(B, K).clone(), "group_id": data["group_id"], "row": torch.arange(B),
    }, batch_size=[B])
    traj["prompts"] = NonTensorStack(*[f"prompt {int(i)}" for i in data["group_id"]])
    traj.set_non_tensor("metrics", {})
    scores = {"rewards": data["rewards"], **{f"reward/{n}": r for n, r in data["per_reward"].items()}}
    workers = RecordingWorkers()
    result = algorithm.update(workers, traj, scores, step=0)
    advantages = traj["advantages"]
    steps = []
    for batch in workers.batches:
        size = int(batch.get_non_tensor("mini_batch_size"))
        for start in range(0, batch.shape[0], size):
            micro = batch[start : start + size]
            means = data["means"].clone().requires_grad_(True)
            engine = _engine_stub(cfg, data, means)
            loss = sum(piece * weight for piece, weight, _ in DiffusionEngine._pieces(engine, loss_fn, micro, 0))  # share 1: one micro-batch
            (grad,) = torch.autograd.grad(loss, means)
            steps.append((micro["row"].tolist(), loss.detach(), grad))
    return cfg, data, result, steps, advantages, trained


# -- the peers' published formulas ----------------------------------------------------------------------------------
def flow_grpo_advantages(rewards: np.ndarray, prompts: list[str], *, global_std: bool) -> np.ndarray:
    """flow_grpo/stat_tracking.py:L11-31 (PerPromptStatTracker.update, type 'grpo', cleared every epoch: train_sd3.py:L785):
    per prompt, ``(r − np.mean(prompt's rewards)) / (np.std(all rewards or the prompt's) + 1e-4)``, np.std the population
    std; then clipped to ±adv_clip_max = 5 in the loss (train_sd3.py:L886-890, base.py:L97)."""
    prompts = np.array(prompts)
    out = np.empty_like(rewards)
    for p in np.unique(prompts):
        own = rewards[prompts == p]
        std = (np.std(rewards) if global_std else np.std(own)) + 1e-4
        out[prompts == p] = (own - np.mean(own)) / std
    return np.clip(out, -5.0, 5.0)


def verl_omni_advantages(rewards: torch.Tensor, index: list[int], num_steps: int) -> torch.Tensor:
    """verl-omni diffusion_algos.py:L228-265 (compute_flow_grpo_outcome_advantage, global_std, epsilon 1e-4) on the rewards
    repeated over the trained steps (ray_diffusion_trainer.py:L1243-1246: ``[B, T]``): ``torch.std`` (unbiased) of the whole
    ``[B, T]`` tensor, the group's ``torch.mean``; clipped to ±5 in the loss (L308-312)."""
    scores = rewards[:, None].expand(-1, num_steps).clone()
    batch_std = torch.std(scores)
    groups: dict[int, list[int]] = {}
    for i, idx in enumerate(index):
        groups.setdefault(idx, []).append(i)
    for rows in groups.values():
        mean = torch.mean(scores[rows])
        scores[rows] = (scores[rows] - mean) / (batch_std + 1e-4)
    return scores[:, 0].clamp(-5.0, 5.0)


def peer_log_prob(kind: str, x_next, mean, std_dev_t, dt) -> torch.Tensor:
    """flow_grpo sd3_sde_with_logprob.py:L64-68 (sde: the Gaussian log-density with std ``std_dev_t·sqrt(−dt)``) and
    L86 (cps: ``−(x − mean)²``, no constants), averaged over all but the batch dim (L89)."""
    if kind == "cps":
        lp = -((x_next - mean) ** 2)
    else:
        s = std_dev_t * math.sqrt(dt)
        lp = -((x_next - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def peer_step_loss(advantages, log_prob, old_log_prob, clip_range) -> torch.Tensor:
    """flow_grpo train_sd3.py:L886-898 (verl-omni diffusion_algos.py:L308-324 is the same): PPO's clipped surrogate of one
    step, averaged over the micro-batch."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped, clipped))


def peer_update_loss(data, rows, steps, advantages, old_log_probs, means, *, clip_range, beta, kl):
    """One optimizer step of the peer on mini-batch ``rows``: ``accelerator.accumulate`` over its micro-batches x trained
    steps divides each backward by ``GA·T`` (train_sd3.py:L360; train_wan2_1.py:L381-391; verl-omni losses.py:L122-123), so
    with equal micro-batches the step is the mean over the trained steps of the per-step mean over the rows, with
    ``policy_loss + beta·kl_loss`` at each step (train_sd3.py:L899-902)."""
    total = 0.0
    for j in steps:
        mean = means[rows, j]
        dt = float(data["dt"][j])
        std_dev_t = data["std_dev_t"][j] if torch.is_tensor(data["std_dev_t"]) else data["std_dev_t"]
        lp = peer_log_prob(data["kind"], data["x_next"][rows, j], mean, float(std_dev_t), dt)
        loss = peer_step_loss(advantages[rows], lp, old_log_probs[rows, j], clip_range)
        if beta > 0:
            loss = loss + beta * kl(mean, data["ref_means"][rows, j], float(std_dev_t), dt)
        total = total + loss
    return total / len(steps)


def sd3_kl(mean, ref_mean, std_dev_t, dt):
    """flow_grpo train_sd3.py:L900-901: ``((μ − μ_ref)²).mean(dims) / (2·std_dev_t²)``, ``std_dev_t`` without ``sqrt(dt)``."""
    return torch.mean(((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std_dev_t**2))


def wan_kl(mean, ref_mean, std_dev_t, dt):
    """flow_grpo train_wan2_1.py:L959-960 with wan_pipeline_with_logprob.py:L83 (``dt_ref = sqrt(−dt)``):
    ``((μ − μ_ref)²).mean(dims) / (2·(std_dev_t·sqrt(dt))²)``, the exact Gaussian KL."""
    return torch.mean(((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * (std_dev_t * math.sqrt(dt)) ** 2))


# recipe: the peer's advantage rule, whether it drops zero-advantage samples, its KL form, and its values (config file:line)
# of the PPO clip range, the KL beta and the trained steps ("first n" of a fraction window, or a random window of n).
PEERS = {
    "sd35m_geneval_flow_grpo": dict(adv="flow_grpo_global", drops=True, kl=sd3_kl, clip=1e-4, beta=0.04, trained=("first", 9)),  # base.py:L99; grpo.py:L147,L146
    "sd35m_ocr_flow_grpo": dict(adv="flow_grpo_global", drops=True, kl=sd3_kl, clip=1e-4, beta=0.04, trained=("first", 9)),  # base.py:L99; grpo.py:L106,L104
    "sd35m_pickscore_flow_grpo": dict(adv="flow_grpo_global", drops=True, kl=sd3_kl, clip=1e-4, beta=0.01, trained=("first", 9)),  # grpo.py:L227,L226
    "sd35m_pickscore_flow_grpo_fast": dict(adv="flow_grpo_global", drops=True, kl=None, clip=1e-5, beta=0.0, trained=("window", 3)),  # grpo.py:L345-349
    "flux_kontext_counting_flow_grpo": dict(adv="flow_grpo_global", drops=True, kl=None, clip=1e-4, beta=0.0, trained=("first", 5)),  # grpo.py:L675-677
    "wan21_1_3b_ocr_flow_grpo": dict(adv="flow_grpo_group", drops=True, kl=wan_kl, clip=1e-3, beta=0.004, trained=("first", 19)),  # grpo.py:L52-56,L64
    "qwen_image_ocr_lora_flow_grpo": dict(adv="verl_omni", drops=False, kl=None, clip=1e-5, beta=0.0, trained=("window", 2)),  # .sh:L42,L57; actor.yaml:L91
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def parity_gaps(experiment: str, *overrides: str) -> dict:
    """Ours vs the peer on the fixed batch: the largest relative gaps of the advantages, the losses and the gradients of
    the optimizer steps, whether the trained rows are the peer's, and our algorithm's record."""
    cfg, data, result, steps, advantages, trained = ours(experiment, *overrides)
    peer = PEERS[experiment]
    adv_kind, drops, kl = peer["adv"], peer["drops"], peer["kl"]
    trained_steps = [k for k in range(trained.shape[0]) if bool(trained[k])]
    how, n = peer["trained"]  # the peer's trained steps: the first n (train_sd3.py:L345,L869), or a window of n consecutive SDE steps
    assert len(trained_steps) == n and trained_steps == (list(range(n)) if how == "first" else list(range(trained_steps[0], trained_steps[0] + n)))
    prompts = [f"prompt {int(i)}" for i in data["group_id"]]
    if adv_kind == "verl_omni":  # verl-omni trains the SDE window's T steps: the std is over [B, T]
        peer_adv = verl_omni_advantages(data["rewards"], data["group_id"].tolist(), len(trained_steps))
    else:
        peer_adv = torch.from_numpy(flow_grpo_advantages(data["rewards"].numpy(), prompts, global_std=adv_kind == "flow_grpo_global"))
    # the rows the peer trains: train_sd3.py:L802 (advantage exactly 0 at every step: dropped); verl-omni keeps all
    peer_kept = sorted(int(i) for i in torch.nonzero(peer_adv != 0).flatten()) if drops else list(range(B))
    gaps = {"advantages": _rel(advantages, peer_adv), "same_rows": sorted(r for rows, _, _ in steps for r in rows) == peer_kept,
            "loss": 0.0, "grad": 0.0, "kl_share": 0.0, "optimizer_steps": len(steps), "record": result.record, "dtype": advantages.dtype}
    old_log_probs = _behaviour_log_probs(data)
    for rows, loss, grad in steps:
        means = data["means"].clone().requires_grad_(True)
        ref = peer_update_loss(data, rows, trained_steps, peer_adv, old_log_probs, means, clip_range=peer["clip"], beta=peer["beta"], kl=kl)
        (ref_grad,) = torch.autograd.grad(ref, means)
        assert ref_grad.abs().max() > 0
        gaps["loss"] = max(gaps["loss"], abs(float(loss) - float(ref.detach())) / abs(float(ref.detach())))
        gaps["grad"] = max(gaps["grad"], _rel(grad, ref_grad))
        if peer["beta"] > 0:  # how much of the loss the KL term is (it must matter for the KL form to be tested)
            no_kl = peer_update_loss(data, rows, trained_steps, peer_adv, old_log_probs, means, clip_range=peer["clip"], beta=0.0, kl=kl)
            gaps["kl_share"] = max(gaps["kl_share"], abs(float(ref.detach()) - float(no_kl.detach())) / abs(float(ref.detach())))
    return gaps


@pytest.mark.parametrize("experiment", sorted(PEERS))
def test_recipe_update_equals_the_peers(experiment):
    gaps = parity_gaps(experiment)
    assert gaps["dtype"] == torch.float64
    assert gaps["advantages"] <= TOL, gaps
    assert gaps["same_rows"], gaps
    assert gaps["optimizer_steps"] == 2  # the recipe's 2 optimizer steps per RL step (mini_batch_size ${optimizer_steps:2})
    assert gaps["loss"] <= TOL and gaps["grad"] <= TOL, gaps
    if PEERS[experiment]["drops"]:  # the all-equal group (4) and the two rewards equal to their group's mean
        assert gaps["record"]["dropped_samples"] == 6
    if PEERS[experiment]["kl"] is not None:
        assert gaps["kl_share"] > 1e-4, gaps


@pytest.mark.parametrize(("experiment", "override", "gap"), [
    ("sd35m_geneval_flow_grpo", "algorithm.kl_dt_scale=false", "loss"),  # today's default: the KL 1/dt stronger
    ("sd35m_pickscore_flow_grpo", "algorithm.adv_drop_zero_advantage=false", "same_rows"),
    ("sd35m_ocr_flow_grpo", "algorithm.adv_drop_zero_std=true", "same_rows"),  # group drop keeps the two mean-equal rewards
    ("flux_kontext_counting_flow_grpo", "algorithm.adv_std_ddof=1.0", "advantages"),
    ("wan21_1_3b_ocr_flow_grpo", "algorithm.kl_dt_scale=true", "loss"),
    ("wan21_1_3b_ocr_flow_grpo", "algorithm.adv_std_mode=global", "advantages"),
    ("qwen_image_ocr_lora_flow_grpo", "algorithm.adv_std_ddof=0.0", "advantages"),
    ("qwen_image_ocr_lora_flow_grpo", "algorithm.clip_range=1e-4", "loss"),  # the clip range before verl-omni's fix
    ("sd35m_pickscore_flow_grpo_fast", "algorithm.clip_range=1e-4", "loss"),
])
def test_each_recipe_value_is_what_makes_the_update_the_peers(experiment, override, gap):
    """The tests above are not vacuous: reverting one recipe value (to today's default or a neighbour) breaks the parity."""
    if experiment == "sd35m_ocr_flow_grpo":
        override = [override, "algorithm.adv_drop_zero_advantage=false"]
    gaps = parity_gaps(experiment, *([override] if isinstance(override, str) else override))
    if gap == "same_rows":
        assert not gaps["same_rows"]
    else:
        assert gaps[gap] > 1e-6, gaps


def test_the_sd3_kl_form_is_ours_with_kl_dt_scale_and_not_without():
    """The SD3 recipes' ``kl_dt_scale=true`` is what makes the KL the peer's (train_sd3.py:L900); the exact KL
    (``kl_dt_scale=false``) is 1/Δt larger at the same β."""
    from diffrl.algorithms.losses import step_kl

    data = make_batch(compose(["experiment=sd35m_geneval_flow_grpo", "+shrink=tiny"]))
    k = 3
    mean, ref = data["means"][:, k], data["ref_means"][:, k]
    std = data["std"][k].reshape(1, 1, 1, 1)
    dt = data["dt"][k].expand(B)
    peer = ((mean - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * float(data["std_dev_t"][k]) ** 2)
    assert _rel(step_kl(mean, ref, std, dt=dt, kl_dt_scale=True), peer) <= TOL
    assert _rel(step_kl(mean, ref, std, dt=dt, kl_dt_scale=False), peer / float(data["dt"][k])) <= TOL


def test_cps_log_prob_of_the_parity_tests_is_cps_step():
    """The float64 cps log-prob used above is ``cps_step``'s (which computes in fp32)."""
    g = torch.Generator().manual_seed(3)
    v, x, prev = (torch.randn(4, *SHAPE, generator=g) for _ in range(3))
    out = cps_step(v, x, 0.6, 0.45, noise_level=0.8, prev_sample=prev)
    torch.testing.assert_close(out.log_prob, _step_log_prob("cps", prev, out.mean, out.std), rtol=1e-6, atol=1e-7)


def test_group_std_ddof_is_numpy_torch_and_verl_omni():
    """``adv_std_ddof``: 0 is numpy's population std (flow_grpo), 1 torch.std's unbiased one, 1/T the std of the rewards
    repeated over T steps (verl-omni)."""
    from diffrl.algorithms.advantages import group_advantages

    r = _rewards()
    gid = torch.arange(4).repeat_interleave(4)
    centred = r - r.view(4, 4).mean(dim=1).repeat_interleave(4)
    for ddof, std in [(0.0, float(np.std(r.numpy()))), (1.0, float(torch.std(r))), (0.5, float(torch.std(r[:, None].expand(-1, 2))))]:
        got = group_advantages(r, gid, std_mode="global", eps=1e-4, clip_max=100.0, ddof=ddof, dtype=torch.float64)
        assert _rel(got, centred / (std + 1e-4)) <= TOL
    own = torch.tensor([float(np.std(r[4 * i : 4 * i + 4].numpy())) for i in range(4)], dtype=torch.float64).repeat_interleave(4)
    got = group_advantages(r, gid, std_mode="group", eps=1e-4, clip_max=100.0, dtype=torch.float64)
    assert _rel(got, centred / (own + 1e-4)) <= TOL


# -- the EMA cadence (eval.ema_cadence=optimizer_step) ---------------------------------------------------------------
def test_ema_moves_after_every_optimizer_step_at_its_weights(tmp_path, monkeypatch):
    """One RL step of 3 optimizer steps with ``eval.ema_cadence=optimizer_step, ema_every=1, ema_repeats=2``: the EMA
    adapter after the step equals the initial adapter moved twice after each optimizer step n towards that step's
    weights with decay min((1 + n)/(10 + n), 0.9) (flow_grpo ema.py:L33-49 called per micro-batch, train_sd3.py:L959-960)."""
    from helpers import tiny_run_overrides
    from safetensors.torch import load_file

    from diffrl.distributed.workers import TrainingWorker
    from diffrl.engine import lora
    from diffrl.run_evaluation import ema_decay
    from diffrl.trainer import Trainer

    snapshots = []
    original = TrainingWorker.train_batch

    def recording(self, data):
        if not snapshots:
            snapshots.append(_adapter(self.engine.module, lora, "default"))
        out = original(self, data)
        snapshots.append(_adapter(self.engine.module, lora, "default"))
        return out

    monkeypatch.setattr(TrainingWorker, "train_batch", recording)
    out = tmp_path / "run"
    overrides = tiny_run_overrides(tmp_path, out, 1, ["a red seven", "a green three"], "algorithm.lr=0.01", "algorithm.mini_batch_size=2",
                                   "eval.ema=true", "eval.ema_every=1", "eval.ema_cadence=optimizer_step", "eval.ema_repeats=2",
                                   checkpoint_every=1)
    Trainer(compose(overrides)).fit()
    assert len(snapshots) == 4  # the initial adapter and 3 optimizer steps (6 trajectories in mini-batches of 2)
    expected = dict(snapshots[0])
    for n in (1, 2, 3):
        d = ema_decay(n, 0.9)
        for _ in range(2):
            expected = {k: d * expected[k] + (1 - d) * snapshots[n][k] for k in expected}
    saved = load_file(str(out / "checkpoints" / "step_000001" / "model.safetensors"))
    ema = {k.replace(".ema.", "."): v for k, v in saved.items() if ".ema." in k}
    assert ema and set(ema) == set(expected)
    for k in expected:
        torch.testing.assert_close(ema[k], expected[k], rtol=1e-6, atol=1e-9)
    # not the RL-step cadence: one move towards the final weights would differ
    d = ema_decay(1, 0.9)
    b = next(k for k in expected if "lora_B" in k)
    assert not torch.allclose(ema[b], (1 - d) * snapshots[3][b], rtol=1e-3, atol=0)


def _adapter(module, lora, name: str) -> dict[str, torch.Tensor]:
    """The LoRA weights of adapter ``name``, keyed without the adapter name."""
    return {k.replace(f".{name}.", "."): v.detach().clone() for k, v in module.state_dict().items() if f".{name}." in k and "lora_" in k}
