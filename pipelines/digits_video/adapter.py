"""The digits-video family: a tiny diffusers ``WanTransformer3DModel`` over pixel-space clips + the digits text encoder.

The Wan2.1 architecture (``pipelines.wan``: 3-D patches with rotary positions over frames, rows and columns,
cross-attention to the prompt's tokens, timestep modulation) at miniature size, without a VAE: the latents are the
clips themselves scaled to [-1, 1], ``[B, 3, F, 16, 16]`` in Wan's channel-first layout (``F`` = 8 frames; patches of
2 frames × 4×4 pixels: 4 · 4 · 4 = 64 video tokens, as many as the digits model's image tokens). The text encoder is the digits miniature's (``DigitsTextEncoder``) over the
video grammar's words (5 tokens, ``"a red seven moving left"``); Wan reads the token sequence only (no pooled
vector). Flow matching as every flow family: ``x_σ = (1 − σ)·x0 + σ·ε``, velocity ``v = ε − x0``, the transformer's
timestep ``1000·σ``, shift 1. The shipped transformer predicts the clean clip ``x̂0`` and :meth:`_forward` returns the
velocity ``(x_σ − x̂0) / max(σ, 0.05)`` (``transformer/config.json`` key ``_diffrl_prediction: clean``; a folder without
the key predicts the velocity itself): pixel patches of 96 values are easier to denoise than to predict the noise of.

Folder layout (what ``scripts/pretrain_digits_video.py`` writes and ``model.path`` points at)::

    <path>/transformer/    diffusers save_pretrained of the WanTransformer3DModel
    <path>/text_encoder/   config.json + model.safetensors (DigitsTextEncoder)

``decode`` returns float clips ``[B, F, 3, 16, 16]`` in [0, 1] (rollouts store them as uint8; the video rewards take
them whole).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipelines.base import register_family
from pipelines.digits.adapter import DigitsAdapter
from pipelines.digits.text_encoder import PAD
from pipelines.flops import wan_forward_flops
from rewards.digits.video_data import CANVAS, FRAMES, MAX_WORDS, WORDS, all_prompts

# the shipped generator's architecture; also the tiny random config used when no path is given
TRANSFORMER_CONFIG = dict(
    patch_size=(2, 4, 4),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=3,
    out_channels=3,
    text_dim=32,
    freq_dim=32,
    ffn_dim=256,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)
VOCAB = [PAD, *WORDS]
MIN_SIGMA = 0.05  # the clean-clip prediction's velocity divides by max(σ, MIN_SIGMA)
PREDICTION_KEY = "_diffrl_prediction"  # transformer/config.json: what the transformer outputs (diffusers keeps "_" keys)


@register_family("digits_video")
class DigitsVideoAdapter(DigitsAdapter):
    """Adapter of the digits-video miniature.

    Args: those of :class:`~pipelines.digits.adapter.DigitsAdapter`; ``path`` is a folder written by
    ``scripts/pretrain_digits_video.py`` (the shipped one is ``assets/digits_video``).
    """

    folder_name = "digits_video"
    pretrain_script = "scripts/pretrain_digits_video.py"
    transformer_class = "WanTransformer3DModel"
    transformer_config = TRANSFORMER_CONFIG
    text_encoder_args = dict(vocab=VOCAB, max_length=MAX_WORDS)
    lora_pipeline = "WanPipeline"
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]  # self- and cross-attention of every block, as Wan's
    tiny_size = CANVAS
    num_frames = FRAMES
    # what the random configuration's transformer outputs ("clean": the clean clip x̂0, turned into the velocity by
    # _forward; "velocity"); a folder's transformer/config.json records its own as "_diffrl_prediction" (absent: velocity)
    prediction = "clean"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        prediction = self.denoiser.config.get(PREDICTION_KEY, "velocity")
        if prediction not in ("velocity", "clean"):
            raise ValueError(f"digits_video transformer config: {PREDICTION_KEY}={prediction!r} must be 'velocity' or 'clean'")
        self.prediction = prediction

    @classmethod
    def random_transformer(cls, seed: int):
        transformer = super().random_transformer(seed)
        transformer.register_to_config(**{PREDICTION_KEY: cls.prediction})
        return transformer

    def default_prompts(self) -> list[str]:
        """The 240 prompts (10 digits × 6 colours × 4 directions), ``rewards.digits.video_data.all_prompts``."""
        return all_prompts()

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(3, F, H, W)``: pixel-space clips; ``H`` and ``W`` must be multiples of the 4×4 patches."""
        _, p_h, p_w = self.denoiser.config.patch_size
        if height % p_h or width % p_w:
            raise ValueError(f"digits_video: size {height}×{width} must be divisible by the patch size {p_h}×{p_w}; set sampler.height/width=16")
        return (3, self.num_frames, height, width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 3, F, H, W]`` in [-1, 1] → float clips ``[B, F, 3, H, W]`` in [0, 1]."""
        if latents.ndim != 5:
            raise ValueError(f"digits_video decode expects latents [B, 3, F, H, W], got shape {tuple(latents.shape)}")
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 1, 3, 4).contiguous()

    def encode_videos(self, videos: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`decode`: float clips ``[B, F, 3, H, W]`` in [0, 1] → latents ``[B, 3, F, H, W]``."""
        if videos.ndim != 5 or videos.shape[2] != 3:
            raise ValueError(f"encode_videos expects float clips [B, F, 3, H, W] in [0, 1], got shape {tuple(videos.shape)}")
        return videos.float().permute(0, 2, 1, 3, 4) * 2.0 - 1.0

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        raise ValueError("digits_video latents are clips [3, F, H, W]: encode_images (images → latents) does not apply; use encode_videos")

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        out = self.denoiser(hidden_states=latents, timestep=1000.0 * sigma,
                            encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
        if self.prediction == "velocity":
            return out
        # the transformer predicts the clean clip x̂0; the velocity of x_σ = (1 − σ)x0 + σε is (x_σ − x̂0)/σ
        s = sigma.to(out.dtype).clamp_min(MIN_SIGMA).view(-1, *([1] * (latents.ndim - 1)))
        return (latents - out) / s

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.wan_forward_flops` over the ``F/2 · H/4 · W/4`` video tokens and the prompt's tokens."""
        _, f, h, w = self.latent_shape(height, width)
        p_t, p_h, p_w = self.denoiser.config.patch_size
        return wan_forward_flops(dict(self.denoiser.config), (f // p_t) * (h // p_h) * (w // p_w), self.prompt_tokens(), lora_rank)

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        return list(self.denoiser.blocks)

    # -- sequence parallelism (model.sequence_parallel; diffrl.engine.sequence_parallel) ---------------------------
    def sequence_parallel_transformers(self) -> list[torch.nn.Module]:
        """The ``WanTransformer3DModel`` whose video tokens ``model.sequence_parallel`` splits over ranks."""
        return [self.denoiser]

    @classmethod
    def sequence_layout(cls, height: int, width: int, *, path: str | None = None, **_) -> tuple[int | None, int | None]:
        """``(attention heads, video tokens per sample)`` at ``height × width`` read without building the model: the
        folder's ``transformer/config.json`` (the random configuration's without a path; ``(None, None)`` when the
        folder has none: the adapter's own error names it when the model loads)."""
        config = cls.transformer_config
        if path is not None:
            file = Path(str(path)) / "transformer" / "config.json"
            if not file.is_file():
                return None, None
            config = json.loads(file.read_text())
        p_t, p_h, p_w = config["patch_size"]
        return int(config["num_attention_heads"]), (cls.num_frames // p_t) * (height // p_h) * (width // p_w)
