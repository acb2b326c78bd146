"""Batched sampling of trajectories from a model adapter.

One ``predict()`` per step on the whole batch (CFG batched inside the adapter), the step function
of ``diffrl.sde`` chosen per step by the ``sde_mask`` (stochastic where trained, ODE elsewhere), and
one ``torch.Generator`` per sample seeded from ``(seed, step, prompt position, index in group)``,
so a sample's noise is the same whatever batch it is drawn in and a resumed run redraws it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.sde import ODE_SOLVERS, is_deterministic, randn_per_sample, run_step

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed that depends on every argument (splitmix64 chain), for one sample's generator."""
    h = _splitmix64(seed & _MASK64)
    for part in (step, prompt_index, sample_index):
        h = _splitmix64(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


def make_generators(seeds: list[int], device: str | torch.device = "cpu") -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


@dataclass(kw_only=True)
class SamplerSettings:
    """How trajectories are drawn.

    Attributes:
        num_steps: denoising steps K.
        step_kind: step function of stochastic steps (``diffrl.sde.STEP_KINDS``); a deterministic kind
            (``ode``, ``dpm2``, ``ddim`` with η = 0) samples every step with itself.
        noise_level: the step kind's noise scale (Flow-GRPO's ``a``, DDIM's η).
        ode_solver: solver of the non-stochastic steps: ``ode`` (Euler) or ``dpm2``.
        clip_sample: ``ddim`` clamps its x̂0 to ``[−clip_sample, clip_sample]`` (None: no clamp).
        guidance_scale: CFG scale; 1 runs no unconditional branch.
        shift: sigma-schedule shift; ``None`` takes the family's.
        height, width: image size in pixels.
        eval_stochastic: evaluations sample with ``step_kind``/``noise_level`` at every step (on their fixed
            seeds) instead of the deterministic ODE / DDIM(η = 0); see ``diffrl.evaluation.deterministic_settings``.
    """

    num_steps: int
    step_kind: str = "flow_sde"
    noise_level: float = 0.7
    ode_solver: str = "ode"
    clip_sample: float | None = None
    guidance_scale: float = 1.0
    shift: float | None = None
    height: int = 16
    width: int = 16
    eval_stochastic: bool = False


def uint8_images(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] → uint8 ``[B, 3, H, W]`` (round to nearest)."""
    return (images.float().clamp(0, 1) * 255.0).round().to(torch.uint8)


@torch.no_grad()
def sample_trajectories(
    adapter,
    prompts: list[str],
    *,
    settings: SamplerSettings,
    seeds: list[int],
    sde_mask: torch.Tensor | None = None,
    stochastic_mask: torch.Tensor | None = None,
    init_seeds: list[int] | None = None,
    group_id: torch.Tensor | None = None,
    micro_batch_size: int | None = None,
    record_means: bool = False,
) -> TensorDict:
    """Sample one trajectory per entry of ``prompts`` (repeat a prompt for a group).

    Args:
        adapter: a ``pipelines.base.ModelAdapter``.
        prompts: ``B`` prompts.
        settings: sampler settings.
        seeds: ``B`` per-sample generator seeds (see :func:`sample_seed`).
        sde_mask: ``[K]`` bool, the trained steps (stochastic, log-probs recorded); default all steps
            (none when the step kind is deterministic).
        stochastic_mask: ``[K]`` bool, steps drawn with ``settings.step_kind`` (a superset of
            ``sde_mask``; the others use ``settings.ode_solver``); default ``sde_mask``.
        init_seeds: ``B`` seeds of the initial noise (equal within a group for shared initial noise);
            default: the initial noise is the first draw of each sample's own generator.
        group_id: ``[B]`` group of each sample (default: one group per distinct prompt position).
        micro_batch_size: samples per forward (default all ``B``).
        record_means: also return ``means [B, K, …]``, each step's transition mean (GRPO-Guard's
            RatioNorm needs the rollout's means).

    Returns:
        The trajectory TensorDict of DESIGN.md with batch size ``[B]``: ``latents [B, K+1, …]``,
        ``sigmas [B, K+1]``, ``log_probs [B, K]`` (recorded at stochastic steps, 0 elsewhere),
        ``sde_mask [B, K]`` (trained steps), ``cond``, ``images`` (uint8), ``group_id``, ``seeds``
        and the non-tensor ``prompts``.
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    if init_seeds is not None and len(init_seeds) != len(prompts):
        raise ValueError(f"got {len(init_seeds)} init_seeds for {len(prompts)} prompts")
    if settings.ode_solver not in ODE_SOLVERS:
        raise ValueError(f"unknown sampler.ode_solver {settings.ode_solver!r}; choose one of {ODE_SOLVERS}")
    K = settings.num_steps
    sigmas = adapter.schedule(K, settings.shift, height=settings.height, width=settings.width)
    deterministic = is_deterministic(settings.step_kind, settings.noise_level)
    if sde_mask is None:
        sde_mask = torch.full((K,), not deterministic, dtype=torch.bool)
    if stochastic_mask is None:
        stochastic_mask = sde_mask
    for name, mask in (("sde_mask", sde_mask), ("stochastic_mask", stochastic_mask)):
        if mask.shape != (K,):
            raise ValueError(f"{name} must have shape [{K}], got {tuple(mask.shape)}")
    if bool((sde_mask & ~stochastic_mask).any()):
        raise ValueError("sde_mask marks a step as trained that is not stochastic (not in stochastic_mask)")
    if deterministic and bool(sde_mask.any()):
        raise ValueError(f"step kind {settings.step_kind!r} at noise_level {settings.noise_level} is deterministic: no step can be trained")
    B = len(prompts)
    mb = micro_batch_size or B
    device = adapter.device
    prediction_type = getattr(adapter, "prediction_type", "flow")
    unique = list(dict.fromkeys(prompts))
    # one prompt per text-encoder call: a prompt's embedding then does not depend on which other prompts share
    # the batch, so a rollout cut into chunks (reward.async_chunks, data-parallel workers) is bit-identical
    encoded = torch.cat([adapter.encode_prompts([p]) for p in unique]) if len(unique) > 1 else adapter.encode_prompts(unique)
    cond = encoded[torch.tensor([unique.index(p) for p in prompts])]
    if group_id is None:
        group_id = torch.tensor([unique.index(p) for p in prompts], dtype=torch.long)
    kinds = [settings.step_kind if deterministic or bool(stochastic_mask[k]) else settings.ode_solver for k in range(K)]

    all_latents, all_log_probs, all_images, all_means = [], [], [], []
    for start in range(0, B, mb):
        sl = slice(start, min(start + mb, B))
        gens = make_generators(seeds[sl])
        c = cond[sl].to(device)
        shape = (sl.stop - sl.start, *adapter.latent_shape(settings.height, settings.width))
        x = randn_per_sample(shape, gens if init_seeds is None else make_generators(init_seeds[sl]), device)
        latents, log_probs, means, history = [x], [], [], None
        for k in range(K):
            # sigmas live on the host: filling the device tensor needs no copy, so the loop never waits on the GPU
            sigma = torch.full((x.shape[0],), sigmas[k].item(), dtype=torch.float32, device=device)
            out_model = adapter.predict(x, sigma, c, settings.guidance_scale)
            out = run_step(
                kinds[k], out_model, x, sigmas[k].item(), sigmas[k + 1].item(), noise_level=settings.noise_level,
                prediction_type=prediction_type, generator=gens, history=history, clip_sample=settings.clip_sample,
            )
            if prediction_type == "flow" and "dpm2" in kinds[k + 1 :]:  # x̂0 for the multistep solver's next step
                history = (x.float() - sigmas[k].item() * out_model.float(), sigmas[k].item())
            x = out.prev_sample
            latents.append(x)
            log_probs.append(out.log_prob)
            if record_means:
                means.append(out.mean.float().cpu())
        all_latents.append(torch.stack(latents, 1).float().cpu())
        all_log_probs.append(torch.stack(log_probs, 1).float().cpu())
        all_images.append(uint8_images(adapter.decode(x)).cpu())
        if record_means:
            all_means.append(torch.stack(means, 1))

    td = TensorDict(
        {
            "latents": torch.cat(all_latents),
            "sigmas": sigmas.unsqueeze(0).expand(B, -1).clone(),
            "log_probs": torch.cat(all_log_probs),
            "sde_mask": sde_mask.unsqueeze(0).expand(B, -1).clone(),
            "cond": cond.cpu(),
            "images": torch.cat(all_images),
            "group_id": group_id.long().cpu(),
            "seeds": torch.tensor(seeds, dtype=torch.long),
        },
        batch_size=[B],
    )
    if record_means:
        td["means"] = torch.cat(all_means)
    td["prompts"] = NonTensorStack(*prompts)
    return td
