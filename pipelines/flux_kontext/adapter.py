"""FLUX.1 Kontext (instruction-based image editing) over diffusers, as ``diffusers.FluxKontextPipeline``
(``pipelines/flux/pipeline_flux_kontext.py``, diffusers 0.42) runs it: FLUX.1-dev's transformer, VAE, CLIP-L and T5
(:class:`~pipelines.flux.adapter.FluxAdapter`: packing, text embeddings, guidance embedding, dynamic shift), plus
the source image as context tokens.

* Source: VAE posterior mean (the pipeline's ``sample_mode="argmax"``) normalised as ``(z − shift_factor)·
  scaling_factor`` (:meth:`~pipelines.latent.LatentFlowFamily.encode_images`), kept unpacked in
  ``cond["image_latents"] [B, C, h_s, w_s]``. The text embeddings do not see the source, so FLUX's prompt cache
  (``cache_prompts``, ``drop_text_encoders``) serves them as for text-to-image FLUX.
* Forward (:meth:`FluxKontextAdapter._forward`): the packed noisy tokens, then the packed source tokens; image
  ids: the noisy tokens' ``(0, row, column)``, then the source's on its own grid with ``[…, 0] = 1``; the output
  is cut to the noisy tokens before unpacking. A source of another size than the output has its own grid.
* Guidance-distilled like FLUX.1-dev: ``guidance_scale`` feeds the guidance embedding, no unconditional branch
  and no ``negative_*`` entries. The schedule's dynamic shift counts the noisy tokens only (the pipeline's
  ``image_seq_len = latents.shape[1]``).
* Sizes: the pipeline rescales the output to ``max_area`` (1024²) and snaps the source to a preferred Kontext
  resolution (``_auto_resize``); here the output is the sampler's ``height × width`` and the source enters at the
  size given (the trainer resizes sources to the output size). ``FluxKontextPipeline(…, max_area=H·W,
  _auto_resize=False)`` computes what this adapter computes.

``model.path`` is a local diffusers folder laid out as FLUX.1's (``transformer/``, ``vae/``, ``text_encoder/``,
``text_encoder_2/``, ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``).
"""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from pipelines.base import check_source_images, register_family
from pipelines.flops import flux_forward_flops
from pipelines.flux.adapter import FluxAdapter, latent_image_ids
from pipelines.latent import pack_latents, unpack_latents
from pipelines.shapes import SHAPES, parent_shape, register_shape
from pipelines.tiny import tiny_edit_prompts

# the published shape: FLUX.1 Kontext runs FLUX.1-dev's transformer config (built through its builder)
register_shape(dataclasses.replace(
    SHAPES["flux_dev"], name="flux_kontext", family="flux_kontext",
    source="black-forest-labs/FLUX.1-Kontext-dev transformer/config.json (FLUX.1-dev's)",
), full=True, parent="flux_dev")


def source_image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[(h/2)·(w/2), 3]`` ids of the packed source tokens of a ``h × w`` source latent: ``(1, row, column)``
    (FluxKontextPipeline's ``image_ids``: the latent ids with the first coordinate set to 1)."""
    ids = latent_image_ids(h, w, device, dtype)
    ids[:, 0] = 1
    return ids


@register_family("flux_kontext")
class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext: :class:`~pipelines.flux.adapter.FluxAdapter` with the source image as context tokens.

    Args: those of :class:`~pipelines.flux.adapter.FluxAdapter`; ``shape`` takes ``tiny``, ``flux_kontext`` or
    ``full`` (FLUX.1-Kontext-dev's published shape, FLUX.1-dev's transformer config, with random weights).
    """

    family = "FLUX-Kontext"
    pipeline_class = "FluxKontextPipeline"
    lora_pipeline = pipeline_class
    editing = True

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = 512,
        sample_size: int | None = None, shape: str = "tiny",
    ):
        # Kontext's components are FLUX.1-dev's: FluxAdapter loads or builds them (a Kontext shape as its FLUX shape)
        super().__init__(
            path=path, dtype=dtype, device=device, seed=seed, decode_chunk=decode_chunk, drop_text_encoders=drop_text_encoders,
            max_sequence_length=max_sequence_length, sample_size=sample_size, shape=parent_shape("flux_kontext", shape),
        )

    def default_prompts(self):
        """The synthetic editing prompts of :func:`pipelines.tiny.tiny_edit_prompts` (coloured shapes, colour edits)."""
        return tiny_edit_prompts()

    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> TensorDict:
        """``prompt_embeds [B, L, D]`` and ``pooled_prompt_embeds [B, P]`` of the instructions (FLUX's, cached when
        :meth:`cache_prompts` ran) and the sources' latents ``image_latents [B, C, h_s, w_s]``.

        Args:
            prompts: ``B`` edit instructions.
            images: float ``[B, 3, H_s, W_s]`` in [0, 1], the source image of each instruction (any device).
        """
        check_source_images(self, prompts, images)
        cond = self._encode(list(prompts)).clone()
        cond["image_latents"] = self.encode_images(images).to(next(self.denoiser.parameters()).dtype)
        return cond

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond, guidance_scale: float = 1.0) -> torch.Tensor:
        """One transformer call on ``[noisy tokens; source tokens]`` with their ids; the output cut to the noisy tokens."""
        b, _, h, w = latents.shape
        dtype, device = latents.dtype, latents.device
        source = cond["image_latents"].to(device, dtype)
        guidance = torch.full((b,), float(guidance_scale), dtype=torch.float32, device=device).to(dtype) if self.guidance_embeds else None
        seq = cond["prompt_embeds"]
        ids = torch.cat([latent_image_ids(h, w, device, dtype), source_image_ids(*source.shape[-2:], device, dtype)])
        out = self.denoiser(
            hidden_states=torch.cat([pack_latents(latents), pack_latents(source)], dim=1), timestep=sigma.to(dtype),
            guidance=guidance, pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=seq,
            txt_ids=torch.zeros(seq.shape[1], 3, device=device, dtype=dtype), img_ids=ids, return_dict=False,
        )[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.flux_forward_flops` over ``2·(h/2)·(w/2)`` image tokens (the noisy latent's and a
        source of the output size, as the trainer resizes sources) and the T5 tokens."""
        _, h, w = self.latent_shape(height, width)
        return flux_forward_flops(dict(self.denoiser.config), 2 * (h // 2) * (w // 2), self.prompt_tokens(), lora_rank)


__all__ = ["FluxKontextAdapter", "source_image_ids"]
