"""The SD3 / SD3.5 family over diffusers: ``SD3Transformer2DModel`` (MMDiT, velocity prediction), an
``AutoencoderKL`` with ``shift_factor``/``scaling_factor``, and three text encoders (CLIP-L, CLIP-G, T5).

Text conditioning is built exactly as ``diffusers.StableDiffusion3Pipeline.encode_prompt`` builds it:

* CLIP-L and CLIP-G (``CLIPTextModelWithProjection``): the penultimate hidden state
  ``hidden_states[-2]`` of each (CLIP skip 0) and the projected pooled output ``text_embeds``;
* ``clip = pad(concat(clip_l, clip_g, dim=-1), to the T5 width)`` (zero padding on the feature dim);
* ``prompt_embeds = concat(clip, t5, dim=-2)`` (sequence), ``pooled = concat(pooled_l, pooled_g, dim=-1)``;
* the negative (unconditional) embeddings are the same construction for the empty prompt ``""``.

Sigma convention (docs/architecture.md): ``x_σ = (1 − σ)·x0 + σ·ε``, ``v = ε − x0``; the transformer gets the
diffusers timestep ``1000·σ``. The schedule is the uniform grid shifted with the scheduler config's
``shift`` (3.0 for SD3/SD3.5): ``σ' = s·σ / (1 + (s − 1)·σ)``.

Latents are ``(z − shift_factor)·scaling_factor`` with ``z`` the VAE posterior mean (what
``StableDiffusion3Pipeline`` decodes with ``z = latents / scaling_factor + shift_factor``).

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder{,_2,_3}/``,
``tokenizer{,_2,_3}/``, ``scheduler/``); with no path the family builds a tiny random configuration offline
(tokenizers included) for tests. :meth:`SD3Adapter.save_pretrained` writes the same layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_cfg_mode, register_family, torch_dtype
from pipelines.flops import mmdit_forward_flops
from pipelines.latent import LatentFlowFamily, check_folder, load_common, load_tokenizer, own_memory
from pipelines.schedules import flow_match_sigmas
from pipelines.shapes import SD3_FLUX_VAE, Shape, building, family_components, plain, register_shape, text_config
from pipelines.tiny import TINY_CLIP, TINY_T5, build_tiny_t5, build_tiny_t5_tokenizer, build_tiny_tokenizer, build_tiny_vae

# the family's published shapes (``model.options.shape``; pipelines.shapes)
register_shape(Shape(
    "sd35_medium", "sd3",
    dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
         joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
         dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    SD3_FLUX_VAE, {"clip_l": 768, "clip_g": 1280, "t5": 4096}, 256, 2.24, "stabilityai/stable-diffusion-3.5-medium transformer/config.json",
))
register_shape(Shape(
    "sd35_large", "sd3",
    dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
         joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192, qk_norm="rms_norm"),
    SD3_FLUX_VAE, {"clip_l": 768, "clip_g": 1280, "t5": 4096}, 256, 8.06, "stabilityai/stable-diffusion-3.5-large transformer/config.json",
), full=True)

SD3_SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}

# tiny random configuration (tests): text width 80 = the tiny T5; pooled 64 = the two tiny CLIPs (32 each)
TINY_SD3_TRANSFORMER = dict(
    sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
    num_attention_heads=4, joint_attention_dim=80, caption_projection_dim=32, pooled_projection_dim=64,
    pos_embed_max_size=16,
)
# SD3's VAE normalisation (diffusers' SD3 VAE config); FLUX uses its own values
SD3_VAE_NORM = dict(shift_factor=0.0609, scaling_factor=1.5305)
SD3_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler")


def build_tiny_sd3_components(seed: int = 0) -> dict:
    """The tiny random SD3-shaped components (CPU, fp32): MMDiT, VAE, CLIP-L, CLIP-G, T5 and tokenizers."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    t5_tok = build_tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP))
    return {
        "transformer": transformer, "vae": build_tiny_vae(seed + 1, **SD3_VAE_NORM),
        "text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": build_tiny_t5(seed + 2, len(t5_tok)),
        "tokenizer": build_tiny_tokenizer(), "tokenizer_2": build_tiny_tokenizer(), "tokenizer_3": t5_tok,
        "scheduler": dict(SD3_SCHEDULER_CONFIG),
    }


def build_sd3_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """SD3 components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``: the
    transformer, the VAE and CLIP-L, CLIP-G and the T5-XXL encoder at their published configs (2-layer stand-ins of
    their widths with ``shape.stand_in_text``), tokens as the pipeline's (77 CLIP, ``max_sequence_length`` T5)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    t5_tok = build_tiny_t5_tokenizer(max_length=shape.max_sequence_length)
    with building(device, dtype, seed):
        transformer = SD3Transformer2DModel(**shape.transformer)
        vae = AutoencoderKL(**plain(shape.vae), **SD3_VAE_NORM)
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**text_config(shape, "clip_l", TINY_CLIP)))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**text_config(shape, "clip_g", TINY_CLIP)))
        t5 = T5EncoderModel(T5Config(**text_config(shape, "t5", TINY_T5, len(t5_tok))))
    return {
        "transformer": transformer, "vae": vae, "text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": t5,
        "tokenizer": build_tiny_tokenizer(77), "tokenizer_2": build_tiny_tokenizer(77), "tokenizer_3": t5_tok,
        "scheduler": dict(SD3_SCHEDULER_CONFIG),
    }


def load_sd3_components(path: str | Path) -> dict:
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    folder = Path(path)
    check_folder(folder, "SD3", SD3_COMPONENTS)
    parts = load_common(folder, "SD3", "SD3Transformer2DModel")
    for name in ("text_encoder", "text_encoder_2"):
        parts[name] = own_memory(CLIPTextModelWithProjection.from_pretrained(str(folder / name), local_files_only=True))
    parts["text_encoder_3"] = own_memory(T5EncoderModel.from_pretrained(str(folder / "text_encoder_3"), local_files_only=True))
    parts["tokenizer"] = load_tokenizer(folder, "tokenizer", clip=True)
    parts["tokenizer_2"] = load_tokenizer(folder, "tokenizer_2", clip=True)
    parts["tokenizer_3"] = load_tokenizer(folder, "tokenizer_3", clip=False)
    return parts


@register_family("sd3")
class SD3Adapter(LatentFlowFamily):
    """Stable Diffusion 3 / 3.5 (MMDiT, rectified flow, CFG with a gradient-free unconditional branch).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoders (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        drop_text_encoders: delete the text encoders after :meth:`cache_prompts` (serve cached embeddings).
        max_sequence_length: T5 tokens (diffusers' default 256; capped by the tokenizer's maximum).
        cfg_mode: how a guided ``predict`` runs its two branches (``model.options.cfg_mode``, see
            :meth:`ModelAdapter.predict`): ``split`` (default) or ``batched``. In training the batched forward back-propagates through all 2B rows
            although the unconditional half only gets zero gradients; split's backward covers B rows. On one
            H200 at SD3.5-M scale (``benchmarks/speed/gpu_speed.py``, compiled, LoRA r32): training step 4.10 s →
            3.09 s and end-to-end Flow-GRPO 2.65 → 3.15 trajectories/s, rollout 8.75 → 8.54 images/s.
            Rollout and training use the same mode, so their log-probs stay in parity.
        shape: with no ``path``, ``tiny`` (the test configuration) or a published shape with random weights
            (``sd35_medium``, ``sd35_large``; ``full`` = ``sd35_large``; :mod:`pipelines.shapes`).
    """

    hub_components = SD3_COMPONENTS

    family = "SD3"
    pipeline_class = "StableDiffusion3Pipeline"
    lora_pipeline = pipeline_class
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    ]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = 256, cfg_mode: str = "split",
        shape: str = "tiny",
    ):
        torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        parts = family_components("sd3", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_sd3_components, tiny=build_tiny_sd3_components, build=build_sd3_components)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self.shift = float(self.scheduler_config.get("shift", 3.0))
        self.max_sequence_length = min(int(max_sequence_length), int(self.tokenizers["tokenizer_3"].model_max_length))
        self.clip_max_length = int(self.tokenizers["tokenizer"].model_max_length)
        self.patch_size = int(self.denoiser.config.patch_size)

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden state, projected pooled output) of CLIP-L (index 0) or CLIP-G (index 1)."""
        enc = self.text_encoders[("text_encoder", "text_encoder_2")[index]]
        ids = self._tokens(("tokenizer", "tokenizer_2")[index], prompts, self.clip_max_length)
        out = enc(ids.to(enc.device), output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds

    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        seq_l, pooled_l = self._clip(0, prompts)
        seq_g, pooled_g = self._clip(1, prompts)
        t5 = self._t5("text_encoder_3", "tokenizer_3", prompts)
        clip = torch.cat([seq_l, seq_g], dim=-1)
        if clip.shape[-1] > t5.shape[-1]:
            raise ValueError(f"SD3: CLIP-L ⊕ CLIP-G width {clip.shape[-1]} exceeds the T5 width {t5.shape[-1]}; the text encoders do not fit together")
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        dtype = next(self.denoiser.parameters()).dtype
        return TensorDict(
            {"prompt_embeds": torch.cat([clip, t5], dim=-2).to(dtype), "pooled_prompt_embeds": torch.cat([pooled_l, pooled_g], dim=-1).to(dtype)},
            batch_size=[len(prompts)],
        )

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds``, ``pooled_prompt_embeds`` and their ``negative_*`` (the empty prompt)."""
        return self._with_negative(prompts, "")

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * self.patch_size)
        limit = self.denoiser.config.pos_embed_max_size
        if limit is not None and max(h, w) // self.patch_size > limit:
            raise ValueError(f"SD3: image size {height}×{width} gives {h // self.patch_size}×{w // self.patch_size} patches, above the model's pos_embed_max_size {limit}")
        return (self.denoiser.config.in_channels, h, w)

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """StableDiffusion3Pipeline's sigmas (FlowMatchEulerDiscreteScheduler.set_timesteps(K), static shift ``s``):
        with ``f(σ) = s·σ / (1 + (s − 1)·σ)`` and ``T`` training timesteps, ``σ_min = f(1/T)``; the sigmas are
        ``f(linspace(1, σ_min, K))`` followed by a final 0. ``shift`` overrides ``s`` (default: the scheduler
        config's, 3.0 for SD3/SD3.5). SD3's shift is static: ``height``/``width`` are accepted and ignored."""
        T = int(self.scheduler_config.get("num_train_timesteps", 1000))
        return flow_match_sigmas(num_steps, self.shift if shift is None else shift, T)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        return self.denoiser(
            hidden_states=latents, timestep=1000.0 * sigma, encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"], return_dict=False,
        )[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.mmdit_forward_flops` over ``(h/p)·(w/p)`` latent patches and the CLIP + T5 tokens."""
        _, h, w = self.latent_shape(height, width)
        return mmdit_forward_flops(dict(self.denoiser.config), (h // self.patch_size) * (w // self.patch_size), self.prompt_tokens(), lora_rank)


__all__ = ["SD3Adapter", "build_tiny_sd3_components", "load_sd3_components"]
