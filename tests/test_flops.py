"""FLOPs: every architecture formula (``pipelines.flops``) within 5 % of torch's FlopCounterMode on tiny configs and
full-size ones (meta tensors); every family declares the FLOPs of its own forward (``forward_flops``, LoRA
included), which ``diffrl.engine.flops.counter_for_adapter`` uses; the MFU arithmetic."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import make_engine
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl.config import SamplerConfig
from diffrl.engine.flops import DiffusionFlopsCounter, counter_for_adapter
from pipelines import build_adapter
from pipelines.digits import DigitsAdapter
from pipelines.flops import flux_forward_flops, mmdit_forward_flops, qwen_image_forward_flops, unet2d_forward_flops

pytestmark = pytest.mark.usefixtures("single_thread")

SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
SD3_TINY = dict(
    sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=4,
    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=16, dual_attention_layers=(0,),
)
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
FLUX_TINY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
)
QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
)
QWEN_TINY = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
)
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)


def _counted(model, **inputs) -> float:
    """FlopCounterMode's count of one forward; SDPA runs its math decomposition, whose matmuls are
    counted (torch registers no FLOP formula for the CPU flash-attention kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(**inputs, return_dict=False)
    return float(counter.get_total_flops())


def _build(cls, config, meta: bool):
    if meta:
        with torch.device("meta"):
            return cls(**config).eval()
    torch.manual_seed(0)
    return cls(**config).eval()


@pytest.mark.parametrize("config,meta,latent,n_text", [(SD3_TINY, False, 16, 5), (SD35_MEDIUM, True, 64, 333)])
def test_mmdit_formula_matches_flop_counter(config, meta, latent, n_text):
    from diffusers import SD3Transformer2DModel

    model = _build(SD3Transformer2DModel, config, meta)
    device = "meta" if meta else "cpu"
    counted = _counted(
        model, hidden_states=torch.zeros(1, config["in_channels"], latent, latent, device=device),
        encoder_hidden_states=torch.zeros(1, n_text, config["joint_attention_dim"], device=device),
        pooled_projections=torch.zeros(1, config["pooled_projection_dim"], device=device), timestep=torch.ones(1, device=device),
    )
    n_image = (latent // config["patch_size"]) ** 2
    analytic = mmdit_forward_flops(config, n_image, n_text)
    assert analytic == pytest.approx(counted, rel=0.05)
    if meta:  # issue 8's figure: 2443 GFLOP per image per forward for SD3.5-M at 512 px
        assert analytic / 1e9 == pytest.approx(2443, rel=0.03)


@pytest.mark.parametrize("config,meta,n_image,n_text", [(FLUX_TINY, False, 16, 6), (FLUX_DEV, True, 4096, 512)])
def test_flux_formula_matches_flop_counter(config, meta, n_image, n_text):
    from diffusers import FluxTransformer2DModel

    model = _build(FluxTransformer2DModel, config, meta)
    device = "meta" if meta else "cpu"
    inputs = dict(
        hidden_states=torch.zeros(1, n_image, config["in_channels"], device=device),
        encoder_hidden_states=torch.zeros(1, n_text, config["joint_attention_dim"], device=device),
        pooled_projections=torch.zeros(1, config["pooled_projection_dim"], device=device), timestep=torch.ones(1, device=device),
        img_ids=torch.zeros(n_image, 3, device=device), txt_ids=torch.zeros(n_text, 3, device=device),
    )
    if config["guidance_embeds"]:
        inputs["guidance"] = torch.ones(1, device=device)
    assert flux_forward_flops(config, n_image, n_text) == pytest.approx(_counted(model, **inputs), rel=0.05)


@pytest.mark.parametrize("config,meta,side,n_text", [(QWEN_TINY, False, 4, 7), (QWEN_IMAGE, True, 64, 120)])
def test_qwen_image_formula_matches_flop_counter(config, meta, side, n_text):
    from diffusers import QwenImageTransformer2DModel

    model = _build(QwenImageTransformer2DModel, config, meta)
    device = "meta" if meta else "cpu"
    n_image = side * side
    counted = _counted(
        model, hidden_states=torch.zeros(1, n_image, config["in_channels"], device=device),
        encoder_hidden_states=torch.zeros(1, n_text, config["joint_attention_dim"], device=device),
        encoder_hidden_states_mask=torch.ones(1, n_text, dtype=torch.long, device=device), timestep=torch.ones(1, device=device),
        img_shapes=[(1, side, side)],
    )
    assert qwen_image_forward_flops(config, n_image, n_text) == pytest.approx(counted, rel=0.05)


def test_unet_formula_matches_flop_counter_tiny_and_sd15():
    from diffusers import UNet2DConditionModel

    from pipelines.sd15.adapter import TINY_UNET

    for config, meta, side in ((dict(TINY_UNET), False, 16), (SD15_UNET, True, 64)):
        model = _build(UNet2DConditionModel, config, meta)
        device = "meta" if meta else "cpu"
        counted = _counted(
            model, sample=torch.zeros(1, 4, side, side, device=device), timestep=torch.ones(1, device=device),
            encoder_hidden_states=torch.zeros(1, 77, config["cross_attention_dim"], device=device),
        )
        assert unet2d_forward_flops(config, side, side, 77) == pytest.approx(counted, rel=0.05), config["block_out_channels"]


def test_counter_for_the_digits_adapter_with_lora_and_mfu(tiny_adapter):
    from peft import LoraConfig

    counter = counter_for_adapter(tiny_adapter, 16, 16, lora_rank=8, device_name="NVIDIA H200")
    tiny_adapter.denoiser.add_adapter(LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0, target_modules=list(tiny_adapter.lora_target_modules)))
    cond = tiny_adapter.encode_prompts(["a red seven"] * 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flop_mode = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), flop_mode:
        tiny_adapter.predict(torch.zeros(2, 3, 16, 16), torch.full((2,), 0.5), cond, 1.0)
    assert counter.forward_flops(2) == pytest.approx(flop_mode.get_total_flops(), rel=0.05)  # LoRA matmuls included
    assert counter.rollout_flops(4, 10, guidance_scale=4.5) == pytest.approx(2 * 10 * counter.forward_flops(4))
    assert counter.train_flops(4, 10) == pytest.approx(3 * counter.forward_flops(40))
    assert counter.train_flops(4, 10, guidance_scale=2.0, extra_forwards=1) == pytest.approx(5 * counter.forward_flops(40))
    assert counter.peak_flops == 989e12
    assert counter.mfu(989e12 * 0.5, 1.0) == pytest.approx(0.5)
    assert DiffusionFlopsCounter(1.0, peak_flops=None).mfu(1.0, 1.0) is None
    with pytest.raises(ValueError, match="sample_flops must be > 0"):
        DiffusionFlopsCounter(0.0)


def test_fused_rollout_counts_the_flops_it_executes():
    """With ``model.fuse_lora_rollout`` the counter's rollout FLOPs are those of the fused forward (no LoRA matmuls,
    measured by FlopCounterMode inside the engine's rollout context); training FLOPs keep the LoRA's."""
    adapter = DigitsAdapter(path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=2), lora_rank=8, fuse_lora_rollout=True)
    engine.initialize()
    fused = counter_for_adapter(adapter, 16, 16, lora_rank=8, fused_rollout=True)
    plain = counter_for_adapter(adapter, 16, 16, lora_rank=8)
    cond = adapter.encode_prompts(["a red seven"] * 2)

    def executed(ctx) -> int:
        mode = FlopCounterMode(display=False)
        with torch.no_grad(), ctx, sdpa_kernel(SDPBackend.MATH), mode:
            adapter.predict(torch.zeros(2, 3, 16, 16), torch.full((2,), 0.5), cond, 1.0)
        return mode.get_total_flops()

    with_lora, without = executed(contextlib.nullcontext()), executed(engine.rollout_weights())
    assert with_lora > without * 1.01  # the LoRA matmuls are a visible share of the tiny model's forward
    assert fused.rollout_flops(2, 1) == pytest.approx(without, rel=0.05)
    assert plain.rollout_flops(2, 1) == pytest.approx(with_lora, rel=0.05)
    assert fused.train_flops(2, 1) == plain.train_flops(2, 1)


FAMILY_SIZES = {"digits": 16, "digits_eps": 16, "sd15": 32, "sd3": 32, "flux": 32, "wan": 32, "qwen_image": 32}


@pytest.mark.parametrize("family", sorted(FAMILY_SIZES))
def test_every_family_declares_the_flops_of_its_forward(family):
    """``adapter.forward_flops`` (one conditional forward, one sample, LoRA rank 4 attached) within 5 % of what
    FlopCounterMode counts in ``predict`` at guidance 1, and ``counter_for_adapter`` takes exactly that number."""
    from peft import LoraConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    size = FAMILY_SIZES[family]
    adapter = build_adapter(family, path=None, seed=0)
    declared = adapter.forward_flops(size, size, lora_rank=4)
    assert declared > adapter.forward_flops(size, size) > 0  # LoRA adds its matmuls
    adapter.denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0, target_modules=list(adapter.lora_target_modules)))
    cond = adapter.encode_prompts(adapter.default_prompts()[:1] * 2)
    mode = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), mode:
        adapter.predict(torch.zeros(2, *adapter.latent_shape(size, size)), torch.full((2,), 0.5), cond, 1.0)
    assert 2 * declared == pytest.approx(mode.get_total_flops(), rel=0.05)
    assert counter_for_adapter(adapter, size, size, lora_rank=4).forward_flops(2) == 2 * declared


def test_a_family_without_a_formula_is_refused_by_name():
    from pipelines.base import ModelAdapter

    class NoFormula(ModelAdapter):
        def encode_prompts(self, prompts):
            raise NotImplementedError

        def latent_shape(self, height, width):
            return (3, height, width)

        def _forward(self, latents, sigma, cond):
            return latents

        def decode(self, latents):
            return latents

    with pytest.raises(ValueError, match="NoFormula declares no FLOPs formula"):
        counter_for_adapter(NoFormula(), 16, 16)


def test_trainer_logs_mfu_and_images_per_second(tmp_path):
    from diffrl.recipes import compose
    from diffrl.trainer import Trainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red seven\na blue two\n")
    cfg = compose([
        "sampler.num_steps=3", "sampler.eval_num_steps=2", "trainer.steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "eval.seeds_per_prompt=1", f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
        f"trainer.prompts={prompts}", "trainer.peak_flops=1e11", "algorithm.kl_beta=0",  # no reference forward: the formula below
    ])
    trainer = Trainer(cfg)
    record = trainer.train_step(0)
    counter = trainer.flops
    assert record["perf/images_per_second_per_worker"] == pytest.approx(4 / record["time/rollout"])
    assert record["perf/mfu_rollout"] == pytest.approx(counter.rollout_flops(4, 3) / (record["time/rollout"] * 1e11))
    assert record["perf/mfu_train"] == pytest.approx(counter.train_flops(4 * 3, 1) / (record["time/train"] * 1e11))
    assert 0 < record["perf/mfu_train"] < 1
