"""FLUX.2 [klein] against diffusers' Flux2KleinPipeline at the tiny random shape (fp32, CPU): prompt embeddings (Qwen3
layers 9/18/27 of the chat-templated prompt), position ids and the 2×2 patchify, the schedule (the pipeline's empirical
mu at two image sizes, both of its branches), ODE sampling of the distilled model (no CFG) and of the Base model (true
CFG), the VAE's batch-norm normalisation (encode, decode), the FLOPs formula against torch's counter, the published
shape on ``meta`` and the one-line errors; the distilled model at 4 steps trains through the CLI. The shared suite
(tests/test_families.py) covers rollout ↔ training parity, CFG, LoRA and save → reload for flux2_klein as for every
family."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest
import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from pipelines.flux2_klein.adapter import image_position_ids, patchify, text_position_ids, unpatchify

pytestmark = pytest.mark.usefixtures("single_thread")


@functools.cache
def adapter():
    """The tiny Base model (seed 0), shared by the read-only checks."""
    return build_adapter("flux2_klein", path=None, seed=0)


def pipeline(a, is_distilled: bool = False):
    """Flux2KleinPipeline over the adapter's VAE, text encoder and tokenizer and a genuine diffusers transformer loaded
    with the adapter's weights; ``is_distilled`` as a model_index.json would set it."""
    import diffusers

    genuine = diffusers.Flux2Transformer2DModel.from_config(a.denoiser.config)
    genuine.load_state_dict(a.denoiser.state_dict())
    parts = dict(vae=a.vae, text_encoder=a.text_encoders["text_encoder"], tokenizer=a.tokenizers["tokenizer"], transformer=genuine.eval())
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(a.scheduler_config)
    pipe = diffusers.Flux2KleinPipeline(scheduler=scheduler, is_distilled=is_distilled, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def close(ours, theirs, rtol=1e-4, atol_rel=1e-5):
    """``assert_close`` with the absolute tolerance relative to the values' scale (never an absolute one on ~0 values)."""
    theirs = theirs.float()
    torch.testing.assert_close(ours.float(), theirs, rtol=rtol, atol=atol_rel * float(theirs.abs().max()))
    return float((ours.float() - theirs).abs().max())


@contextlib.contextmanager
def distilled(a, value: bool):
    keep = a.is_distilled
    a.is_distilled = value
    try:
        yield a
    finally:
        a.is_distilled = keep


def test_prompt_embeddings_position_ids_and_patchify_match_the_pipeline():
    from diffusers import Flux2KleinPipeline

    a = adapter()
    prompts = ["a cat", "a horse on a hill"]
    ours = a.encode_prompts(prompts)
    pipe = pipeline(a)
    pos, text_ids = pipe.encode_prompt(prompt=list(prompts), max_sequence_length=a.max_sequence_length)
    neg, _ = pipe.encode_prompt(prompt=[""] * 2, max_sequence_length=a.max_sequence_length)  # the pipeline's negative prompt
    assert ours["prompt_embeds"].shape == (2, 512, 96) and a.prompt_tokens() == 512  # 3 layers × width 32, every padded token
    diff = max(close(ours["prompt_embeds"], pos, rtol=1e-5, atol_rel=1e-6), close(ours["negative_prompt_embeds"], neg, rtol=1e-5, atol_rel=1e-6))
    print(f"prompt embeddings: max |Δ| {diff:.2e} of scale {float(pos.abs().max()):.2f}")
    assert not torch.allclose(ours["prompt_embeds"][0], ours["prompt_embeds"][1])
    with distilled(a, True):  # the distilled model encodes no negative prompt
        assert set(a.encode_prompts(prompts[:1]).keys()) == {"prompt_embeds"}
    # position ids (t, h, w, l) and the VAE's 2×2 patchify, as the pipeline builds them
    assert torch.equal(text_position_ids(512), text_ids[0]) and torch.equal(text_ids[0], text_ids[1])
    z = torch.randn(2, 4, 6, 10, generator=torch.Generator().manual_seed(0))
    x = patchify(z)
    assert torch.equal(x, Flux2KleinPipeline._patchify_latents(z)) and torch.equal(unpatchify(x), z)
    assert torch.equal(unpatchify(x), Flux2KleinPipeline._unpatchify_latents(x))
    assert torch.equal(image_position_ids(3, 5), Flux2KleinPipeline._prepare_latent_ids(x)[0])


@pytest.mark.parametrize("config", ["dynamic", "static_terminal"])
def test_schedule_matches_the_pipelines_scheduler(config, monkeypatch):
    """The pipeline's sigmas and timesteps (``linspace(1, 1/K, K)`` through the scheduler with its empirical μ) at two
    image sizes: 32 px (64 tokens: μ interpolated in K) and 288 px (5184 tokens > 4300: the 200-step line); a static-shift
    config stretched to a terminal sigma ignores μ."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    a = adapter()
    if config == "static_terminal":
        monkeypatch.setattr(a, "scheduler_config", dict(a.scheduler_config, use_dynamic_shifting=False, shift=3.0, shift_terminal=0.02))
    for K in (4, 28):
        for size in (32, 288):
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(a.scheduler_config)
            tokens = (size // a.vae_factor // 2) ** 2  # the pipeline's image_seq_len (packed latents' length)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / K, K), mu=compute_empirical_mu(tokens, K))
            ours = a.schedule(K, height=size, width=size)
            torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours[:-1] * 1000, scheduler.timesteps.float(), rtol=1e-6, atol=1e-4)
    same = torch.equal(a.schedule(4, height=32, width=32), a.schedule(4, height=288, width=288))
    assert same == (config == "static_terminal")  # the dynamic shift follows the image size


@pytest.mark.parametrize("case", ["distilled", "base_cfg"])
def test_ode_sampling_and_decode_match_the_pipeline(case):
    """The Euler ODE rollout from the same initial latents equals ``Flux2KleinPipeline(..., output_type="latent")`` (the
    pipeline un-normalises with the VAE's batch-norm statistics and un-patchifies): the distilled model at 4 steps
    without CFG (the pipeline ignores its guidance_scale 4 there) and the Base model with true CFG at guidance 4.
    Decoding equals the VAE's decode of the pipeline's latents."""
    a = adapter()
    prompts = ["a cat", "a dog"]
    g = 1.0 if case == "distilled" else 4.0
    with distilled(a, case == "distilled"):
        settings = SamplerConfig(num_steps=4, kind="ode", noise_level=0.0, height=32, width=32, guidance_scale=g)
        td = sample_trajectories(a, prompts, settings=settings, seeds=[3, 4])
        out = pipeline(a, is_distilled=case == "distilled")(
            prompt=list(prompts), latents=td["latents"][:, 0].clone(), num_inference_steps=4, guidance_scale=4.0, height=32, width=32,
            output_type="latent", max_sequence_length=a.max_sequence_length,
        ).images
    torch.testing.assert_close(td["sigmas"][0], a.schedule(4, height=32, width=32))
    mean, std = a._bn_stats()
    ours = unpatchify(td["latents"][:, -1] * std + mean)
    diff = close(ours, out)
    print(f"{case}: max |Δ| {diff:.2e} of scale {float(out.abs().max()):.2f}")
    if case == "base_cfg":  # CFG matters, so the check can fail
        plain = sample_trajectories(a, prompts, settings=dataclasses.replace(settings, guidance_scale=1.0), seeds=[3, 4])
        assert float((unpatchify(plain["latents"][:, -1] * std + mean) - out).abs().max()) > 1e-3
    ref = a.vae.decode(out).sample
    diff = close(a.decode(td["latents"][:, -1]), (ref / 2 + 0.5).clamp(0, 1))
    print(f"{case} decode: max |Δ| {diff:.2e}")


def test_encode_images_is_the_pipelines_image_encoding_and_decode_inverts_it():
    """``encode_images`` = the pipeline's ``_encode_vae_image`` (posterior mean, 2×2 patchify, batch-norm statistics);
    un-normalising gives back the VAE's latents; decoding in chunks of one equals decoding at once."""
    a = adapter()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    lat = a.encode_images(images)
    assert lat.shape == (3, *a.latent_shape(32, 32)) == (3, 16, 8, 8)
    theirs = pipeline(a)._encode_vae_image(images * 2 - 1, generator=None)
    diff = close(lat, theirs)
    print(f"encode: max |Δ| {diff:.2e} of scale {float(theirs.abs().max()):.2f}")
    mean, std = a._bn_stats()
    close(unpatchify(lat * std + mean), a.vae.encode(images * 2 - 1).latent_dist.mean)
    whole = a.decode(lat)
    a.decode_chunk, keep = 1, a.decode_chunk
    try:
        close(a.decode(lat), whole, rtol=1e-5, atol_rel=1e-6)
    finally:
        a.decode_chunk = keep


def test_forward_flops_equal_torchs_count_and_published_shape_on_meta():
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    a = build_adapter("flux2_klein", path=None, seed=0)  # its own copy: LoRA is attached
    cond = a.encode_prompts(["a cat"])
    x = torch.randn(1, *a.latent_shape(32, 32))
    # torch's counter sees no attention op on a CPU (its SDPA kernel): add the formula's 4·m²·D per block (1 double, 1
    # single) over the m = 64 latent + 512 text tokens, D = 32
    attention = 2 * 4.0 * (64 + 512) ** 2 * 32
    counted = {}
    for rank in (0, 4):
        if rank:
            a.denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(a.lora_target_modules)))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            a.predict(x, torch.tensor([0.5]), cond, 1.0)
        counted[rank] = counter.get_total_flops()
        assert a.forward_flops(32, 32, lora_rank=rank) == pytest.approx(counted[rank] + attention, rel=1e-6)
    assert counted[4] > counted[0]
    big = build_adapter("flux2_klein", shape="full", device="meta", dtype="bfloat16")
    assert sum(p.numel() for p in big.denoiser.parameters()) / 1e9 == pytest.approx(3.88, rel=5e-3)
    assert sum(p.numel() for p in big.text_encoders["text_encoder"].parameters()) / 1e9 == pytest.approx(4.02, rel=5e-3)  # Qwen3-4B
    assert len(big.fsdp_blocks()) == 25 and big.latent_shape(1024, 1024) == (128, 64, 64) and big.prompt_tokens() == 512
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert big.dynamic_shift(1024, 1024, 4) == pytest.approx(np.exp(compute_empirical_mu(64 * 64, 4)), rel=1e-12)


def test_bad_input_is_a_one_line_error():
    a = adapter()
    cond = a.encode_prompts(["a cat"])
    x = torch.zeros(1, *a.latent_shape(32, 32))
    cases = []
    with pytest.raises(ValueError, match="guidance_scale must be ≥ 1") as e:
        a.predict(x, torch.tensor([0.5]), cond, 0.5)
    cases.append(e)
    with distilled(a, True), pytest.raises(ValueError, match=r"step-distilled model runs no CFG.*sampler.guidance_scale=1.0") as e:
        a.predict(x, torch.tensor([0.5]), cond, 4.0)
    cases.append(e)
    with pytest.raises(ValueError, match="divisible by 4") as e:
        a.latent_shape(34, 34)
    cases.append(e)
    keep = a.text_encoder_out_layers
    a.text_encoder_out_layers = (9, 18, 40)
    try:
        with pytest.raises(ValueError, match=r"text_encoder_out_layers \[9, 18, 40\] do not exist in a text encoder of 29 hidden states") as e:
            a._encode_batch(["a cat"])
        cases.append(e)
    finally:
        a.text_encoder_out_layers = keep
    for options, message in (
        (dict(text_encoder_out_layers=[]), "must be a non-empty list"),
        (dict(max_sequence_length=0), "max_sequence_length must be ≥ 1"),
        (dict(shape="flux_dev", device="meta"), "has no shape 'flux_dev'"),
        (dict(cfg_mode="fused"), "cfg_mode must be one of"),
    ):
        with pytest.raises(ValueError, match=message) as e:
            build_adapter("flux2_klein", **options)
        cases.append(e)
    assert all("\n" not in str(e.value) for e in cases)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_distilled_at_four_steps_without_cfg_trains_with_finite_nonzero_gradients(algorithm, tmp_path):
    """FLUX.2-klein as users run the distilled model (4 steps, no CFG, the pipeline's schedule): one Flow-GRPO and one NFT
    step through the CLI on the tiny configuration update the LoRA with a finite, non-zero gradient (a group of 4: two
    32-px JPEG sizes of the tiny model can tie to the byte, leaving no advantage)."""
    import json
    import math

    from diffrl.tools.cli import main

    out = tmp_path / algorithm
    assert main(["train", "experiment=flux2_klein_tiny_flow_grpo", f"algorithm={algorithm}", "+model.options.is_distilled=true", "sampler.num_steps=4",
                 "sampler.guidance_scale=1.0", "trainer.steps=1", "trainer.prompts_per_step=1", "trainer.group_size=4", "eval.every=0",
                 "eval.num_prompts=1", "trainer.progress=false", "trainer.wandb=disabled", f"trainer.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 1 and math.isfinite(train[0]["grad_norm"]) and train[0]["grad_norm"] > 1e-6, train
    written = (out / "config.yaml").read_text()
    assert "num_steps: 4" in written and "is_distilled: true" in written
