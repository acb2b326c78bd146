"""Deterministic evaluation: fixed held-out seeds, ODE sampling, rewards and the gold metric."""

from __future__ import annotations

import dataclasses

import torch

from diffrl.rollout import SamplerSettings, sample_seed, sample_trajectories


def eval_prompts_and_seeds(prompts: list[str], seeds_per_prompt: int, seed: int) -> tuple[list[str], list[int]]:
    """Each prompt × ``seeds_per_prompt``; seeds from ``(seed, step=-1, prompt index, sample index)``,
    disjoint from training seeds (training steps are ≥ 0)."""
    out_prompts, out_seeds = [], []
    for p_idx, prompt in enumerate(prompts):
        for s in range(seeds_per_prompt):
            out_prompts.append(prompt)
            out_seeds.append(sample_seed(seed, -1, p_idx, s))
    return out_prompts, out_seeds


def deterministic_settings(settings: SamplerSettings, prediction_type: str, num_steps: int) -> SamplerSettings:
    """``settings`` turned into the evaluation sampler: the Euler ODE for flow models, DDIM with η = 0 for
    epsilon models, ``num_steps`` steps (image size, shift, guidance and clipping kept).

    With ``settings.eval_stochastic`` the evaluation keeps the rollout's stochastic step (``step_kind``,
    ``noise_level``) at every one of the ``num_steps`` steps: the policy that stochastic-step RL trains
    (DDPO reports the reward of its own η = 1 samples). The per-sample seeds still fix every draw, so
    repeated evaluations of the same weights give the same images."""
    if settings.eval_stochastic:
        return dataclasses.replace(settings, num_steps=num_steps)
    kind = "ode" if prediction_type == "flow" else "ddim"
    return dataclasses.replace(settings, num_steps=num_steps, step_kind=kind, noise_level=0.0)


def score_images(images: torch.Tensor, prompts: list[str], metrics: dict) -> dict[str, float]:
    """``{"eval/<name>": mean}`` of every metric (``name -> callable``, reward protocol) on ``images``,
    each called as it declared (:func:`rewards.base.call_reward`: batch size, uint8 or PIL input, checks)."""
    from diffrl.logging import per_sample_scores

    return {f"eval/{name}": float(values.mean()) for name, values in per_sample_scores(images, prompts, metrics).items()}


@torch.no_grad()
def evaluate(adapter, prompts: list[str], *, seeds: list[int], num_steps: int, guidance_scale: float, metrics: dict, micro_batch_size: int | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Sample ``prompts`` deterministically (:func:`deterministic_settings`) and average each metric.

    Returns:
        ``({"eval/<name>": mean}, images uint8 [N, 3, H, W])``.
    """
    settings = deterministic_settings(SamplerSettings(num_steps=num_steps, guidance_scale=guidance_scale), getattr(adapter, "prediction_type", "flow"), num_steps)
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=seeds, micro_batch_size=micro_batch_size)
    images = td["images"]
    return score_images(images, prompts, metrics), images
