"""The FLUX.1 family over diffusers: ``FluxTransformer2DModel`` (MMDiT + single-stream blocks, velocity
prediction) on 2×2-packed latents, an ``AutoencoderKL`` with ``shift_factor``/``scaling_factor``, CLIP-L
(pooled output only) and T5 (sequence), as ``diffusers.FluxPipeline`` builds them.

* Latents are kept unpacked, ``[C, h, w]`` with ``h = H / vae_factor`` (even); :meth:`FluxAdapter._forward`
  packs them into ``[(h/2)·(w/2), 4C]`` tokens (FluxPipeline's ``_pack_latents``), builds the latent image
  ids (``[…, 1] = row``, ``[…, 2] = column`` of the 2×2 patch) and zero text ids, and unpacks the output.
  Log-probs average over non-batch dims, so packing or not changes nothing there.
* Guidance: FLUX.1-dev is guidance-distilled; ``guidance_scale`` goes to the guidance embedding
  (``guidance = g``, scaled by 1000 inside the transformer) and no unconditional branch ever runs. A model
  without a guidance embedding (FLUX.1-schnell) accepts only ``guidance_scale == 1``.
* Timestep: FluxPipeline passes ``t/1000 = σ`` and the transformer multiplies by 1000, so ``σ`` goes in.
* Schedule (dynamic shift): ``μ = calculate_shift(image_seq_len)`` linear in the packed sequence length
  (``base_image_seq_len`` → ``base_shift``, ``max_image_seq_len`` → ``max_shift`` of the scheduler config);
  ``σ' = e^μ / (e^μ + 1/σ − 1)``, i.e. the shifted grid with shift ``e^μ``
  (FlowMatchEulerDiscreteScheduler's exponential time shift).
* Latents are ``(z − shift_factor)·scaling_factor`` with ``z`` the VAE posterior mean.

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/`` (CLIP),
``text_encoder_2/`` (T5), ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import register_family, torch_dtype
from pipelines.flops import flux_forward_flops
from pipelines.latent import LatentFlowFamily, check_folder, load_common, load_tokenizer, own_memory, pack_latents, unpack_latents
from pipelines.schedules import calculate_shift, shifted_sigmas
from pipelines.shapes import SD3_FLUX_VAE, Shape, building, family_components, plain, register_shape, text_config
from pipelines.tiny import TINY_CLIP, TINY_T5, build_tiny_t5, build_tiny_t5_tokenizer, build_tiny_tokenizer, build_tiny_vae

# the family's published shapes (``model.options.shape``; pipelines.shapes)
register_shape(Shape(
    "flux_dev", "flux",
    dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
         joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    SD3_FLUX_VAE, {"clip_l": 768, "t5": 4096}, 512, 11.90, "black-forest-labs/FLUX.1-dev transformer/config.json",
), full=True)

# FLUX.1-dev's scheduler config (dynamic shifting)
FLUX_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
    "use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
    "max_shift": 1.15,
}
FLUX_VAE_NORM = dict(shift_factor=0.1159, scaling_factor=0.3611)
TINY_FLUX_TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=80, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8),
)
FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def latent_image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[(h/2)·(w/2), 3]`` position ids of the packed tokens: 0, row, column (FluxPipeline's)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def build_tiny_flux_components(seed: int = 0) -> dict:
    """The tiny random FLUX-shaped components (CPU, fp32): transformer with guidance embedding, VAE, CLIP, T5."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    t5_tok = build_tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
        clip = CLIPTextModel(CLIPTextConfig(**TINY_CLIP))
    return {
        "transformer": transformer, "vae": build_tiny_vae(seed + 1, **FLUX_VAE_NORM),
        "text_encoder": clip, "text_encoder_2": build_tiny_t5(seed + 2, len(t5_tok)),
        "tokenizer": build_tiny_tokenizer(), "tokenizer_2": t5_tok, "scheduler": dict(FLUX_SCHEDULER_CONFIG),
    }


def build_flux_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """FLUX components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``: the
    transformer, the VAE, CLIP-L (pooled 768) and the T5-XXL encoder (4096, padded to ``max_sequence_length`` tokens) at
    their published configs (2-layer stand-ins of their widths with ``shape.stand_in_text``)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    t5_tok = build_tiny_t5_tokenizer(max_length=shape.max_sequence_length)
    with building(device, dtype, seed):
        transformer = FluxTransformer2DModel(**shape.transformer)
        vae = AutoencoderKL(**plain(shape.vae), **FLUX_VAE_NORM)
        clip = CLIPTextModel(CLIPTextConfig(**text_config(shape, "clip_l", TINY_CLIP)))
        t5 = T5EncoderModel(T5Config(**text_config(shape, "t5", TINY_T5, len(t5_tok))))
    return {
        "transformer": transformer, "vae": vae, "text_encoder": clip, "text_encoder_2": t5,
        "tokenizer": build_tiny_tokenizer(77), "tokenizer_2": t5_tok, "scheduler": dict(FLUX_SCHEDULER_CONFIG),
    }


def load_flux_components(path: str | Path) -> dict:
    from transformers import CLIPTextModel, T5EncoderModel

    folder = Path(path)
    check_folder(folder, "FLUX", FLUX_COMPONENTS)
    parts = load_common(folder, "FLUX", "FluxTransformer2DModel")
    parts["text_encoder"] = own_memory(CLIPTextModel.from_pretrained(str(folder / "text_encoder"), local_files_only=True))
    parts["text_encoder_2"] = own_memory(T5EncoderModel.from_pretrained(str(folder / "text_encoder_2"), local_files_only=True))
    parts["tokenizer"] = load_tokenizer(folder, "tokenizer", clip=True)
    parts["tokenizer_2"] = load_tokenizer(folder, "tokenizer_2", clip=False)
    return parts


@register_family("flux")
class FluxAdapter(LatentFlowFamily):
    """FLUX.1 (dev: guidance-distilled; schnell: no guidance embedding).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoders.
        device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        drop_text_encoders: delete the text encoders after :meth:`cache_prompts`.
        max_sequence_length: T5 tokens (FluxPipeline's default 512; capped by the tokenizer's maximum).
        sample_size: image side (pixels) whose packed sequence length sets the default dynamic shift
            when :meth:`schedule` is called without ``height``/``width`` (None: the VAE config's
            ``sample_size``: 1024 for FLUX.1, 32 for the tiny configuration).
        shape: with no ``path``, ``tiny`` (the test configuration) or ``flux_dev`` / ``full``: FLUX.1-dev's published
            shape with random weights (:mod:`pipelines.shapes`).
    """

    hub_components = FLUX_COMPONENTS

    family = "FLUX"
    pipeline_class = "FluxPipeline"
    lora_pipeline = pipeline_class
    guidance_distilled = True
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    # the double-stream blocks' joint attention (image and context projections) and the single blocks' attention
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    ]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = 512,
        sample_size: int | None = None, shape: str = "tiny",
    ):
        torch_dtype(dtype)
        parts = family_components("flux", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_flux_components, tiny=build_tiny_flux_components, build=build_flux_components)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self.max_sequence_length = min(int(max_sequence_length), int(self.tokenizers["tokenizer_2"].model_max_length))
        self.clip_max_length = int(self.tokenizers["tokenizer"].model_max_length)
        self.sample_size = int(sample_size if sample_size is not None else self.vae.config.sample_size)
        self.guidance_embeds = bool(self.denoiser.config.guidance_embeds)
        self.latent_channels = self.denoiser.config.in_channels // 4

    @property
    def shift(self) -> float:  # type: ignore[override]
        """``e^μ`` at the default ``sample_size`` (what :meth:`schedule` uses without a size)."""
        return self.dynamic_shift(self.sample_size, self.sample_size)

    def dynamic_shift(self, height: int, width: int) -> float:
        """``e^μ`` with ``μ = calculate_shift((h/2)·(w/2))``, ``h, w`` the latent size of ``height × width`` pixels."""
        h, w = height // self.vae_factor, width // self.vae_factor
        if not self.scheduler_config.get("use_dynamic_shifting", True):
            return float(self.scheduler_config.get("shift", 1.0))
        return math.exp(calculate_shift((h // 2) * (w // 2), self.scheduler_config))

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Sigmas ``[num_steps + 1]``: FluxPipeline's grid ``linspace(1, 1/K, K)`` (+ a final 0) time-shifted with
        ``e^μ`` for an image of ``height × width`` (default ``sample_size``²); an explicit ``shift`` overrides it."""
        if shift is None:
            shift = self.dynamic_shift(height or self.sample_size, width or self.sample_size)
        return shifted_sigmas(num_steps, shift)

    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        enc = self.text_encoders["text_encoder"]
        ids = self._tokens("tokenizer", prompts, self.clip_max_length)
        pooled = enc(ids.to(enc.device), output_hidden_states=False).pooler_output
        t5 = self._t5("text_encoder_2", "tokenizer_2", prompts)
        dtype = next(self.denoiser.parameters()).dtype
        return TensorDict({"prompt_embeds": t5.to(dtype), "pooled_prompt_embeds": pooled.to(dtype)}, batch_size=[len(prompts)])

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """Positive embeddings only: guidance-distilled FLUX runs no unconditional branch."""
        return self._encode(list(prompts))

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * 2)
        return (self.latent_channels, h, w)

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """One forward for any ``guidance_scale``: guidance-distilled FLUX takes it as the input of its guidance
        embedding, so no unconditional branch ever runs (this replaces :class:`ModelAdapter`'s CFG template)."""
        if not self.guidance_embeds and guidance_scale != 1.0:
            raise ValueError(
                f"FLUX: this transformer has no guidance embedding (FLUX.1-schnell-like) and FLUX runs no CFG; "
                f"set sampler.guidance_scale=1.0 (got {guidance_scale})"
            )
        x = latents.to(next(self.denoiser.parameters()).dtype)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        return self._forward(x, sigma, cond, guidance_scale)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond, guidance_scale: float = 1.0) -> torch.Tensor:
        """One transformer call on the packed latents; ``guidance_scale`` feeds the guidance embedding (if any)."""
        b, _, h, w = latents.shape
        dtype, device = latents.dtype, latents.device
        guidance = torch.full((b,), float(guidance_scale), dtype=torch.float32, device=device).to(dtype) if self.guidance_embeds else None
        seq = cond["prompt_embeds"]
        out = self.denoiser(
            hidden_states=pack_latents(latents), timestep=sigma.to(dtype), guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=seq,
            txt_ids=torch.zeros(seq.shape[1], 3, device=device, dtype=dtype),
            img_ids=latent_image_ids(h, w, device, dtype), return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.flux_forward_flops` over the ``(h/2)·(w/2)`` packed latent tokens and the T5 tokens."""
        _, h, w = self.latent_shape(height, width)
        return flux_forward_flops(dict(self.denoiser.config), h * w // 4, self.prompt_tokens(), lora_rank)
