"""Wan2.2 (two experts switched at the timestep boundary) against diffusers' WanPipeline with ``transformer_2``.

The shared family suite (tests/test_families.py) covers rollout ↔ training parity, batch invariance, CFG, save/reload
and LoRA for ``wan22`` as for every family; Wan2.1's tests cover what Wan2.2 shares (prompts, VAE, decode). Here: the
ODE rollout with CFG against WanPipeline(transformer, transformer_2, boundary_ratio), with and without
``guidance_scale_2``; which expert runs each step, and a batch mixing noise levels dispatched per sample; SDE log-probs
recomputed exactly with a second guidance scale; ``model.lora.experts``; the saved folder in WanPipeline; the published
A14B shape and FLOPs; the tiny recipe training 2 steps through the CLI.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import make_engine

from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a cat", "a dog on a red sofa"]
G, G2 = 5.0, 2.0  # the high- and low-noise experts' guidance scales where they differ
_BASE = {}


def adapter_with(guidance_scale_2=None):
    """One shared tiny Wan2.2 adapter (seed 0) per ``guidance_scale_2``, without LoRA."""
    if guidance_scale_2 not in _BASE:
        _BASE[guidance_scale_2] = build_adapter("wan22", path=None, seed=0, guidance_scale_2=guidance_scale_2)
    return _BASE[guidance_scale_2]


def wan22_pipeline(adapter):
    """diffusers' WanPipeline over the adapter's components: ``transformer`` + ``transformer_2`` with its
    ``boundary_ratio``, FlowMatchEulerDiscreteScheduler(shift=flow_shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    parts = dict(adapter.components())
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=adapter.shift)
    return WanPipeline(**parts, boundary_ratio=adapter.boundary_ratio).to("cpu")


def ode(num_steps=5, guidance_scale=G):
    return SamplerConfig(num_steps=num_steps, kind="ode", noise_level=0.0, guidance_scale=guidance_scale, height=32, width=32)


# ------------------------------------------------------------------------------------------------
# against WanPipeline(transformer, transformer_2, boundary_ratio)
# ------------------------------------------------------------------------------------------------


def test_ode_rollout_with_cfg_matches_wan_pipeline_with_two_experts_and_guidance_scale_2():
    finals = {}
    for g2 in (None, G2):
        adapter = adapter_with(g2)
        pipe = wan22_pipeline(adapter)
        td = sample_trajectories(adapter, PROMPTS, settings=ode(), seeds=[3, 4])
        # shift 3, 5 steps: timesteps 1000, 900 (≥ 875: transformer), 751, 503, 9 (transformer_2)
        assert adapter.expert_of(td["sigmas"][0, :-1]) == ["high", "high", "low", "low", "low"]
        x0 = td["latents"][:, 0]
        out = pipe(
            prompt=PROMPTS, negative_prompt="", latents=x0, num_inference_steps=5, guidance_scale=G, guidance_scale_2=g2, height=32, width=32,
            num_frames=5, max_sequence_length=adapter.max_sequence_length, output_type="latent",
        ).frames
        torch.testing.assert_close(td["latents"][:, -1], out.float(), rtol=1e-4, atol=1e-4)
        finals[g2] = out
    assert not torch.allclose(out, x0, atol=1e-2)
    # the second scale changes the samples (so the check above can fail), and so does a pipeline without transformer_2
    assert not torch.allclose(finals[None], finals[G2], atol=1e-3)
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    adapter = adapter_with(None)
    one = WanPipeline(transformer=adapter.denoiser.high, vae=adapter.vae, text_encoder=adapter.text_encoders["text_encoder"],
                      tokenizer=adapter.tokenizers["tokenizer"], scheduler=FlowMatchEulerDiscreteScheduler(shift=adapter.shift))
    single = one(prompt=PROMPTS, negative_prompt="", latents=x0, num_inference_steps=5, guidance_scale=G, height=32, width=32, num_frames=5,
                 max_sequence_length=adapter.max_sequence_length, output_type="latent").frames
    assert not torch.allclose(single, finals[None], atol=1e-3)


# ------------------------------------------------------------------------------------------------
# the expert of each step, per sample
# ------------------------------------------------------------------------------------------------


def test_each_step_runs_the_expert_of_its_timestep():
    adapter = adapter_with(None)
    seen = []
    hooks = [getattr(adapter.denoiser, name).register_forward_pre_hook(
        lambda module, args, kwargs, name=name: seen.append((name, kwargs["timestep"].tolist())), with_kwargs=True) for name in ("high", "low")]
    try:
        sample_trajectories(adapter, PROMPTS, settings=ode(guidance_scale=1.0), seeds=[3, 4])
    finally:
        for h in hooks:
            h.remove()
    assert [name for name, _ in seen] == ["high", "high", "low", "low", "low"]
    timesteps = (1000.0 * adapter.schedule(5)[:-1]).tolist()
    assert timesteps[1] >= 875.0 > timesteps[2]
    assert [t for _, t in seen] == [[t, t] for t in timesteps]
    # WanPipeline's test: t ≥ boundary_ratio · 1000 runs transformer (875 itself included)
    assert adapter.boundary_ratio == 0.875 and adapter.denoiser.boundary_timestep == 875.0
    assert adapter.denoiser.is_high(torch.tensor([875.0, 874.99, 1000.0, 0.0])).tolist() == [True, False, True, False]


def manual_cfg(adapter, x, sigma, cond, scales):
    """Each row alone through its expert, called directly: ``u + g·(c − u)`` with the row's guidance scale."""
    rows = []
    for i in range(x.shape[0]):
        expert = adapter.denoiser.high if sigma[i] >= 0.875 else adapter.denoiser.low
        t = 1000.0 * sigma[i : i + 1]
        c, u = (expert(hidden_states=x[i : i + 1], timestep=t, encoder_hidden_states=cond[k][i : i + 1], return_dict=False)[0]
                for k in ("prompt_embeds", "negative_prompt_embeds"))
        g = scales[0] if sigma[i] >= 0.875 else scales[1]
        rows.append(u + g * (c - u))
    return torch.cat(rows)


@pytest.mark.parametrize("cfg_mode", ["split", "batched"])
def test_a_batch_mixing_noise_levels_runs_each_sample_on_its_expert_with_its_scale(cfg_mode):
    adapter = adapter_with(G2)
    if cfg_mode == "batched":
        adapter = build_adapter("wan22", path=None, seed=0, guidance_scale_2=G2, cfg_mode="batched")
    x = torch.randn(4, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = adapter.encode_prompts([PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]])
    sigma = torch.tensor([0.95, 0.5, 0.9, 0.3])  # high, low, high, low: NFT/DPO draw a timestep per sample
    with torch.no_grad():
        mixed = adapter.predict(x, sigma, cond, G)
        torch.testing.assert_close(mixed, manual_cfg(adapter, x, sigma, cond, (G, G2)), rtol=1e-5, atol=1e-5)
        alone = torch.cat([adapter.predict(x[i : i + 1], sigma[i : i + 1], cond[i : i + 1], G) for i in range(4)])
        torch.testing.assert_close(mixed, alone, rtol=1e-5, atol=1e-5)
        # one scale for both experts (guidance_scale_2 = null): the denoiser alone dispatches the mixed batch
        same = adapter_with(None).predict(x, sigma, cond, G)
        torch.testing.assert_close(same, manual_cfg(adapter, x, sigma, cond, (G, G)), rtol=1e-5, atol=1e-5)
        # the module's own forward on mixed timesteps equals each sample through its expert
        t = 1000.0 * sigma
        both = adapter.denoiser(hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
        by_row = [(adapter.denoiser.high if s >= 0.875 else adapter.denoiser.low)(
            hidden_states=x[i : i + 1], timestep=t[i : i + 1], encoder_hidden_states=cond["prompt_embeds"][i : i + 1], return_dict=False)[0]
            for i, s in enumerate(sigma.tolist())]
        torch.testing.assert_close(both, torch.cat(by_row), rtol=1e-5, atol=1e-5)
        # the experts differ (different seeds), so a wrong dispatch would fail the checks above
        other = adapter.denoiser.low(hidden_states=x[:1], timestep=t[:1], encoder_hidden_states=cond["prompt_embeds"][:1], return_dict=False)[0]
        assert not torch.allclose(other, by_row[0], atol=1e-3)
        assert not torch.allclose(same, mixed, atol=1e-3)  # guidance_scale_2 reaches the low-noise rows


def test_sde_log_probs_recomputed_by_training_equal_the_rollouts_with_two_scales():
    adapter = build_adapter("wan22", path=None, seed=0, guidance_scale_2=G2)  # own copy: LoRA is attached
    s = SamplerConfig(num_steps=4, kind="flow_sde", noise_level=0.7, guidance_scale=G, height=32, width=32)
    engine = make_engine(adapter, s, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    td = sample_trajectories(adapter, [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], settings=s, seeds=[5, 6, 7, 8])
    assert adapter.expert_of(td["sigmas"][0, :-1]) == ["high", "low", "low", "low"]  # timesteps 1000, 858, 602, 9
    assert td["sde_mask"].all() and torch.isfinite(td["log_probs"]).all()
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])


# ------------------------------------------------------------------------------------------------
# LoRA per expert (model.lora.experts)
# ------------------------------------------------------------------------------------------------


def engine_with_experts(experts, lr=1e-2):
    from diffrl.engine.engine import DiffusionEngine

    adapter = build_adapter("wan22", path=None, seed=0, guidance_scale_2=G2)
    s = SamplerConfig(num_steps=4, kind="flow_sde", noise_level=0.7, guidance_scale=G, height=32, width=32)
    model = ModelConfig(family="wan22", lora=LoraConfig(rank=4, alpha=4.0, experts=experts))
    return DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=lr), sampler=s), s


@pytest.mark.parametrize("experts", [["low"], ["high", "low"]])
def test_lora_experts_puts_lora_on_the_named_experts_and_a_step_moves_only_them(experts):
    from diffrl.algorithms.advantages import group_advantages
    from diffrl.algorithms.losses import make_step_loss

    engine, s = engine_with_experts(experts)
    engine.initialize()
    lora = {n for n, _ in engine.module.named_parameters() if "lora_" in n}
    assert {n.split(".")[0] for n in lora} == set(experts)
    # every attention projection of a named expert, and nothing else, carries the LoRA
    per_expert = 2 * 2 * 4 * 2  # blocks × (attn1, attn2) × (to_q, to_k, to_v, to_out.0) × (A, B)
    assert len(lora) == per_expert * len(experts)
    assert {n for n, p in engine.module.named_parameters() if p.requires_grad} == lora
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    td = sample_trajectories(engine.adapter, [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, settings=s, seeds=[1, 2, 3, 4],
                             group_id=torch.tensor([0, 0, 1, 1]))
    td["advantages"] = group_advantages(torch.tensor([1.0, -1.0, 0.5, -0.5]), td["group_id"])
    engine.train_batch(td, make_step_loss("flow_grpo", clip_range=0.2))
    moved = {n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved and moved <= lora and {n.split(".")[0] for n in moved} == set(experts)


def test_bad_lora_experts_are_one_line_errors():
    from diffrl.recipes import ConfigError, compose, validate

    engine, _ = engine_with_experts(["mid"])
    with pytest.raises(ValueError, match=r"model.lora.experts=\['mid'\] is invalid: the experts of model family Wan22Adapter are \['high', 'low'\]"):
        engine.initialize()
    with pytest.raises(ConfigError, match=r"model.lora.experts=\['middle'\] is invalid: the experts of model family 'wan22' are \['high', 'low'\]"):
        validate(compose(["experiment=wan22_tiny_flow_grpo", "model.lora.experts=[middle]"]))
    with pytest.raises(ConfigError, match=r"model.lora.experts=\['low'\] is invalid: model family 'wan' has one denoiser, no experts"):
        validate(compose(["experiment=wan_tiny_flow_grpo", "model.lora.experts=[low]"]))
    assert validate(compose(["experiment=wan22_tiny_flow_grpo", "model.lora.experts=[high]"])).model.lora.experts == ["high"]


# ------------------------------------------------------------------------------------------------
# folder, options, published shape, FLOPs
# ------------------------------------------------------------------------------------------------


def test_saved_folder_loads_in_wan_pipeline_and_bad_folders_are_named(tmp_path):
    from diffusers import WanPipeline

    adapter = adapter_with(None)
    folder = adapter.save_pretrained(tmp_path / "wan22")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    assert pipe.config.boundary_ratio == 0.875
    for name, expert in (("transformer", adapter.denoiser.high), ("transformer_2", adapter.denoiser.low)):
        theirs = getattr(pipe, name).state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in expert.state_dict().items())
    # model_index.json's boundary_ratio is read back; the option overrides it
    assert build_adapter("wan22", path=str(folder)).boundary_ratio == 0.875
    assert build_adapter("wan22", path=str(folder), boundary_ratio=0.5).denoiser.boundary_timestep == 500.0
    index["boundary_ratio"] = None
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="no boundary_ratio.*model.family=wan"):
        build_adapter("wan22", path=str(folder))
    shutil.rmtree(folder / "transformer_2")
    with pytest.raises(FileNotFoundError, match="lacks the component transformer_2/"):
        build_adapter("wan22", path=str(folder))
    with pytest.raises(ValueError, match=r"boundary_ratio=1.5 must lie in \(0, 1\)"):
        build_adapter("wan22", path=None, boundary_ratio=1.5)


def test_published_a14b_shape_hub_files_and_flops():
    from pipelines.base import hub_patterns, published_shape
    from pipelines.flops import wan_forward_flops
    from pipelines.shapes import SHAPES, resolve_shape
    from pipelines.wan.adapter import TINY_WAN_TRANSFORMER

    shape = resolve_shape("wan22", "full")
    assert shape.name == "wan22_a14b" and shape.transformer == SHAPES["wan21_14b"].transformer  # A14B's experts: Wan2.1-14B's config
    assert shape.params_billion == pytest.approx(2 * SHAPES["wan21_14b"].params_billion)
    assert published_shape("wan22", "Wan-AI/Wan2.2-T2V-A14B-Diffusers") == "wan22_a14b"
    assert "transformer_2/*" in hub_patterns("wan22") and "model_index.json" in hub_patterns("wan22")
    # per forward: the running expert's Wan FLOPs (both experts share one config)
    adapter = adapter_with(None)
    tokens = 2 * (4 // 2) * (6 // 2)
    for rank in (0, 4):
        assert adapter.forward_flops(32, 48, lora_rank=rank) == wan_forward_flops(TINY_WAN_TRANSFORMER, tokens, 32, rank)


# ------------------------------------------------------------------------------------------------
# the tiny recipe through the CLI
# ------------------------------------------------------------------------------------------------


def test_wan22_tiny_flow_grpo_recipe_trains_two_steps(tmp_path):
    from omegaconf import OmegaConf

    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main(["train", "experiment=wan22_tiny_flow_grpo", "trainer.wandb=disabled", "trainer.progress=false", f"trainer.output_dir={out}",
               "model.lora.experts=[low]"])
    assert rc in (0, None)
    cfg = OmegaConf.load(out / "config.yaml")
    assert cfg.model.family == "wan22" and cfg.model.options.guidance_scale_2 == 3.0 and list(cfg.model.lora.experts) == ["low"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    losses = [v for r in train for k, v in r.items() if "loss" in k and isinstance(v, (int, float))]
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(r["reward/jpeg_compressibility_mean"]) for r in train)
    assert (out / "images" / "eval_step_000002.png").is_file()
