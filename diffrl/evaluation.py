"""Deterministic evaluation: fixed held-out seeds, ODE sampling, rewards and the gold metric."""

from __future__ import annotations

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


@torch.no_grad()
def evaluate(adapter, prompts: list[str], *, seeds: list[int], num_steps: int, guidance_scale: float, metrics: dict, micro_batch_size: int | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Sample ``prompts`` deterministically (the Euler ODE for flow models, DDIM with η = 0 for epsilon
    models) and average each metric (``name -> callable``, reward protocol).

    Returns:
        ``({"eval/<name>": mean}, images uint8 [N, 3, H, W])``.
    """
    kind = "ode" if getattr(adapter, "prediction_type", "flow") == "flow" else "ddim"
    settings = SamplerSettings(num_steps=num_steps, step_kind=kind, noise_level=0.0, guidance_scale=guidance_scale)
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=seeds, micro_batch_size=micro_batch_size)
    images = td["images"]
    result = {}
    for name, fn in metrics.items():
        out = fn(images, prompts, None)
        result[f"eval/{name}"] = float(out.get(name, next(iter(out.values()))).float().mean())
    return result, images
