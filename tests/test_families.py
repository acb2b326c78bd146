"""One adapter test suite over every model family (tiny random configurations, fp32, CPU).

Each check runs on every family (digits, sd15, digits_eps, sd3, flux, wan, wan22, qwen_image and the editing families
qwen_image_edit, flux_kontext, with their built-in source images): rollout ↔ training log-prob parity, batch
invariance, guidance (no unconditional branch at guidance 1; CFG equals a manual two-pass; split and batched
CFG agree in outputs and LoRA gradients; FLUX and Kontext: guidance goes to the embedding), save →
``model.path`` reload, LoRA targets and the adapters-disabled reference.
SD3 and FLUX are also checked against the diffusers pipelines (prompt embeddings, schedule, ODE sampling),
and the tiny Flow-GRPO recipes of sd3, flux, sd15, qwen_image and the editing families train 2 steps through
the CLI.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from pipelines.base import family_class, known_families, split_prompts
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

# every registered family (a family added as a folder joins the shared suite), with what the suite needs from its class
FAMILIES = known_families()
SIZE = {f: family_class(f).tiny_size for f in FAMILIES}
EPSILON = {f for f in FAMILIES if family_class(f).prediction_type == "epsilon"}
DISTILLED = {f for f in FAMILIES if family_class(f).guidance_distilled}  # the guidance embedding, no CFG
CFG_FAMILIES = [f for f in FAMILIES if f not in DISTILLED]
GUIDANCE = 3.0
_BASE: dict[str, object] = {}


def base(family: str):
    """One adapter per family without LoRA, shared by the read-only checks."""
    if family not in _BASE:
        _BASE[family] = build_adapter(family, path=None, seed=0)
    return _BASE[family]


def settings(family: str, *, num_steps: int = 3, guidance_scale: float = 1.0, **kw) -> SamplerConfig:
    kind = "ddim" if family in EPSILON else "flow_sde"
    noise = 1.0 if family in EPSILON else 0.7
    return SamplerConfig(
        num_steps=num_steps, kind=kw.pop("kind", kind), noise_level=kw.pop("noise_level", noise),
        height=SIZE[family], width=SIZE[family], guidance_scale=guidance_scale, **kw,
    )


def prompts_of(adapter, n: int) -> list:
    """The first ``n`` built-in prompts: strings, or an editing family's ``EditPrompt`` records (with sources)."""
    return list(adapter.default_prompts()[:n])


def rollout(adapter, prompts: list, **kw):
    """``sample_trajectories`` of prompt strings or ``EditPrompt`` records (their sources as ``source_images``)."""
    texts, sources = split_prompts(prompts)
    return sample_trajectories(adapter, texts, source_images=sources, **kw)


def encode(adapter, prompts: list):
    """The conditioning of prompt strings or ``EditPrompt`` records (their sources as float images in [0, 1])."""
    texts, sources = split_prompts(prompts)
    return adapter.encode(texts, None if sources is None else sources.float() / 255)


def negative(cond):
    """The unconditional conditioning: negative_* entries moved into the positive slots."""
    out = cond.clone()
    for key in list(cond.keys()):
        if key.startswith("negative_"):
            out[key[len("negative_"):]] = cond[key]
    return out


def attach_lora(adapter, rank: int = 4) -> None:
    """A peft LoRA (A seeded, B = 0) on the family's ``lora_target_modules``; the base weights frozen."""
    from peft import LoraConfig

    adapter.denoiser.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        adapter.denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(adapter.lora_target_modules)))


class ForwardRecorder:
    """Records the batch size (and the ``guidance`` kwarg) of every denoiser forward."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[int, torch.Tensor | None]] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))
        g = kwargs.get("guidance")
        self.calls.append((x.shape[0], None if g is None else g.detach().clone()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ------------------------------------------------------------------------------------------------
# the shared suite
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_training_parity_and_batch_invariance(family):
    adapter = build_adapter(family, path=None, seed=0)  # own copy: LoRA is attached
    s = settings(family, guidance_scale=3.5 if family in DISTILLED else GUIDANCE)
    engine = make_engine(adapter, s, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    p = prompts_of(adapter, 2)
    prompts = [p[0], p[0], p[1], p[1]]
    td = rollout(adapter, prompts, settings=s, seeds=[5, 6, 7, 8])
    assert td["sde_mask"].all() and torch.isfinite(td["log_probs"]).all()
    # training recomputes the recorded log-probs exactly (same module, same batch composition)
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    # a sample drawn alone equals the same sample drawn in the batch of 4
    alone = rollout(adapter, prompts[2:3], settings=s, seeds=[7])
    # (batched matmuls may reorder fp32 sums: ~1e-5 differences after a few steps)
    torch.testing.assert_close(alone["latents"][0], td["latents"][2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone["log_probs"][0], td["log_probs"][2], rtol=1e-4, atol=1e-4)
    # a different seed gives a different sample (the check above can fail)
    assert not torch.allclose(td["latents"][2, -1], td["latents"][3, -1], atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_guidance_one_runs_no_uncond_branch_and_cfg_is_two_pass(family):
    adapter = base(family)
    p = prompts_of(adapter, 2)
    cond = encode(adapter, p)
    x = torch.randn(2, *adapter.latent_shape(SIZE[family], SIZE[family]), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.6)
    with torch.no_grad(), ForwardRecorder(adapter.denoiser) as rec:
        out1 = adapter.predict(x, sigma, cond, 1.0)
        out3 = adapter.predict(x, sigma, cond, GUIDANCE)
    if family in DISTILLED:
        # distilled guidance: one forward of batch B each time, the scale goes to the guidance embedding
        assert [b for b, _ in rec.calls] == [2, 2]
        assert torch.equal(rec.calls[0][1], torch.full((2,), 1.0)) and torch.equal(rec.calls[1][1], torch.full((2,), GUIDANCE))
        assert not torch.allclose(out1, out3, atol=1e-4)  # the embedding changes the output
        # no negative prompt is even encoded (Kontext: plus the source's latents)
        assert set(cond.keys()) == {"prompt_embeds", "pooled_prompt_embeds"} | ({"image_latents"} if family == "flux_kontext" else set())
        return
    # guidance 1: conditional only; > 1 with the default cfg_mode=split: an unconditional, then a conditional forward
    assert [b for b, _ in rec.calls] == [2, 2, 2]
    with torch.no_grad():
        uncond = adapter.predict(x, sigma, negative(cond), 1.0)
    expected = uncond + GUIDANCE * (out1 - uncond)
    if family in ("qwen_image", "qwen_image_edit"):  # QwenImagePipeline's true CFG rescales to ‖cond‖ over each packed 2×2 token's channels
        from pipelines.latent import pack_latents, unpack_latents

        c, e = pack_latents(out1), pack_latents(expected)
        expected = unpack_latents(e * c.norm(dim=-1, keepdim=True) / e.norm(dim=-1, keepdim=True), *x.shape[-2:])
    torch.testing.assert_close(out3, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out1, uncond, atol=1e-4)  # the prompt matters, so the CFG check can fail


@pytest.mark.parametrize("family", CFG_FAMILIES)
def test_split_cfg_equals_batched_cfg_without_uncond_gradients(family):
    """cfg_mode=split (default) and batched give the same guided prediction (rtol 1e-5, atol 1e-5: fp32 rounding
    of a batch of 2 against one of 4) and the same LoRA gradients (rtol 1e-4, atol 1e-6); split runs the
    unconditional branch with autograd off, so it builds no graph; an unknown mode is refused."""
    adapters = {}
    for mode in ("split", "batched"):
        adapter = build_adapter(family, path=None, seed=0, cfg_mode=mode)
        attach_lora(adapter)
        randomise_lora(adapter.denoiser, scale=0.05, seed=3)
        adapters[mode] = adapter
    cond = encode(adapters["split"], prompts_of(adapters["split"], 2))
    x = torch.randn(2, *adapters["split"].latent_shape(SIZE[family], SIZE[family]), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.8, 0.3])
    outs, grads, calls = {}, {}, []

    def record(module, args, output):  # each denoiser forward: (mode, batch, grad mode, output carries a graph)
        calls.append((mode, output[0].shape[0], torch.is_grad_enabled(), output[0].grad_fn is not None))

    for mode, adapter in adapters.items():
        hook = adapter.denoiser.register_forward_hook(record)
        try:
            out = adapter.predict(x, sigma, cond, GUIDANCE)
        finally:
            hook.remove()
        out.square().mean().backward()
        outs[mode] = out.detach()
        grads[mode] = {n: p.grad.clone() for n, p in adapter.denoiser.named_parameters() if p.grad is not None}
    assert calls == [("split", 2, False, False), ("split", 2, True, True), ("batched", 4, True, True)]
    torch.testing.assert_close(outs["split"], outs["batched"], rtol=1e-5, atol=1e-5)
    assert grads["split"].keys() == grads["batched"].keys() and all("lora_" in n for n in grads["split"])
    for name, g in grads["split"].items():
        torch.testing.assert_close(g, grads["batched"][name], rtol=1e-4, atol=1e-6)
    assert max(g.abs().max().item() for g in grads["split"].values()) > 1e-6  # gradients exist: the check can fail
    with pytest.raises(ValueError, match=r"model.options.cfg_mode must be one of \('split', 'batched'\), got 'fused'"):
        build_adapter(family, path=None, seed=0, cfg_mode="fused")


def save(adapter, folder):
    adapter.save_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_then_model_path_reproduces_outputs(family, tmp_path):
    adapter = base(family)
    save(adapter, tmp_path / family)
    loaded = build_adapter(family, path=str(tmp_path / family))
    s = settings(family, num_steps=2, guidance_scale=2.0)
    p = prompts_of(adapter, 2)
    a = rollout(adapter, p, settings=s, seeds=[1, 2])
    b = rollout(loaded, p, settings=s, seeds=[1, 2])
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["images"], b["images"])
    assert torch.equal(a["log_probs"], b["log_probs"])
    other = build_adapter(family, path=None, seed=1)  # different weights do give different samples
    assert not torch.equal(rollout(other, p, settings=s, seeds=[1, 2])["latents"], a["latents"])


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_attaches_to_declared_modules_and_reference_equals_base(family):
    adapter = build_adapter(family, path=None, seed=0)
    engine = make_engine(adapter, settings(family), lora_rank=4)
    engine.initialize()
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in engine.module.named_parameters() if "lora_A" in n}
    assert wrapped and all(any(n == m or n.endswith("." + m) for m in adapter.lora_target_modules) for n in wrapped)
    # every declared target is used somewhere, and nothing else of the denoiser trains
    assert all(any(n.endswith("." + m) for n in wrapped) for m in adapter.lora_target_modules)
    assert all("lora_" in n for n, p in engine.module.named_parameters() if p.requires_grad)
    if family in DISTILLED:  # the single-stream blocks' attention is wrapped too
        assert any(n.startswith("single_transformer_blocks.") and n.endswith("attn.to_q") for n in wrapped)
    randomise_lora(engine.module, scale=0.05)
    ref_adapter = base(family)
    n = 2
    x = torch.randn(n, *adapter.latent_shape(SIZE[family], SIZE[family]), generator=torch.Generator().manual_seed(0))
    cond = encode(adapter, prompts_of(adapter, n))
    sigma = torch.full((n,), 0.7)
    with torch.no_grad():
        reference_base = ref_adapter.predict(x, sigma, cond, 1.0)
        with engine.reference() as ref:
            torch.testing.assert_close(ref.predict(x, sigma, cond, 1.0), reference_base, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(adapter.predict(x, sigma, cond, 1.0), reference_base, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# SD3 / FLUX against the diffusers pipelines
# ------------------------------------------------------------------------------------------------


def diffusers_pipeline(family: str, adapter):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    parts = dict(adapter.components())
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"])
    cls = StableDiffusion3Pipeline if family == "sd3" else FluxPipeline
    return cls(**parts).to("cpu")


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_prompt_embeddings_match_the_diffusers_pipeline(family):
    adapter = base(family)
    pipe = diffusers_pipeline(family, adapter)
    p = prompts_of(adapter, 2)
    ours = adapter.encode_prompts(p)
    if family == "sd3":
        pe, npe, ppe, nppe = pipe.encode_prompt(
            p, p, p, do_classifier_free_guidance=True, negative_prompt="", max_sequence_length=adapter.max_sequence_length,
        )
        # CLIP-L ⊕ CLIP-G (64 wide) zero-padded to the T5 width (80), then the T5 sequence
        assert ours["prompt_embeds"].shape == (2, adapter.clip_max_length + adapter.max_sequence_length, 80)
        assert torch.equal(ours["prompt_embeds"][:, : adapter.clip_max_length, 64:], torch.zeros(2, adapter.clip_max_length, 16))
        for key, theirs in (("prompt_embeds", pe), ("negative_prompt_embeds", npe), ("pooled_prompt_embeds", ppe), ("negative_pooled_prompt_embeds", nppe)):
            torch.testing.assert_close(ours[key], theirs, rtol=1e-5, atol=1e-6)
    else:
        pe, ppe, text_ids = pipe.encode_prompt(p, p, max_sequence_length=adapter.max_sequence_length)
        torch.testing.assert_close(ours["prompt_embeds"], pe, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["pooled_prompt_embeds"], ppe, rtol=1e-5, atol=1e-6)
        assert torch.equal(text_ids, torch.zeros(adapter.max_sequence_length, 3))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_schedule_matches_the_diffusers_scheduler(family):
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = base(family)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler_config)
    K = 6
    if family == "sd3":
        assert adapter.shift == 3.0
        scheduler.set_timesteps(K)
        ours = adapter.schedule(K)
    else:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_shift

        for size in (32, 64):  # FluxPipeline's μ from the packed sequence length (h/2)·(w/2)
            seq_len = (size // adapter.vae_factor // 2) ** 2
            mu = diffusers_shift(seq_len, 256, 4096, 0.5, 1.15)
            assert adapter.dynamic_shift(size, size) == pytest.approx(math.exp(mu), rel=1e-12)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / K, K), mu=mu)
        ours = adapter.schedule(K, height=64, width=64)
        assert not torch.allclose(adapter.schedule(K), ours)  # the shift depends on the image size
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-5, atol=1e-6)


def test_flux_packing_and_position_ids_match_flux_pipeline():
    from diffusers import FluxPipeline

    from pipelines.flux.adapter import latent_image_ids
    from pipelines.latent import pack_latents, unpack_latents

    x = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8))
    assert torch.equal(unpack_latents(packed, 6, 8), x)
    # FluxPipeline unpacks by pixel size: latent 6×8 ↔ 12×16 pixels at VAE factor 1 (×2 for the packing)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 6, 8, 1), x)
    assert torch.equal(latent_image_ids(6, 8), FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_ode_rollout_matches_the_diffusers_pipeline(family):
    """Deterministic rollout (Euler ODE) from the same initial noise equals the diffusers pipeline's latents."""
    from pipelines.latent import pack_latents, unpack_latents

    adapter = base(family)
    pipe = diffusers_pipeline(family, adapter)
    p = prompts_of(adapter, 2)
    g = 3.5 if family == "flux" else 4.0
    s = settings(family, num_steps=4, kind="ode", noise_level=0.0, guidance_scale=g)
    td = sample_trajectories(adapter, p, settings=s, seeds=[3, 4])
    x0 = td["latents"][:, 0]
    common = dict(num_inference_steps=4, guidance_scale=g, height=32, width=32, output_type="latent", max_sequence_length=adapter.max_sequence_length)
    if family == "sd3":
        out = pipe(prompt=p, negative_prompt="", latents=x0, **common).images
    else:
        h = x0.shape[-1]
        out = unpack_latents(pipe(prompt=p, latents=pack_latents(x0), **common).images, h, h)
    torch.testing.assert_close(td["latents"][:, -1], out.float(), rtol=1e-4, atol=1e-4)
    # decode: the pipelines' (z / scaling + shift) → VAE → [0, 1]
    vae = adapter.vae
    ref = vae.decode(out / vae.config.scaling_factor + vae.config.shift_factor).sample
    torch.testing.assert_close(adapter.decode(out), (ref / 2 + 0.5).clamp(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_encode_images_inverts_the_latent_normalisation_and_decode_chunks(family):
    adapter = base(family)
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    lat = adapter.encode_images(images)
    assert lat.shape == (3, *adapter.latent_shape(32, 32))
    mean = adapter.vae.encode(images * 2 - 1).latent_dist.mean
    torch.testing.assert_close(lat / adapter.vae.config.scaling_factor + adapter.vae.config.shift_factor, mean, rtol=1e-5, atol=1e-5)
    whole = adapter.decode(lat)
    adapter.decode_chunk, keep = 1, adapter.decode_chunk
    try:
        torch.testing.assert_close(adapter.decode(lat), whole, rtol=1e-5, atol=1e-6)
    finally:
        adapter.decode_chunk = keep
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        adapter.encode_images(images[0])
    with pytest.raises(ValueError, match="divisible"):
        adapter.latent_shape(34, 34)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_prompt_cache_drops_the_text_encoders_and_names_uncached_prompts(family):
    adapter = build_adapter(family, path=None, seed=0, drop_text_encoders=True)
    p = prompts_of(adapter, 3)
    before = adapter.encode_prompts(p)
    adapter.cache_prompts(p)
    assert not adapter.text_encoders_loaded
    after = adapter.encode_prompts([p[2], p[0]])
    for key in before.keys():
        torch.testing.assert_close(after[key], before[key][torch.tensor([2, 0])], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not in the prompt-embedding cache.*cache_prompts"):
        adapter.encode_prompts(["a prompt never cached"])


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_missing_folder_or_component_is_named(family, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter(family, path=str(tmp_path / "nowhere"))
    folder = tmp_path / family
    base(family).save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["transformer"][1] == ("SD3Transformer2DModel" if family == "sd3" else "FluxTransformer2DModel")
    import shutil

    shutil.rmtree(folder / "tokenizer_2")
    with pytest.raises(FileNotFoundError, match="tokenizer_2"):
        build_adapter(family, path=str(folder))


# ------------------------------------------------------------------------------------------------
# the tiny recipes train through the CLI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux", "sd15", "qwen_image", "qwen_image_edit", "flux_kontext"])
def test_tiny_flow_grpo_recipe_trains_two_steps(family, tmp_path):
    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main([
        "train", f"experiment={family}_tiny_flow_grpo", "trainer.steps=2", f"trainer.output_dir={out}",
        "trainer.wandb=disabled", "trainer.progress=false", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "sampler.num_steps=2", "sampler.eval_num_steps=2", "eval.every=2", "eval.seeds_per_prompt=1",
        "trainer.checkpoint_every=0",
    ])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    losses = [v for r in train for k, v in r.items() if "loss" in k and isinstance(v, (int, float))]
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(r["reward/jpeg_compressibility"]) for r in train if "reward/jpeg_compressibility" in r)
    if family in ("qwen_image_edit", "flux_kontext"):  # the built-in sources reached the source-aware reward
        assert all(-1.0 <= r["reward/source_similarity_mean"] <= 1.0 for r in train)  # SSIM, finite
