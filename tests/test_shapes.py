"""Real-scale construction and activation memory (issue 16).

* Published shapes (``model.options.shape``) build on ``meta`` with the published parameter counts, in the
  target dtype, leaving torch's default dtype and RNG as they were; ``full`` picks each family's flagship; a
  wrong shape or a shape next to ``model.path`` is one clear error, before anything is built.
* The text encoders of a published shape give conditionings of the real widths and token counts (checked
  with the published text widths over a transformer narrowed to run on a CPU).
* Activation checkpointing per block (``model.checkpoint_every``): the gradients equal those without it bit for
  bit; FLOPs executed grow by the recompute and saved activations shrink, both ordered by the granularity;
  copies of a checkpointed module run with their own weights.
* ``model.compile_scope=blocks`` trains exactly like the eager module (aot_eager on a CPU).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffrl import recipes
from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from diffrl.engine.engine import DiffusionEngine
from diffrl.engine.memory import checkpointed_count
from pipelines import build_adapter
from pipelines.base import known_families
from pipelines.shapes import FULL, SHAPES, resolve_shape, shape_names
from pipelines.tiny import TINY_VAE

pytestmark = pytest.mark.usefixtures("single_thread")
known_families()  # each family registers its published shapes on import (pipelines.shapes.register_shape)
EXPECTED_SHAPES = ["flux2_klein_4b", "flux_dev", "flux_kontext", "qwen_image", "qwen_image_edit", "sd35_large", "sd35_medium", "wan21_14b", "wan21_1_3b", "wan22_a14b",
                   "z_image_turbo"]


def test_each_family_registers_its_published_shapes():
    """The shapes live in their families' modules; importing every family registers all of them (and only once)."""
    assert sorted(SHAPES) == EXPECTED_SHAPES
    assert all(SHAPES[name].family in known_families() for name in SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_published_shape_builds_on_meta_at_its_size(name):
    shape = SHAPES[name]
    rng = torch.random.get_rng_state()
    adapter = build_adapter(shape.family, shape=name, device="meta", dtype="bfloat16")
    params = [p for p in adapter.denoiser.parameters()]
    count = sum(p.numel() for p in params) / 1e9
    assert count == pytest.approx(shape.params_billion, rel=5e-3)
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_full_is_each_familys_flagship_and_bad_shapes_are_one_line_errors():
    assert {f: resolve_shape(f, "full").name for f in FULL} == {"sd3": "sd35_large", "flux": "flux_dev", "qwen_image": "qwen_image", "wan": "wan21_14b",
                                                                   "qwen_image_edit": "qwen_image_edit", "flux_kontext": "flux_kontext", "wan22": "wan22_a14b",
                                                                   "z_image": "z_image_turbo", "flux2_klein": "flux2_klein_4b"}
    assert resolve_shape("sd3", "tiny") is None
    with pytest.raises(ValueError, match=r"model family 'sd3' has no shape 'flux_dev'; its shapes are \['tiny', 'full', 'sd35_large', 'sd35_medium'\]"):
        build_adapter("sd3", shape="flux_dev", device="meta")
    with pytest.raises(ValueError, match="give one of them"):
        build_adapter("qwen_image", shape="full", path="/nonexistent", device="meta")
    assert shape_names("digits") == ["tiny"]


def test_validate_rejects_a_bad_shape_before_building():
    cfg = recipes.compose(["experiment=sd3_tiny_flow_grpo", "+model.options.shape=sd35_huge"])
    with pytest.raises(recipes.ConfigError, match="has no shape 'sd35_huge'"):
        recipes.validate(cfg)
    cfg = recipes.compose(["experiment=sd3_tiny_flow_grpo", "+model.options.shape=full", "model.checkpoint_every=0"])
    with pytest.raises(recipes.ConfigError, match="checkpoint_every"):
        recipes.validate(cfg)


# the published text widths and token counts over a transformer narrowed to run on a CPU (joint widths kept)
NARROW = {
    "sd35_medium": dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, caption_projection_dim=32, dual_attention_layers=(), pos_embed_max_size=16, sample_size=16),
    "flux_dev": dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=64, axes_dims_rope=(16, 24, 24)),
    "qwen_image": dict(num_layers=1, num_attention_heads=2, attention_head_dim=64, axes_dims_rope=(16, 24, 24)),
    "wan21_1_3b": dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, ffn_dim=32, freq_dim=32),
}
SMALL_VAE = {
    "sd35_medium": dict(TINY_VAE, latent_channels=16), "flux_dev": dict(TINY_VAE, latent_channels=16),
    "qwen_image": dict(base_dim=8, z_dim=16, dim_mult=(1, 2), num_res_blocks=1, attn_scales=(), temperal_downsample=(False,)),
    "wan21_1_3b": dict(base_dim=4, z_dim=16, dim_mult=(1, 1, 1, 1), num_res_blocks=1, temperal_downsample=(False, True, True)),
}
# (prompt tokens the transformer sees, text width, pooled width): SD3 77 CLIP + 256 T5, FLUX/Wan T5 padded to 512
EXPECTED = {"sd35_medium": (333, 4096, 2048), "flux_dev": (512, 4096, 768), "qwen_image": (None, 3584, None), "wan21_1_3b": (512, 4096, None)}


@pytest.mark.parametrize("name", sorted(NARROW))
def test_published_text_encoders_give_real_width_conditionings(name, monkeypatch):
    shape = SHAPES[name]
    narrowed = dataclasses.replace(shape, name="narrow", transformer={**shape.transformer, **NARROW[name]}, vae=SMALL_VAE[name],
                                   stand_in_text=True)  # 2-layer text encoders of the real widths (the published ones fill a CPU)
    monkeypatch.setitem(SHAPES, "narrow", narrowed)
    options = {"num_frames": 5} if shape.family == "wan" else {}
    adapter = build_adapter(shape.family, shape="narrow", **options)
    adapter.cache_prompts(["a red fox"])
    cond = adapter.encode_prompts(["a red fox"])
    tokens, width, pooled = EXPECTED[name]
    assert cond["prompt_embeds"].shape[-1] == width
    if tokens is not None:
        assert cond["prompt_embeds"].shape[1] == tokens
    else:  # Qwen-Image: stored padded to max_sequence_length, the valid tokens marked
        assert cond["prompt_embeds"].shape[1] == 512 and 0 < int(cond["prompt_embeds_mask"].sum()) < 512
    if pooled is not None:
        assert cond["pooled_prompt_embeds"].shape[-1] == pooled
    size = 32 if shape.family != "wan" else 16
    x = torch.randn(1, *adapter.latent_shape(size, size))
    out = adapter.predict(x, torch.tensor([0.7]), cond, 1.0 if shape.family == "flux" else 2.0)
    assert out.shape == x.shape and torch.isfinite(out).all()


# -- activation checkpointing -----------------------------------------------------------------------
def _engine(checkpointing: bool, every: int = 1, compile_scope: str | None = None) -> DiffusionEngine:
    adapter = build_adapter("sd3", seed=0)
    model = ModelConfig(family="sd3", lora=LoraConfig(rank=4, alpha=8.0), activation_checkpointing=checkpointing, checkpoint_every=every,
                        compile=compile_scope is not None, compile_backend="aot_eager", compile_scope=compile_scope or "model")
    engine = DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=1e-2), sampler=SamplerConfig(guidance_scale=3.0, height=32, width=32), seed=0)
    engine.initialize()
    with torch.no_grad():
        for i, (n, p) in enumerate(sorted(engine.module.named_parameters())):
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return engine


def _loss(engine):
    adapter = engine.adapter
    adapter.cache_prompts(["a cat", "a dog"])
    cond = adapter.encode_prompts(["a cat", "a dog"])
    x = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(1))
    engine.module.train()
    return adapter.predict(x, torch.tensor([0.8, 0.5]), cond, 3.0).square().mean()


def _measure(engine):
    """(gradients, FLOPs executed by forward + backward, bytes of tensors saved for the backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    fc = FlopCounterMode(display=False)
    with fc, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(engine).backward()
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    engine.optimizer.zero_grad(set_to_none=True)
    return grads, fc.get_total_flops(), sum(saved)


def test_checkpointing_keeps_gradients_and_trades_recompute_for_memory():
    plain_grads, plain_flops, plain_saved = _measure(_engine(False))
    runs = {every: _measure(_engine(True, every)) for every in (1, 2)}
    n_blocks = len(build_adapter("sd3").fsdp_blocks())
    assert n_blocks == 2
    for every, (grads, flops, saved) in runs.items():
        assert grads.keys() == plain_grads.keys() and len(grads) > 0
        for name, g in grads.items():
            assert torch.equal(g, plain_grads[name]), name
    (_, flops1, saved1), (_, flops2, saved2) = runs[1], runs[2]
    assert plain_flops < flops2 < flops1  # every block recomputed costs more than every other block
    assert saved1 < saved2 < plain_saved
    # the recompute is one more forward of the checkpointed blocks: every=1 recomputes both, every=2 the first
    assert flops1 - plain_flops > flops2 - plain_flops > 0


def test_checkpointed_blocks_are_counted_and_copies_keep_their_own_weights():
    engine = _engine(True, 1)
    module = engine.module
    assert checkpointed_count(module) == 2
    twin = copy.deepcopy(module)
    assert checkpointed_count(twin) == 2
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x = torch.randn(1, 4, 16, 16)
    kwargs = dict(timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, 5, 80), pooled_projections=torch.randn(1, 64), return_dict=False)
    module.train(), twin.train()
    a, b = module(hidden_states=x, **kwargs)[0], twin(hidden_states=x, **kwargs)[0]
    assert not torch.allclose(a, b)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2.0)
    assert torch.equal(twin(hidden_states=x, **kwargs)[0], a)


def test_blocks_compile_scope_trains_like_eager():
    eager, compiled = _engine(True, 1), _engine(True, 1, compile_scope="blocks")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.adapter.fsdp_blocks())
    assert getattr(compiled.module, "_compiled_call_impl", None) is None
    for engine in (eager, compiled):
        loss = _loss(engine)
        loss.backward()
        engine.optimizer.step()
    for (n, p), (n2, q) in zip(eager.module.named_parameters(), compiled.module.named_parameters()):
        assert n == n2
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_scale_benchmark_counts_the_recompute_and_keeps_parity(tmp_path):
    """``benchmarks/speed/gpu_scale.py`` end to end at a tiny shape (the GPU runs' code path): the rollout and the first
    update agree on every log-prob, and the executed FLOPs of a trajectory's CFG training step are, in units of
    the CFG rollout step (two forwards F), the conditional forward, a backward computing activation gradients
    only (between F and 2F) and the unconditional forward, plus the recompute of the checkpointed blocks (just
    under one F)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import main as scale

    common = ["--shape", "tiny_sd3", "--variants", "eager", "--device", "cpu", "--batch", "4", "--group", "2", "--micro-batch", "2",
              "--steps", "4", "--window-range", "0", "3", "--repeats", "1", "--e2e-iters", "1", "--rank", "4", "--alpha", "8", "--mlp"]
    ratio = {}
    for every in (0, 1):
        out = scale([*common, "--ckpt-every", str(every), "--out", str(tmp_path / f"scale{every}.json")])
        run = out["variants"]["eager"]
        assert "error" not in run and run["logp_ok"] and run["max_abs_dlogp"] <= 1e-6
        assert run["e2e_images_per_s"] > 0 and run["n_text_tokens"] > 0
        f = out["flops"]
        ratio[every] = f["train_step_flops_per_trajectory"] / f["rollout_step_flops_per_image"]
    # per CFG rollout step 2F; a training step F (conditional) + B (backward, activations only: F ≤ B ≤ 2F) + F (unconditional)
    assert 1.5 <= ratio[0] <= 2.0
    # the recompute: the blocks' part of one conditional forward (the blocks are almost all of it)
    assert 0.4 < ratio[1] - ratio[0] <= 0.5


@pytest.mark.parametrize("shape", ["tiny_sd3", "tiny_flux", "tiny_qwen_image"])
def test_scale_benchmark_reference_is_the_diffusers_pipeline(tmp_path, shape):
    """The scale benchmark's ``reference`` variant is the family's diffusers pipeline (``StableDiffusion3Pipeline``,
    ``FluxPipeline``, ``QwenImagePipeline``) called eagerly on the cached embeddings: it returns the batch's decoded
    images, executes per step the FLOPs of diffrl's guided rollout step with LoRA fused (the same transformer on the
    same tokens; within 1 %), and each pair's speed-up is taken against the reference of its own pair."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import main as scale

    out = scale(["--shape", shape, "--variants", "reference,eager_fuse,reference_b,eager_fuse_b", "--device", "cpu", "--batch", "4",
                 "--group", "2", "--steps", "4", "--repeats", "1", "--rollout-only", "--rank", "1", "--alpha", "1", "--out", str(tmp_path / "ref.json")])
    v = out["variants"]
    assert all("error" not in r for r in v.values())
    assert v["reference"]["images_shape"] == [4, 3, 32, 32]
    per_step = out["flops_reference"]["loop_flops_per_image"] / 4
    assert abs(per_step / out["flops_fused"]["rollout_step_flops_per_image"] - 1) < 0.01
    pairs = out["pairs"]["eager_fuse"]["vs_reference"]
    expect = [v[f"eager_fuse{s}"]["rollout_images_per_s"] / v[f"reference{s}"]["rollout_images_per_s"] for s in ("", "_b")]
    assert pairs["ratios"] == [round(x, 4) for x in expect]
    assert abs(pairs["mean"] - sum(pairs["ratios"]) / 2) < 1e-12


def test_hook_free_flop_counter_equals_flop_counter_mode():
    """The scale benchmark counts executed FLOPs with its own dispatch mode (no module hooks, so activation
    checkpointing still frees memory); on a forward + backward through linear layers and SDPA it gives
    FlopCounterMode's total exactly."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import OpFlops

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 96)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def step():
        q, k, v = layer(x).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
        torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

    ours, ref = OpFlops(), FlopCounterMode(display=False)
    with ours:
        step()
    with ref:
        step()
    assert ours.get_total_flops() == ref.get_total_flops() > 2 * 2 * 16 * 32 * 96


@pytest.mark.parametrize("shape", ["tiny_flux_kontext", "tiny_qwen_image_edit"])
def test_scale_benchmark_runs_the_editing_models_with_their_sources(tmp_path, shape):
    """The editing shapes of the scale benchmark (issue 38 item 3): rollouts that edit a source image per prompt and the
    update agree on every log-prob (the source tokens enter both), the sources are fixed by the seed and differ per
    prompt, and the reference variant (text-to-image pipelines only) is a one-line error, not a crash."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import main as scale
    from gpu_scale import source_images

    out = scale(["--shape", shape, "--variants", "eager,reference", "--device", "cpu", "--batch", "4", "--group", "2", "--micro-batch", "2",
                 "--steps", "3", "--window-range", "0", "2", "--repeats", "1", "--e2e-iters", "0", "--rank", "2", "--alpha", "2",
                 "--out", str(tmp_path / "edit.json")])
    run = out["variants"]["eager"]
    assert "error" not in run and run["logp_ok"] and run["max_abs_dlogp"] <= 1e-6 and run["source_size"] == [32, 32]
    # the analytic FLOPs of the editing families (their prompt length depends on the size; was NaN on the H100 run)
    analytic = out["flops"]["analytic_forward_flops_per_image"]
    assert analytic == analytic > 0
    assert "editing model" in out["variants"]["reference"]["error"]
    sources = source_images(2, 32, 32, seed=0)
    assert sources.dtype == torch.uint8 and sources.shape == (2, 3, 32, 32) and not torch.equal(sources[0], sources[1])
    assert torch.equal(sources, source_images(2, 32, 32, seed=0))  # fixed by the seed
