"""The digits editing family: the digits miniature's tiny ``SD3Transformer2DModel`` conditioned on a source image.

Design (InstructPix2Pix's, at miniature scale): the source image enters as extra input channels — the
denoiser reads ``cat([x_σ, source], dim=1)`` (6 channels in pixel space, 3 out) — and the instruction through
the digits text encoder (its vocabulary widened to the instructions' words, 6 tokens). Channel concatenation
keeps the source aligned pixel for pixel with the sample, which is what a recolour needs (copy every stroke,
change the colour), at no cost in tokens. The unconditional branch of CFG is the empty instruction *with* the
source image (``negative_source_latents`` = ``source_latents``), InstructPix2Pix's text-guidance term.

Folder layout (what ``scripts/pretrain_digits_edit.py`` writes and ``model.path`` points at)::

    <path>/transformer/    diffusers save_pretrained (config.json + diffusion_pytorch_model.safetensors)
    <path>/text_encoder/   config.json + model.safetensors (DigitsTextEncoder)

Latents and source latents are images scaled to [-1, 1]: ``[B, 3, 16, 16]``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from pipelines.base import EditPrompt, register_family
from pipelines.digits.adapter import DigitsAdapter
from pipelines.digits.text_encoder import PAD
from pipelines.flops import mmdit_forward_flops
from rewards.digits.edit import EDIT_WORDS, MAX_WORDS, edit_prompt_records

# the shipped editor's architecture; also the tiny random config used when no path is given
TRANSFORMER_CONFIG = dict(
    sample_size=16,
    patch_size=2,
    in_channels=6,  # the noisy sample + the source image
    out_channels=3,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=64,
    pooled_projection_dim=32,
    pos_embed_max_size=16,
)
VOCAB = [PAD, *EDIT_WORDS]


@register_family("digits_edit")
class DigitsEditAdapter(DigitsAdapter):
    """Adapter of the digits editing miniature (``editing = True``: prompts are :class:`EditPrompt` records).

    Args: those of :class:`~pipelines.digits.adapter.DigitsAdapter`; ``path`` is a folder written by
    ``scripts/pretrain_digits_edit.py`` (the shipped one is ``assets/digits_edit``).
    """

    editing = True
    folder_name = "digits_edit"
    pretrain_script = "scripts/pretrain_digits_edit.py"

    def __init__(self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, cfg_mode: str = "split"):
        super().__init__(path, dtype=dtype, device=device, seed=seed, cfg_mode=cfg_mode)
        self._prompts: list[EditPrompt] | None = None

    transformer_config = TRANSFORMER_CONFIG
    text_encoder_args = dict(vocab=VOCAB, max_length=MAX_WORDS)

    # -- protocol -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> TensorDict:
        """Instructions and their source images (float ``[B, 3, 16, 16]`` in [0, 1]) → ``prompt_embeds``,
        ``pooled_prompt_embeds``, ``source_latents`` and their ``negative_*`` twins (empty instruction, same source)."""
        if images is None:
            raise ValueError("digits_edit encodes an instruction with its source image: call encode_prompts(prompts, images) with float images [B, 3, 16, 16] in [0, 1]")
        n = len(prompts)
        if images.ndim != 4 or images.shape[0] != n or images.shape[1] != 3:
            raise ValueError(f"digits_edit: expected source images [{n}, 3, H, W] for {n} instructions, got {tuple(images.shape)}")
        dtype = next(self.denoiser.parameters()).dtype
        with torch.no_grad():
            seq, pooled = self.text_encoder.encode(list(prompts))
            neg_seq, neg_pooled = self.text_encoder.encode([""])
        source = self.images_to_latents(images.float()).to(device=self.device, dtype=dtype)
        return TensorDict(
            {
                "prompt_embeds": seq.to(dtype),
                "pooled_prompt_embeds": pooled.to(dtype),
                "source_latents": source,
                "negative_prompt_embeds": neg_seq.expand(n, -1, -1).to(dtype).clone(),
                "negative_pooled_prompt_embeds": neg_pooled.expand(n, -1).to(dtype).clone(),
                "negative_source_latents": source.clone(),
            },
            batch_size=[n],
        )

    def default_prompts(self) -> list[EditPrompt]:
        """60 editing prompts: 20 held-out real digits × (one recolour, two redraws) (``rewards.digits.edit.edit_prompt_records``)."""
        if self._prompts is None:
            self._prompts = [EditPrompt(instruction, source, name) for instruction, source, name in edit_prompt_records()]
        return list(self._prompts)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        source = cond["source_latents"].to(latents.dtype)
        if source.shape != latents.shape:
            raise ValueError(f"digits_edit: source latents {tuple(source.shape)} do not match the sample {tuple(latents.shape)}; set sampler.height/width to the sources' size (16)")
        return self.denoiser(
            hidden_states=torch.cat([latents, source], dim=1), encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"], timestep=1000.0 * sigma, return_dict=False,
        )[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.mmdit_forward_flops` over the ``(H/p)·(W/p)`` pixel patches (6 input channels) and the instruction's tokens."""
        _, h, w = self.latent_shape(height, width)
        p = int(self.denoiser.config.patch_size)
        return mmdit_forward_flops(dict(self.denoiser.config), (h // p) * (w // p), self.text_encoder.max_length, lora_rank)
