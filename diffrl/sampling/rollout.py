"""Batched sampling of trajectories from a model adapter.

One ``predict()`` per step on the whole batch (CFG batched inside the adapter), the step function
of ``diffrl.sampling.sde`` chosen per step by the ``sde_mask`` (stochastic where trained, ODE elsewhere; per row when the
masks are ``[B, K]``: the rows of a step split into a stochastic and an ODE part), and
one ``torch.Generator`` per sample seeded from ``(seed, step, prompt position, index in group)``
(``diffrl.sampling.seeding``),
so a sample's noise is the same whatever batch it is drawn in and a resumed run redraws it exactly.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.config import SamplerConfig
from diffrl.sampling.sde import ODE_SOLVERS, is_deterministic, randn_per_sample, run_step
from diffrl.sampling.schedules import per_sample_count, per_sample_trained
from diffrl.sampling.seeding import generators as make_generators


def uint8_images(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] → uint8 ``[B, 3, H, W]`` (round to nearest)."""
    return (images.float().clamp(0, 1) * 255.0).round().to(torch.uint8)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU. From a GPU: queued into pinned memory without blocking (several times faster than a copy
    into pageable memory, and the host does not wait); the stream's next blocking copy guarantees it landed."""
    if not t.is_cuda:
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _trained_rows(settings: SamplerConfig, sde_mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """``[B, K]`` trained steps: a per-row ``sde_mask [B, K]`` as given, ``sde_mask [K]`` for every sample, or with
    ``sampler.window=random_per_sample`` (DanceGRPO) each sample's own ``per_sample_count`` of them
    (:func:`~diffrl.sampling.schedules.per_sample_trained`)."""
    if sde_mask.ndim == 2:
        return sde_mask.bool().clone()
    if getattr(settings, "window", "all") == "random_per_sample" and bool(sde_mask.any()):
        count = per_sample_count(int(sde_mask.sum()), settings.timestep_fraction)
        return per_sample_trained(sde_mask, count, seeds)
    return sde_mask.unsqueeze(0).expand(len(seeds), -1).clone()


def _step_rows(settings: SamplerConfig, stochastic: torch.Tensor, model_output, x, sigma: float, sigma_next: float, gens, history, step: dict):
    """One denoising step of a micro-batch whose rows ``stochastic [b]`` take ``settings.kind`` and the others
    ``settings.ode_solver``: ``(prev_sample, log_prob [b], mean)``. All rows of one kind run as one call; mixed rows run
    as two calls on the row subsets, each row drawing from its own generator."""
    deterministic = is_deterministic(settings.kind, settings.noise_level)
    if deterministic or bool(stochastic.all()) or not bool(stochastic.any()):
        kind = settings.kind if deterministic or bool(stochastic[0]) else settings.ode_solver
        out = run_step(kind, model_output, x, sigma, sigma_next, generator=gens, history=history, **step)
        return out.prev_sample, out.log_prob, out.mean
    prev = torch.empty_like(x)
    log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    mean = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for kind, rows in ((settings.kind, stochastic), (settings.ode_solver, ~stochastic)):
        index = rows.nonzero().squeeze(1)
        sub_gens = [gens[i] for i in index.tolist()] if isinstance(gens, list) else gens
        index = index.to(x.device)
        sub_history = None if history is None else (history[0][index], history[1])
        out = run_step(kind, model_output[index], x[index], sigma, sigma_next, generator=sub_gens, history=sub_history, **step)
        prev[index], log_prob[index], mean[index] = out.prev_sample.to(prev.dtype), out.log_prob.float(), out.mean.float()
    return prev, log_prob, mean


@torch.no_grad()
def sample_trajectories(
    adapter,
    prompts: list[str],
    *,
    settings: SamplerConfig,
    seeds: list[int],
    sde_mask: torch.Tensor | None = None,
    stochastic_mask: torch.Tensor | None = None,
    init_seeds: list[int] | None = None,
    group_id: torch.Tensor | None = None,
    micro_batch_size: int | None = None,
    record_means: bool = False,
    source_images: torch.Tensor | None = None,
) -> TensorDict:
    """Sample one trajectory per entry of ``prompts`` (repeat a prompt for a group).

    Args:
        adapter: a ``pipelines.base.ModelAdapter``.
        prompts: ``B`` prompts.
        settings: the sampler config (``num_steps``, ``kind``, ``noise_level``, ``ode_solver``, ``clip_sample``,
            ``guidance_scale``, ``shift``, ``height``, ``width``).
        seeds: ``B`` per-sample generator seeds (``diffrl.sampling.seeding``, stream ``ROLLOUT``).
        sde_mask: ``[K]`` bool, the trained steps (stochastic, log-probs recorded), or ``[B, K]``: each row its own;
            default all steps (none when the step kind is deterministic).
        stochastic_mask: ``[K]`` or ``[B, K]`` bool, steps drawn with ``settings.kind`` (a superset of
            ``sde_mask``; the others use ``settings.ode_solver``); default ``sde_mask``. A row's noise comes from its own
            generator at its own stochastic steps only, so a row samples the same whatever rows share its batch.
        init_seeds: ``B`` seeds of the initial noise (equal within a group for shared initial noise);
            default: the initial noise is the first draw of each sample's own generator.
        group_id: ``[B]`` group of each sample (default: one group per distinct prompt position).
        micro_batch_size: samples per forward (default all ``B``).
        record_means: also return ``means [B, K, …]``, each step's transition mean (GRPO-Guard's
            RatioNorm needs the rollout's means).
        source_images: uint8 ``[B, 3, H, W]``, each prompt's source image, for an editing family
            (``adapter.editing``; required there, refused elsewhere). They enter ``cond`` through
            ``adapter.encode`` and are kept in the trajectory as ``source_images``.

    Returns:
        The trajectory TensorDict (docs/architecture.md, "Trajectory") with batch size ``[B]``: ``latents [B, K+1, …]``,
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
    deterministic = is_deterministic(settings.kind, settings.noise_level)
    if sde_mask is None:
        sde_mask = torch.full((K,), not deterministic, dtype=torch.bool)
    if stochastic_mask is None:
        stochastic_mask = sde_mask
    B = len(prompts)
    for name, mask in (("sde_mask", sde_mask), ("stochastic_mask", stochastic_mask)):
        if mask.shape not in ((K,), (B, K)):
            raise ValueError(f"{name} must have shape [{K}] or [{B}, {K}] (per row), got {tuple(mask.shape)}")
    sde_mask, stochastic_mask = sde_mask.bool(), stochastic_mask.bool()
    if bool((sde_mask & ~stochastic_mask).any()):
        raise ValueError("sde_mask marks a step as trained that is not stochastic (not in stochastic_mask)")
    if deterministic and bool(sde_mask.any()):
        raise ValueError(f"step kind {settings.kind!r} at noise_level {settings.noise_level} is deterministic: no step can be trained")
    if sde_mask.ndim == 2 and getattr(settings, "window", "all") == "random_per_sample":
        raise ValueError("per-row trained steps (sde_mask [B, K]) and sampler.window=random_per_sample both choose each row's "
                         "steps; use sampler.window=all with per-row masks")
    # [B, K]: the step kind of each row at each step (deterministic kinds everywhere)
    stochastic_rows = stochastic_mask.expand(B, K) if not deterministic else torch.ones(B, K, dtype=torch.bool)
    mb = micro_batch_size or B
    device = adapter.device
    prediction_type = getattr(adapter, "prediction_type", "flow")
    if source_images is not None and (source_images.dtype != torch.uint8 or source_images.ndim != 4 or source_images.shape[0] != B):
        raise ValueError(f"source_images must be uint8 [{B}, 3, H, W] (one per prompt), got {source_images.dtype} {tuple(source_images.shape)}")
    # a conditioning is a (prompt, source) pair; sources are told apart by their bytes
    keys = [(p, None if source_images is None else hash(source_images[i].numpy().tobytes())) for i, p in enumerate(prompts)]
    unique = list(dict.fromkeys(keys))
    first = {key: keys.index(key) for key in unique}

    def encode_one(key):
        i = first[key]
        images = None if source_images is None else source_images[i : i + 1].float() / 255.0
        return adapter.encode([prompts[i]], images)

    # one prompt per text-encoder call: a prompt's embedding then does not depend on which other prompts share
    # the batch, so a rollout cut into chunks (reward.async_chunks, data-parallel workers) is bit-identical
    encoded = torch.cat([encode_one(key) for key in unique]) if len(unique) > 1 else encode_one(unique[0])
    cond = encoded[torch.tensor([unique.index(key) for key in keys])]
    if group_id is None:
        group_id = torch.tensor([unique.index(key) for key in keys], dtype=torch.long)

    all_latents, all_log_probs, all_images, all_means = [], [], [], []
    for start in range(0, B, mb):
        sl = slice(start, min(start + mb, B))
        gens = make_generators(seeds[sl])
        c = cond[sl].to(device)
        shape = (sl.stop - sl.start, *adapter.latent_shape(settings.height, settings.width))
        x = randn_per_sample(shape, gens if init_seeds is None else make_generators(init_seeds[sl]), device)
        latents, log_probs, means, history = [x], [], [], None
        rows_stochastic = stochastic_rows[sl]
        for k in range(K):
            # sigmas live on the host: filling the device tensor needs no copy, so the loop never waits on the GPU
            sigma = torch.full((x.shape[0],), sigmas[k].item(), dtype=torch.float32, device=device)
            out_model = adapter.predict(x, sigma, c, settings.guidance_scale)
            step = dict(noise_level=settings.noise_level, prediction_type=prediction_type, clip_sample=settings.clip_sample)
            prev, log_prob, mean = _step_rows(settings, rows_stochastic[:, k], out_model, x, sigmas[k].item(), sigmas[k + 1].item(), gens, history, step)
            if deterministic:  # x̂0 for the multistep solver's next step
                needs_history = settings.kind == "dpm2" and k + 1 < K
            else:
                needs_history = settings.ode_solver == "dpm2" and bool((~rows_stochastic[:, k + 1 :]).any())
            if prediction_type == "flow" and needs_history:
                history = (x.float() - sigmas[k].item() * out_model.float(), sigmas[k].item())
            x = prev
            latents.append(x)
            log_probs.append(log_prob)
            if record_means:
                means.append(mean.float().cpu())
        all_latents.append(_to_host(torch.stack(latents, 1).float()))
        all_log_probs.append(_to_host(torch.stack(log_probs, 1).float()))
        all_images.append(uint8_images(adapter.decode(x)).cpu())  # a blocking copy: the copies above have landed too
        if record_means:
            all_means.append(torch.stack(means, 1))

    td = TensorDict(
        {
            "latents": torch.cat(all_latents),
            "sigmas": sigmas.unsqueeze(0).expand(B, -1).clone(),
            "log_probs": torch.cat(all_log_probs),
            "sde_mask": _trained_rows(settings, sde_mask, seeds),
            "cond": cond.cpu(),
            "images": torch.cat(all_images),
            "group_id": group_id.long().cpu(),
            "seeds": torch.tensor(seeds, dtype=torch.long),
        },
        batch_size=[B],
    )
    if record_means:
        td["means"] = torch.cat(all_means)
    if source_images is not None:
        td["source_images"] = source_images.cpu()
    td["prompts"] = NonTensorStack(*prompts)
    return td
