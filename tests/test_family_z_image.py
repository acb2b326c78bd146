"""Z-Image (base and Turbo) against diffusers' ZImagePipeline at the tiny random shape (fp32, CPU): prompt embeddings,
the schedule (static shift of Z-Image-Turbo, and a dynamic-shift config), ODE sampling with CFG (normalisation and
truncation included) and without (Turbo), the FLOPs formula against torch's counter, the published shape on ``meta``
and the one-line errors. The shared suite (tests/test_families.py) covers rollout ↔ training parity, CFG, LoRA and
save → reload for z_image as for every family."""

from __future__ import annotations

import pytest
import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter

pytestmark = pytest.mark.usefixtures("single_thread")
_ADAPTER: list = []


def adapter():
    if not _ADAPTER:
        _ADAPTER.append(build_adapter("z_image", path=None, seed=0))
    return _ADAPTER[0]


def pipeline(a):
    """ZImagePipeline over the adapter's components, with a genuine diffusers transformer holding the same weights."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel.from_config(a.denoiser.config)
    transformer.load_state_dict(a.denoiser.state_dict())
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(a.scheduler_config), vae=a.vae, text_encoder=a.text_encoders["text_encoder"],
        tokenizer=a.tokenizers["tokenizer"], transformer=transformer.eval(),
    ).to("cpu")


def close(ours, theirs, rtol=1e-4, atol_rel=1e-5):
    """``assert_close`` with the absolute tolerance relative to the values' scale (never an absolute one on ~0 values)."""
    theirs = theirs.float()
    torch.testing.assert_close(ours.float(), theirs, rtol=rtol, atol=atol_rel * float(theirs.abs().max()))
    return float((ours.float() - theirs).abs().max())


def test_prompt_embeddings_match_the_pipelines_encode_prompt():
    a = adapter()
    prompts = ["a cat", "a horse on a hill"]
    ours = a.encode_prompts(prompts)
    pos, neg = pipeline(a).encode_prompt(list(prompts), do_classifier_free_guidance=True, negative_prompt=None, max_sequence_length=a.max_sequence_length)
    mask = ours["prompt_embeds_mask"].bool()
    assert ours["prompt_embeds"].shape == (2, a.max_sequence_length, 32) and [int(m.sum()) for m in mask] == [len(p) for p in pos]
    assert len(pos[0]) != len(pos[1])  # prompts of different lengths: the valid tokens are per prompt
    for i in range(2):
        close(ours["prompt_embeds"][i][mask[i]], pos[i], rtol=1e-5, atol_rel=1e-6)
        close(ours["negative_prompt_embeds"][i][ours["negative_prompt_embeds_mask"][i].bool()], neg[i], rtol=1e-5, atol_rel=1e-6)
    assert not ours["prompt_embeds"][~mask].any()  # the padding is zero


@pytest.mark.parametrize("config", ["turbo", "dynamic"])
def test_schedule_matches_the_pipelines_scheduler(config, monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

    a = adapter()
    if config == "dynamic":  # a dynamic-shift config stretched to a terminal sigma: the shift follows the image size
        monkeypatch.setattr(a, "scheduler_config", dict(a.scheduler_config, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                        base_image_seq_len=16, max_image_seq_len=256, shift_terminal=0.02))
    else:
        assert a.shift == 3.0
    K = 6
    for size in (32, 64):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(a.scheduler_config)
        seq = (size // a.vae_factor // 2) ** 2  # ZImagePipeline's image_seq_len (h/2)·(w/2)
        c = scheduler.config
        mu = calculate_shift(seq, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(K), mu=mu)
        ours = a.schedule(K, height=size, width=size)
        torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours[:-1] * 1000, scheduler.timesteps.float(), rtol=1e-6, atol=1e-4)
    assert torch.equal(a.schedule(K, height=32, width=32), a.schedule(K, height=64, width=64)) == (config == "turbo")


@pytest.mark.parametrize("case", ["turbo", "base_cfg"])
def test_ode_sampling_matches_the_pipeline(case):
    """The Euler ODE rollout from the same initial latents equals ``ZImagePipeline(..., output_type="latent")``: Turbo
    (guidance 1 here = the pipeline's 0, no negative branch) and the base model's CFG (s = 4 here = the pipeline's
    guidance_scale 3) with cfg_normalization (active) and cfg_truncation (drops CFG on the last steps)."""
    a = adapter()
    prompts = ["a cat", "a dog"]
    s, options = (1.0, {}) if case == "turbo" else (4.0, dict(cfg_normalization=1.0, cfg_truncation=0.3))
    keep = (a.cfg_normalization, a.cfg_truncation)
    a.cfg_normalization, a.cfg_truncation = options.get("cfg_normalization", 0.0), options.get("cfg_truncation", 1.0)
    try:
        settings = SamplerConfig(num_steps=4, kind="ode", noise_level=0.0, height=32, width=32, guidance_scale=s)
        td = sample_trajectories(a, prompts, settings=settings, seeds=[3, 4])
        pipe = pipeline(a)
        out = pipe(prompt=list(prompts), negative_prompt=[""] * len(prompts) if s > 1 else None, latents=td["latents"][:, 0].clone(), num_inference_steps=4,
                   guidance_scale=s - 1, height=32, width=32, output_type="latent", max_sequence_length=a.max_sequence_length, **options).images
        diff = close(td["latents"][:, -1], out)
        print(f"{case}: max |Δ| {diff:.2e} of scale {float(out.abs().max()):.2f}")
        torch.testing.assert_close(td["sigmas"][0], a.schedule(4, height=32, width=32))
        if case == "base_cfg":  # the options matter, so the check can fail
            a.cfg_normalization, a.cfg_truncation = 0.0, 1.0
            plain = sample_trajectories(a, prompts, settings=settings, seeds=[3, 4])
            assert float((plain["latents"][:, -1] - out).abs().max()) > 1e-3
    finally:
        a.cfg_normalization, a.cfg_truncation = keep
    vae = a.vae  # decode: the pipeline's z / scaling + shift → VAE → [0, 1]
    ref = vae.decode(out / vae.config.scaling_factor + vae.config.shift_factor).sample
    close(a.decode(out), (ref / 2 + 0.5).clamp(0, 1))


def test_forward_flops_equal_torchs_count_and_published_shape_on_meta():
    from torch.utils.flop_counter import FlopCounterMode

    a = adapter()
    cond = a.encode_prompts([a.default_prompts()[0]])
    x = torch.randn(1, *a.latent_shape(32, 32))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        a.predict(x, torch.tensor([0.5]), cond, 1.0)
    # torch's counter sees no attention op on a CPU (SDPA with a mask): add the formula's 4·m²·D per block
    n, t, D = 64, 32, 32  # 8×8 patches; the 12 prompt tokens padded to 32
    attention = 4.0 * D * (1 * (n * n + t * t) + 2 * (n + t) ** 2)
    assert a.forward_flops(32, 32) == pytest.approx(counter.get_total_flops() + attention, rel=1e-6)
    big = build_adapter("z_image", shape="full", device="meta", dtype="bfloat16")
    assert sum(p.numel() for p in big.denoiser.parameters()) / 1e9 == pytest.approx(6.15, rel=5e-3)
    assert sum(p.numel() for p in big.text_encoders["text_encoder"].parameters()) / 1e9 == pytest.approx(4.02, rel=5e-3)  # Qwen3-4B
    assert len(big.fsdp_blocks()) == 34 and big.latent_shape(1024, 1024) == (16, 128, 128)


def test_bad_input_is_a_one_line_error():
    a = adapter()
    cond = a.encode_prompts(["a cat"])
    with pytest.raises(ValueError, match="guidance_scale must be ≥ 1"):
        a.predict(torch.zeros(1, *a.latent_shape(32, 32)), torch.tensor([0.5]), cond, 0.0)
    with pytest.raises(ValueError, match="divisible by 4"):
        a.latent_shape(34, 34)
    with pytest.raises(ValueError, match="cfg_normalization must be ≥ 0"):
        build_adapter("z_image", cfg_normalization=-1.0)
    with pytest.raises(ValueError, match="has no shape 'flux_dev'"):
        build_adapter("z_image", shape="flux_dev", device="meta")


@pytest.mark.parametrize("algorithm", ["flow_grpo", "nft"])
def test_turbo_at_eight_steps_without_cfg_trains_with_finite_nonzero_gradients(algorithm, tmp_path):
    """Z-Image-Turbo as users run it (few-step distilled: 8 steps, no CFG, its own shifted sigmas): one Flow-GRPO and one
    NFT step through the CLI on the tiny configuration update the LoRA with a finite, non-zero gradient."""
    import json
    import math

    from diffrl.tools.cli import main

    out = tmp_path / algorithm
    assert main(["train", "experiment=z_image_tiny_flow_grpo", f"algorithm={algorithm}", "sampler.num_steps=8", "sampler.guidance_scale=1.0",
                 "trainer.steps=1", "trainer.prompts_per_step=1", "trainer.group_size=2", "eval.every=0", "eval.num_prompts=1",
                 "trainer.progress=false", "trainer.wandb=disabled", f"trainer.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 1 and math.isfinite(train[0]["grad_norm"]) and train[0]["grad_norm"] > 1e-6, train
    assert "num_steps: 8" in (out / "config.yaml").read_text()
