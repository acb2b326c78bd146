"""The SD1.5 family over diffusers: ``UNet2DConditionModel`` (epsilon prediction), ``AutoencoderKL`` and a
CLIP text encoder, sampled with DDIM on the model's DDPM ᾱ schedule (DDPO's setting).

Noise levels follow the convention for epsilon models (docs/architecture.md): ``sigma = √(1 − ᾱ_t)`` in [0, 1], with
``x_t = √(1 − σ²)·x0 + σ·ε``; the diffusers timestep ``t`` is looked up from ``sigma`` inside
:meth:`SD15Adapter.predict` only.

``model.path`` is a local diffusers folder (``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``); with no path the family builds a tiny random configuration offline, tokenizer included.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import ModelAdapter, check_cfg_mode, register_family, torch_dtype
from pipelines.ddpm import DDPMSchedule, alphas_cumprod  # noqa: F401  (re-exported)
from pipelines.flops import unet2d_forward_flops
from pipelines.tiny import TINY_PROMPTS, build_tiny_tokenizer

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")

# SD1.5's scheduler: scaled-linear betas, 1000 training steps, DDIM "leading" spacing with offset 1
SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "steps_offset": 1, "set_alpha_to_one": False, "prediction_type": "epsilon",
    "clip_sample": False, "timestep_spacing": "leading",
}

TINY_UNET = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16,
)
TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32), latent_channels=4,
    norm_num_groups=16, sample_size=32,
)
TINY_TEXT = dict(
    bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
    num_hidden_layers=2, vocab_size=600, max_position_embeddings=77, projection_dim=32,
)


def build_tiny_components(seed: int = 0) -> dict:
    """The tiny random SD1.5-shaped pipeline components (CPU, fp32)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**TINY_UNET)
        vae = AutoencoderKL(**TINY_VAE)
        text_encoder = CLIPTextModel(CLIPTextConfig(**TINY_TEXT))
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": build_tiny_tokenizer(), "scheduler": dict(SCHEDULER_CONFIG)}


def save_pipeline(components: dict, folder: str | Path) -> Path:
    """Write components as a diffusers folder (what ``model.path`` loads)."""
    folder = Path(folder)
    for name in ("unet", "vae", "text_encoder", "tokenizer"):
        components[name].save_pretrained(str(folder / name))
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(components["scheduler"], indent=2))
    return folder


def load_components(path: str | Path) -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"SD1.5 model folder {folder} does not exist (model.path); give a local diffusers folder or a Hub id (org/name)")
    for name in COMPONENTS:
        if not (folder / name).is_dir():
            raise FileNotFoundError(f"SD1.5 model folder {folder} lacks the component {name}/ (needs {', '.join(COMPONENTS)})")
    return {
        "unet": UNet2DConditionModel.from_pretrained(str(folder / "unet"), local_files_only=True),
        "vae": AutoencoderKL.from_pretrained(str(folder / "vae"), local_files_only=True),
        "text_encoder": CLIPTextModel.from_pretrained(str(folder / "text_encoder"), local_files_only=True),
        "tokenizer": CLIPTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True),
        "scheduler": json.loads((folder / "scheduler" / "scheduler_config.json").read_text()),
    }


@register_family("sd15")
class SD15Adapter(DDPMSchedule, ModelAdapter):
    """Stable Diffusion 1.5 (epsilon prediction, DDIM/DDPM schedule).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: UNet dtype; device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see
            :meth:`ModelAdapter.predict`).
    """

    hub_components = COMPONENTS
    lora_pipeline, lora_component = "StableDiffusionPipeline", "unet"

    prediction_type = "epsilon"
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, decode_chunk: int = 16,
        cfg_mode: str = "split",
    ):
        dtype_ = torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        parts = build_tiny_components(seed) if path is None else load_components(path)
        unet = parts["unet"].to(device)
        self.denoiser = unet if dtype_ == torch.float32 else unet.to(dtype=dtype_)
        self.vae = parts["vae"].to(device).eval().requires_grad_(False)
        self.text_encoder = parts["text_encoder"].to(device).eval().requires_grad_(False)
        self.tokenizer = parts["tokenizer"]
        self._init_schedule(parts["scheduler"])
        self.decode_chunk = decode_chunk
        self.vae_scale = float(getattr(self.vae.config, "scaling_factor", 0.18215))
        self.vae_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the pipeline as the diffusers folder that ``model.path`` loads (:func:`save_pipeline`)."""
        return save_pipeline(self.components(), folder)

    def components(self) -> dict:
        return {"unet": self.denoiser, "vae": self.vae, "text_encoder": self.text_encoder, "tokenizer": self.tokenizer, "scheduler": self.scheduler_config}

    # -- protocol -----------------------------------------------------------------------------
    def _embed(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            return self.text_encoder(ids.to(self.text_encoder.device))[0]

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        dtype = next(self.denoiser.parameters()).dtype
        seq = self._embed(prompts).to(dtype)
        neg = self._embed([""]).to(dtype).expand(len(prompts), -1, -1).clone()
        return TensorDict({"prompt_embeds": seq, "negative_prompt_embeds": neg}, batch_size=[len(prompts)])

    def default_prompts(self) -> list[str]:
        return list(TINY_PROMPTS)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        if height % self.vae_factor or width % self.vae_factor:
            raise ValueError(f"image size {height}×{width} must be divisible by the VAE factor {self.vae_factor}")
        return (self.denoiser.config.in_channels, height // self.vae_factor, width // self.vae_factor)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """ε at the training timestep nearest to each ``sigma`` (:meth:`DDPMSchedule.timestep`)."""
        return self.denoiser(latents, self.timestep(sigma), encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.unet2d_forward_flops` at the latent size and the CLIP tokens."""
        _, h, w = self.latent_shape(height, width)
        return unet2d_forward_flops(dict(self.denoiser.config), h, w, self.prompt_tokens(), lora_rank)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        chunks = [
            self.vae.decode(part.to(self.vae.device, self.vae.dtype) / self.vae_scale, return_dict=False)[0]
            for part in latents.split(self.decode_chunk)
        ]
        return (torch.cat(chunks).float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        dist = self.vae.encode(images.to(self.vae.device, self.vae.dtype) * 2 - 1).latent_dist
        return dist.mean.float() * self.vae_scale
