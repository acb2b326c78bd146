"""The SD1.5 family (tiny random configuration): DDIM schedule and step against diffusers, parity, CFG,
save/load, LoRA."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines.sd15.adapter import SD15Adapter, alphas_cumprod, build_tiny_components, save_pipeline
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

@pytest.fixture(scope="module")
def sd15():
    return SD15Adapter(path=None, seed=0)

def test_schedule_is_ddim_leading_spacing_on_the_scaled_linear_betas(sd15):
    from diffusers import DDIMScheduler

    reference = DDIMScheduler(**{k: v for k, v in sd15.scheduler_config.items() if not k.startswith("_")})
    reference.set_timesteps(10)
    abar = alphas_cumprod(sd15.scheduler_config)
    torch.testing.assert_close(abar.float(), reference.alphas_cumprod, rtol=1e-6, atol=1e-7)
    sigmas = sd15.schedule(10)
    expected = torch.sqrt(1 - reference.alphas_cumprod[reference.timesteps])
    torch.testing.assert_close(sigmas[:-1], expected, rtol=1e-5, atol=1e-6)
    assert sigmas[-1].item() == pytest.approx(float(torch.sqrt(1 - reference.final_alpha_cumprod)))
    assert torch.equal(sd15.timestep(sigmas[:-1]), reference.timesteps)

def test_ddim_step_matches_diffusers_ddim_scheduler(sd15):
    from diffusers import DDIMScheduler

    from diffrl.sampling.sde import ddim_step

    reference = DDIMScheduler(**{k: v for k, v in sd15.scheduler_config.items() if not k.startswith("_")})
    reference.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigmas = sd15.schedule(10)
    for i in (0, 4, 9):
        t = reference.timesteps[i]
        # η = 0: deterministic, must equal diffusers' DDIM step; scale by √ᾱ: diffrl's x is the VP sample itself
        ours = ddim_step(eps, x, sigmas[i].item(), sigmas[i + 1].item(), noise_level=0.0).prev_sample
        theirs = reference.step(eps, t, x, eta=0.0).prev_sample
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        # η = 1: diffusers' step with zero noise is our mean, and our std² is its variance
        ours1 = ddim_step(eps, x, sigmas[i].item(), sigmas[i + 1].item(), noise_level=1.0, prev_sample=x)
        theirs1 = reference.step(eps, t, x, eta=1.0, variance_noise=torch.zeros_like(x)).prev_sample
        torch.testing.assert_close(ours1.mean, theirs1, rtol=1e-4, atol=1e-5)
        prev_t = t - 1000 // 10
        variance = reference._get_variance(t, prev_t)
        assert ours1.std.flatten()[0].item() ** 2 == pytest.approx(float(variance), rel=1e-4)

def test_rollout_training_parity_and_batch_invariance():
    sd15 = SD15Adapter(path=None, seed=0)  # its own copy: LoRA is attached below
    settings = SamplerConfig(num_steps=3, kind="ddim", noise_level=1.0, height=32, width=32, guidance_scale=3.0)
    engine = make_engine(sd15, settings, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    prompts = ["a cat", "a cat", "a dog", "a dog"]
    td = sample_trajectories(sd15, prompts, settings=settings, seeds=[5, 6, 7, 8])
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    alone = sample_trajectories(sd15, prompts[2:3], settings=settings, seeds=[7])
    # a batch of one runs other conv/matmul blockings than a batch of four: float32 rounding through a UNet and 3 steps
    # (ATEN_CPU_CAPABILITY=default on an AVX2 CPU, 2026-12-07: 1.2e-5 absolute on latents of magnitude ~0.1); a batch bug
    # (another prompt's or seed's row) differs by O(1)
    torch.testing.assert_close(alone["latents"][0], td["latents"][2], rtol=1e-4, atol=1e-4)
    # guidance > 1 equals a manual two-pass CFG
    x = td["latents"][:, 1]
    sigma = td["sigmas"][:, 1]
    cfg = sd15.predict(x, sigma, td["cond"], 3.0)
    t = sd15.timestep(sigma)
    cond = sd15.denoiser(x, t, encoder_hidden_states=td["cond"]["prompt_embeds"]).sample
    uncond = sd15.denoiser(x, t, encoder_hidden_states=td["cond"]["negative_prompt_embeds"]).sample
    torch.testing.assert_close(cfg, uncond + 3.0 * (cond - uncond), rtol=1e-4, atol=1e-5)

def test_save_pretrained_then_model_path_reproduces_outputs(tmp_path, sd15):
    folder = save_pipeline(build_tiny_components(seed=0), tmp_path / "sd15")
    loaded = SD15Adapter(path=str(folder))
    settings = SamplerConfig(num_steps=2, kind="ddim", noise_level=0.0, height=32, width=32)
    a = sample_trajectories(sd15, ["a horse"], settings=settings, seeds=[1])
    b = sample_trajectories(loaded, ["a horse"], settings=settings, seeds=[1])
    assert torch.equal(a["images"], b["images"])
    (folder / "vae" / "config.json").unlink()
    import shutil

    shutil.rmtree(folder / "tokenizer")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        SD15Adapter(path=str(folder))

def test_lora_attaches_to_attention_and_reference_equals_base(sd15):
    adapter = SD15Adapter(path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=2), lora_rank=4)
    engine.initialize()
    names = [n for n, _ in engine.module.named_parameters() if "lora_A" in n]
    assert names and all(any(f".{m}." in n for m in adapter.lora_target_modules) for n in names)
    randomise_lora(engine.module, scale=0.05)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = adapter.encode_prompts(["a cat", "a dog"])
    sigma = torch.full((2,), 0.7)
    base = sd15.predict(x, sigma, cond, 1.0)
    with torch.no_grad(), engine.reference() as ref:
        torch.testing.assert_close(ref.predict(x, sigma, cond, 1.0), base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapter.predict(x, sigma, cond, 1.0), base, atol=1e-4)

def test_flow_step_kinds_refuse_an_epsilon_model(sd15):
    with pytest.raises(ValueError, match="sampler.kind=ddim"):
        sample_trajectories(sd15, ["a cat"], settings=SamplerConfig(num_steps=2, kind="flow_sde", height=32, width=32), seeds=[0])



def test_ddim_clip_sample_matches_diffusers_and_is_selectable(sd15):
    from diffusers import DDIMScheduler

    from diffrl.sampling.sde import run_step

    config = {k: v for k, v in sd15.scheduler_config.items() if not k.startswith("_")}
    reference = DDIMScheduler(**{**config, "clip_sample": True, "clip_sample_range": 1.0})
    reference.set_timesteps(10)
    g = torch.Generator().manual_seed(3)
    x, eps = 3 * torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigmas = sd15.schedule(10)
    for i in (0, 5):
        ours = run_step("ddim", eps, x, sigmas[i].item(), sigmas[i + 1].item(), noise_level=0.0, prediction_type="epsilon", clip_sample=1.0)
        theirs = reference.step(eps, reference.timesteps[i], x, eta=0.0)
        torch.testing.assert_close(ours.prev_sample, theirs.prev_sample, rtol=1e-4, atol=1e-5)
        assert ours.x0.abs().max() <= 1.0 and theirs.pred_original_sample.abs().max() <= 1.0
    unclipped = run_step("ddim", eps, x, sigmas[0].item(), sigmas[1].item(), noise_level=0.0, prediction_type="epsilon")
    assert unclipped.x0.abs().max() > 1.0  # the clamp was active
    settings = SamplerConfig(num_steps=2, kind="ddim", noise_level=1.0, clip_sample=1.0, height=32, width=32)
    engine = make_engine(sd15, settings, lora_rank=0)
    td = sample_trajectories(sd15, ["a cat", "a dog"], settings=settings, seeds=[1, 2])
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])  # rollout and training clip alike
