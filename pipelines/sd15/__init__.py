"""Stable Diffusion 1.5: UNet (epsilon prediction), AutoencoderKL, CLIP text encoder; DDIM sampling."""

from pipelines.sd15.adapter import SD15Adapter

__all__ = ["SD15Adapter"]
