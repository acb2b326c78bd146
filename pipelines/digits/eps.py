"""The digits miniature's epsilon-prediction generator (family ``digits_eps``), DDPO's setting.

A tiny diffusers ``UNet2DConditionModel`` in pixel space (``[B, 3, 16, 16]`` in [-1, 1]) predicting ε on a
DDPM schedule (linear β from 1e-4 to 0.02, 1000 steps, Ho et al. 2020), cross-attending to the digits
text encoder's token sequence. Sampled with DDIM (``sampler.kind=ddim``, η = ``sampler.noise_level``).

Folder layout (what ``python scripts/pretrain_digits_eps.py`` writes; the shipped one is
``assets/digits_eps``)::

    <path>/unet/           diffusers save_pretrained
    <path>/text_encoder/   DigitsTextEncoder (config.json + model.safetensors)
    <path>/scheduler/      scheduler_config.json (diffusers DDIMScheduler config)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import ModelAdapter, check_cfg_mode, register_family, torch_dtype
from pipelines.ddpm import DDPMSchedule
from pipelines.digits.text_encoder import DigitsTextEncoder
from pipelines.flops import unet2d_forward_flops
from rewards.digits.data import all_prompts

UNET_CONFIG = dict(
    sample_size=16, in_channels=3, out_channels=3, layers_per_block=2, block_out_channels=(32, 64, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32, attention_head_dim=16, norm_num_groups=32,
)
SCHEDULER_CONFIG = {
    "_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02,
    "beta_schedule": "linear", "steps_offset": 1, "set_alpha_to_one": False, "prediction_type": "epsilon",
    "clip_sample": True, "clip_sample_range": 1.0, "timestep_spacing": "leading",
}


def build_unet(seed: int = 0, **overrides):
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet2DConditionModel(**{**UNET_CONFIG, **overrides})


@register_family("digits_eps")
class DigitsEpsAdapter(DDPMSchedule, ModelAdapter):
    """Adapter of the digits epsilon UNet.

    Args:
        path: local folder (``unet/``, ``text_encoder/``, ``scheduler/``); ``None`` builds random weights.
        dtype: UNet dtype; device: torch device; seed: init seed of the random configuration.
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see
            :meth:`ModelAdapter.predict`).
    """

    prediction_type = "epsilon"
    tiny_size = 16
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, cfg_mode: str = "split"):
        dtype_ = torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        if path is None:
            unet = build_unet(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1)
                text_encoder = DigitsTextEncoder()
            scheduler = dict(SCHEDULER_CONFIG)
        else:
            from diffusers import UNet2DConditionModel

            folder = Path(path)
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"digits_eps model folder {folder} does not exist; set model.path to a folder made by "
                    "`python scripts/pretrain_digits_eps.py` (the shipped one is assets/digits_eps)"
                )
            for part in ("unet/config.json", "text_encoder/config.json", "scheduler/scheduler_config.json"):
                if not (folder / part).is_file():
                    raise FileNotFoundError(f"digits_eps model file {folder / part} is missing")
            unet = UNet2DConditionModel.from_pretrained(str(folder / "unet"), local_files_only=True)
            text_encoder = DigitsTextEncoder.from_pretrained(folder / "text_encoder")
            scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        unet = unet.to(device)
        self.denoiser = unet if dtype_ == torch.float32 else unet.to(dtype=dtype_)
        self.text_encoder = text_encoder.to(device).eval().requires_grad_(False)
        self._init_schedule(scheduler)

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        dtype = next(self.denoiser.parameters()).dtype
        with torch.no_grad():
            seq, _ = self.text_encoder.encode(list(prompts))
            neg, _ = self.text_encoder.encode([""])
        n = len(prompts)
        return TensorDict(
            {"prompt_embeds": seq.to(dtype), "negative_prompt_embeds": neg.expand(n, -1, -1).to(dtype).clone()},
            batch_size=[n],
        )

    def default_prompts(self) -> list[str]:
        return all_prompts()

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (3, height, width)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """ε at the training timestep nearest to each ``sigma`` (:meth:`DDPMSchedule.timestep`)."""
        return self.denoiser(latents, self.timestep(sigma), encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.unet2d_forward_flops` at the pixel size and the prompt's tokens."""
        _, h, w = self.latent_shape(height, width)
        return unet2d_forward_flops(dict(self.denoiser.config), h, w, self.prompt_tokens(), lora_rank)

    def forward_train(self, x_t: torch.Tensor, t: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """ε prediction at integer training timesteps ``t`` (pretraining)."""
        return self.denoiser(x_t, t, encoder_hidden_states=seq, return_dict=False)[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return images.float() * 2.0 - 1.0

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.denoiser.save_pretrained(str(folder / "unet"), safe_serialization=True)
        self.text_encoder.save_pretrained(folder / "text_encoder")
        (folder / "scheduler").mkdir(parents=True, exist_ok=True)
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(self.scheduler_config, indent=2))
