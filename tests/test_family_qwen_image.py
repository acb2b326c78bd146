"""Qwen-Image family checks against diffusers' QwenImagePipeline on the tiny random components (fp32, CPU):
prompt embeddings (template, dropped system tokens, masks), the dynamic-shift schedule, an ODE rollout with
true CFG, the true-CFG formula with its norm rescale (and the detached negative branch), VAE normalisation,
the prompt cache, missing components, FLOPs, and the tiny Flow-GRPO recipe through the CLI. The shared
suite (parity, batch invariance, save → reload, LoRA) runs it from tests/test_families.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pipelines import build_adapter
from pipelines.latent import pack_latents, unpack_latents
from pipelines.qwen_image.adapter import PROMPT_TEMPLATE, PROMPT_TEMPLATE_START_IDX, true_cfg

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a red seven", "a dark blue two on a white background, drawn thick"]  # different lengths: masks matter
_BASE: dict[str, object] = {}


def base():
    if "a" not in _BASE:
        _BASE["a"] = build_adapter("qwen_image", path=None, seed=0)
    return _BASE["a"]


def pipeline(adapter):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    parts = dict(adapter.components())
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"])
    return QwenImagePipeline(**parts).to("cpu")


def negative(cond):
    out = cond.clone()
    for key in ("prompt_embeds", "prompt_embeds_mask"):
        out[key] = cond["negative_" + key]
    return out


def test_prompt_embeddings_match_the_pipeline():
    adapter = base()
    pipe = pipeline(adapter)
    tok = adapter.tokenizers["tokenizer"]
    # the tiny tokenizer reproduces the real template split: its system part is exactly the 34 dropped tokens
    system_part = PROMPT_TEMPLATE.split("{}")[0]
    assert len(tok(system_part).input_ids) == PROMPT_TEMPLATE_START_IDX == pipe.prompt_template_encode_start_idx
    assert PROMPT_TEMPLATE == pipe.prompt_template_encode
    ours = adapter.encode_prompts(PROMPTS)
    pe, pm = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=adapter.max_sequence_length)
    n = pe.shape[1]
    assert pm is not None and pm.sum(1).tolist()[0] < n  # the shorter prompt is padded
    full = [len(tok(PROMPT_TEMPLATE.format(p)).input_ids) - PROMPT_TEMPLATE_START_IDX for p in PROMPTS]
    assert ours["prompt_embeds_mask"].sum(1).tolist() == full == pm.sum(1).tolist()
    torch.testing.assert_close(ours["prompt_embeds"][:, :n], pe, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours["prompt_embeds_mask"][:, :n], pm)
    # stored padded to max_sequence_length with zeros, so any two batches concatenate
    assert ours["prompt_embeds"].shape == (2, adapter.max_sequence_length, 32)
    assert not ours["prompt_embeds"][:, n:].any() and not ours["prompt_embeds_mask"][:, n:].any()
    npe, npm = pipe.encode_prompt("", device="cpu", max_sequence_length=adapter.max_sequence_length)
    assert npm is None  # a single prompt: the pipeline drops the all-ones mask
    k = npe.shape[1]
    assert k == 5  # "<|im_end|>\n<|im_start|>assistant\n"
    for i in range(2):
        torch.testing.assert_close(ours["negative_prompt_embeds"][i, :k], npe[0], rtol=1e-5, atol=1e-6)
    assert ours["negative_prompt_embeds_mask"].sum(1).tolist() == [k, k]
    # a prompt's embedding does not depend on the batch it is encoded in (rollout encodes one per call)
    alone = adapter.encode_prompts(PROMPTS[:1])
    torch.testing.assert_close(alone["prompt_embeds"][0], ours["prompt_embeds"][0], rtol=1e-5, atol=1e-6)


def test_schedule_matches_the_pipeline_scheduler_at_a_given_size():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    adapter = base()
    cfg = adapter.scheduler_config
    K = 6
    schedules = []
    for size in (32, 64, 128):
        seq_len = (size // adapter.vae_factor // 2) ** 2  # the packed latent length the pipeline feeds calculate_shift
        mu = calculate_shift(seq_len, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"])
        assert adapter.dynamic_shift(size, size) == pytest.approx(math.exp(mu), rel=1e-12)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / K, K), mu=mu)
        ours = adapter.schedule(K, height=size, width=size)
        torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)
        assert ours[-2].item() == pytest.approx(cfg["shift_terminal"], abs=1e-7) and ours[-1].item() == 0.0
        schedules.append(ours)
    assert not torch.allclose(schedules[0], schedules[2])  # the shift depends on the image size
    # without a size: the pipeline's default image side 128·vae_factor
    torch.testing.assert_close(adapter.schedule(K), adapter.schedule(K, height=adapter.sample_size, width=adapter.sample_size))


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_ode_rollout_with_true_cfg_matches_the_pipeline(guidance):
    """Euler ODE from the same initial noise: our rollout's final latents equal QwenImagePipeline's (true CFG with
    the negative prompt "" at 4.0; no negative prompt at 1.0), and decode equals the pipeline's images."""
    from diffrl.config import SamplerConfig
    from diffrl.sampling.rollout import sample_trajectories

    adapter = base()
    pipe = pipeline(adapter)
    s = SamplerConfig(num_steps=4, kind="ode", noise_level=0.0, height=32, width=32, guidance_scale=guidance)
    td = sample_trajectories(adapter, PROMPTS, settings=s, seeds=[3, 4])
    x0 = td["latents"][:, 0]
    h = x0.shape[-1]
    common = dict(
        prompt=PROMPTS, true_cfg_scale=guidance, num_inference_steps=4, height=32, width=32, latents=pack_latents(x0),
        max_sequence_length=adapter.max_sequence_length,
    )
    if guidance > 1:
        common["negative_prompt"] = ""
    out = unpack_latents(pipe(output_type="latent", **common).images, h, h)
    torch.testing.assert_close(td["latents"][:, -1], out.float(), rtol=1e-4, atol=1e-4)
    images = pipe(output_type="pt", **common).images  # unpack → (z·std + mean) → VAE → [0, 1]
    torch.testing.assert_close(adapter.decode(td["latents"][:, -1]), images.float(), rtol=1e-4, atol=1e-4)


def test_true_cfg_formula_with_norm_rescale_and_detached_negative():
    # closed forms: ‖cond‖ = 5 and comb = 2·cond → cond itself; an orthogonal case by hand
    cond = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])
    neg = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])
    out = true_cfg(cond, neg, 2.0)
    torch.testing.assert_close(out[0, 0], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(out[0, 1], torch.tensor([2.0, -1.0]) / math.sqrt(5.0))  # comb = [2, −1], ‖cond‖ = 1

    adapter = build_adapter("qwen_image", path=None, seed=0)
    cond = adapter.encode_prompts(PROMPTS)
    g = 4.0
    x = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.7)
    weight = adapter.denoiser.proj_out.weight
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))  # (‖out‖² would not see the negative: the rescale fixes it)
    out = adapter.predict(x, sigma, cond, g)
    (grad,) = torch.autograd.grad((out * probe).sum(), weight)

    def manual(detach: bool) -> torch.Tensor:
        """Two separate forwards (unpadded texts), packed, rescaled per 2×2 token over its 4C channels."""
        c = pack_latents(adapter.predict(x, sigma, cond, 1.0))
        n = pack_latents(adapter.predict(x, sigma, negative(cond), 1.0))
        n = n.detach() if detach else n
        comb = n + g * (c - n)
        return unpack_latents(comb * torch.linalg.vector_norm(c, dim=-1, keepdim=True) / torch.linalg.vector_norm(comb, dim=-1, keepdim=True), 16, 16)

    torch.testing.assert_close(out, manual(True), rtol=1e-4, atol=1e-5)
    (grad_manual,) = torch.autograd.grad((manual(True) * probe).sum(), weight)
    torch.testing.assert_close(grad, grad_manual, rtol=1e-3, atol=1e-5)  # the negative branch carries no gradient
    (grad_both,) = torch.autograd.grad((manual(False) * probe).sum(), weight)
    assert not torch.allclose(grad_both, grad, rtol=1e-3, atol=1e-5)  # (so the detach check can fail)
    with torch.no_grad():
        c = pack_latents(adapter.predict(x, sigma, cond, 1.0))
        n = pack_latents(adapter.predict(x, sigma, negative(cond), 1.0))
        comb = unpack_latents(n + g * (c - n), 16, 16)
    plain = adapter.predict(x, sigma, cond, 1.0)
    assert not torch.allclose(out, comb, atol=1e-4)  # the rescale matters
    assert not torch.allclose(out, plain, atol=1e-4)
    with pytest.raises(ValueError, match="guidance_scale ≥ 1"):
        adapter.predict(x, sigma, cond, 0.5)


def test_vae_normalisation_roundtrip_and_decode_chunks():
    adapter = base()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    lat = adapter.encode_images(images)
    assert lat.shape == (3, *adapter.latent_shape(32, 32)) == (3, 4, 16, 16)
    vae = adapter.vae
    mean = vae.encode((images * 2 - 1)[:, :, None]).latent_dist.mean[:, :, 0]
    m = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(lat * std + m, mean, rtol=1e-5, atol=1e-5)
    whole = adapter.decode(lat)
    ref = vae.decode((lat * std + m)[:, :, None]).sample[:, :, 0]
    torch.testing.assert_close(whole, (ref / 2 + 0.5).clamp(0, 1), rtol=1e-5, atol=1e-6)
    adapter.decode_chunk, keep = 1, adapter.decode_chunk
    try:
        torch.testing.assert_close(adapter.decode(lat), whole, rtol=1e-5, atol=1e-6)
    finally:
        adapter.decode_chunk = keep
    with pytest.raises(ValueError, match="divisible"):
        adapter.latent_shape(34, 34)


def test_prompt_cache_drops_the_text_encoder_and_names_uncached_prompts():
    adapter = build_adapter("qwen_image", path=None, seed=0, drop_text_encoders=True)
    p = [*PROMPTS, "a green four"]
    before = adapter.encode_prompts(p)
    adapter.cache_prompts(p)
    assert not adapter.text_encoders_loaded
    after = adapter.encode_prompts([p[2], p[0]])
    for key in before.keys():
        torch.testing.assert_close(after[key], before[key][torch.tensor([2, 0])], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not in the prompt-embedding cache.*cache_prompts"):
        adapter.encode_prompts(["a prompt never cached"])


def test_missing_folder_or_component_is_named(tmp_path):
    import shutil

    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter("qwen_image", path=str(tmp_path / "nowhere"))
    folder = tmp_path / "qwen"
    base().save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLQwenImage"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for name in ("tokenizer", "text_encoder"):
        broken = tmp_path / f"no_{name}"
        shutil.copytree(folder, broken)
        shutil.rmtree(broken / name)
        with pytest.raises(FileNotFoundError, match=f"lacks the component {name}/"):
            build_adapter("qwen_image", path=str(broken))


def test_flops_counter_matches_flop_counter_mode_on_predict():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.engine.flops import counter_for_adapter
    from pipelines.flops import qwen_image_forward_flops

    adapter = base()
    counter = counter_for_adapter(adapter, 32, 32)
    p = adapter.default_prompts()[0]
    cond = adapter.encode_prompts([p, p])
    # the family declares its FLOPs: 64 packed latent tokens and the prompt's valid text tokens (not the padding)
    n_text = int(cond["prompt_embeds_mask"][0].sum())
    assert n_text < cond["prompt_embeds"].shape[1] and adapter.prompt_tokens() == n_text
    assert counter.forward_flops(1) == adapter.forward_flops(32, 32) == qwen_image_forward_flops(dict(adapter.denoiser.config), 64, n_text)
    mode = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), mode:
        adapter.predict(torch.zeros(2, *adapter.latent_shape(32, 32)), torch.full((2,), 0.5), cond, 1.0)
    assert counter.forward_flops(2) == pytest.approx(mode.get_total_flops(), rel=0.05)


def test_tiny_recipe_trains_two_steps_through_the_cli(tmp_path):
    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main(["train", "experiment=qwen_image_tiny_flow_grpo", "trainer.wandb=disabled", "trainer.progress=false", f"trainer.output_dir={out}"])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    losses = [v for r in train for k, v in r.items() if "loss" in k and isinstance(v, (int, float))]
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(r["reward/jpeg_compressibility_mean"]) and r["grad_norm"] > 0 for r in train)
    # on-policy first epoch: the training pass recomputes the rollout's log-probs exactly (ratio exactly 1)
    assert all(r["first_ratio_mean"] == 1.0 for r in train)


def test_export_lora_loads_into_qwen_image_pipeline(tmp_path):
    """``diffrl export-lora`` writes the LoRA in the diffusers format that QwenImagePipeline.load_lora_weights reads
    (QwenImageAdapter.lora_pipeline): the pipeline's transformer then equals the trained one."""
    from helpers import make_engine
    from omegaconf import OmegaConf

    from diffrl.checkpoint import save_engine
    from diffrl.config import SamplerConfig
    from diffrl.recipes import compose
    from diffrl.tools.cli import main
    from tests.conftest import randomise_lora

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["model=qwen_image_tiny", "model.lora.rank=4"])))
    adapter = build_adapter("qwen_image", path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=2, height=32, width=32), lora_rank=4, lora_alpha=8.0)
    engine.initialize()
    randomise_lora(engine.module, scale=0.05, seed=1)
    ckpt = save_engine(engine, run / "checkpoints", global_step=3)
    out = tmp_path / "lora"
    assert main(["export-lora", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "diffrl_lora.json").read_text())["pipeline"] == "QwenImagePipeline"

    pipe = pipeline(build_adapter("qwen_image", path=None, seed=0))
    pipe.load_lora_weights(str(out))
    cond = adapter.encode_prompts(PROMPTS[:1] * 2)
    n_text = int(cond["prompt_embeds_mask"][0].sum())
    kwargs = dict(  # 64 packed tokens (8×8 patches of a 16×16 latent) of 4·4 channels
        hidden_states=torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0)),
        timestep=torch.tensor([0.8, 0.3]), encoder_hidden_states=cond["prompt_embeds"][:, :n_text],
        encoder_hidden_states_mask=None, img_shapes=[[(1, 8, 8)]] * 2, return_dict=False,
    )
    with torch.no_grad():
        ours = adapter.denoiser(**kwargs)[0]
        theirs = pipe.transformer(**kwargs)[0]
        with engine.reference() as ref:
            base_out = ref.denoiser(**kwargs)[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base_out).abs().max() > 1e-3
